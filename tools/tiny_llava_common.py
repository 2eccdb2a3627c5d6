"""Shared pieces of the bundled models/prism-tiny-llava checkpoint: the byte-level BPE tokenizer
(corpus built in code, deterministic), the LLaVA config, the side files Prism and transformers read
(tokenizer_config.json with the chat template, preprocessor/processor configs), and the synthetic
shape images the model is trained on.

Used by tools/train_tiny_llava.py (the trained model that is committed) and tools/make_tiny_llava.py
(a random-initialised checkpoint of the same shape).

render_shape() reimplements tools/prism_imgtool.c pixel for pixel (same colours, same geometry), so
the model trains on exactly what the integration tests send it: keep the two in step.
"""
import json
import os
import random

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<s>", "</s>", "<pad>", "<image>"]
VOCAB_SIZE = 4096
# GPT-2 / Llama-3 style split (Llama-3's pattern).
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] }}{{ '\\n' }}"
    "{% else %}{{ message['role'].upper() + ': ' }}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\\n' }}"
    "{% endfor %}{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] }}"
    "{% endfor %}{% endif %}{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

CORPUS_COLORS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "pink", "brown", "gray",
          "cyan", "magenta", "golden", "silver", "dark", "light", "bright", "pale"]
CORPUS_SHAPES = ["circle", "square", "triangle", "rectangle", "star", "line", "dot", "cross", "ring", "hexagon",
          "arrow", "heart", "diamond", "ellipse", "spiral", "grid", "stripe", "curve"]
THINGS = ["cat", "dog", "bird", "car", "tree", "house", "person", "boat", "flower", "horse", "train", "cup",
          "book", "chair", "table", "phone", "clock", "bicycle", "mountain", "river", "beach", "city",
          "street", "kitchen", "window", "door", "sky", "cloud", "sun", "moon", "apple", "banana", "pizza",
          "computer", "keyboard", "bottle", "plane", "bus", "child", "woman", "man", "garden", "field"]
PLACES = ["on a white background", "on a black background", "in the center", "in the top left corner",
          "in the bottom right corner", "next to a tree", "on the table", "in the sky", "near the window",
          "under a bridge", "on the street", "in a park", "at the beach", "in the kitchen", "on the grass"]
QUESTIONS = ["What is in the image?", "Describe the image.", "What color is the shape?",
             "How many objects are there?", "Where is the circle?", "What is the person doing?",
             "Is there a cat in the picture?", "What shape is shown?", "Describe this picture in detail.",
             "What can you see?", "Which object is the largest?", "Can you read the text?",
             "Explain what is happening.", "What time of day is it?", "Count the dots."]
GENERIC = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! This is a small test model for Prism.",
    "A vision-language model reads an image and answers questions about it.",
    "The image shows a simple scene with a few objects.",
    "There is one large object and two small objects.",
    "I can see a picture with bright colors and clear shapes.",
    "Tokens are generated one at a time until the end of the answer.",
    "The server streams each token back to the client as soon as it is ready.",
    "Please answer the question briefly and precisely.",
    "Yes. No. Maybe. I am not sure.",
    "It is a sunny day, and the sky is clear.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 2048 4096 65536.",
    "Punctuation: , . ; : ! ? ' \" ( ) [ ] { } - _ / \\ @ # $ % ^ & * + = < > | ~ `",
    "User: hi there! Assistant: Hello! How can I help you today?",
    "The weather is cold in winter and warm in summer.",
    "She said that the meeting starts at 10:30 tomorrow morning.",
    "Machine learning models need data, compute and careful evaluation.",
    "A red circle on a white background.",
    "What is in the image?",
    "Describe the image.",
]
WORDS = ("the of and to in is it that was for on are with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which "
         "do their time if will way about many then them write would like so these her long make thing see "
         "him two has look more day could go come did number sound no most people my over know water than "
         "call first who may down side been now find any new work part take get place made live where after "
         "back little only round man year came show every good me give our under name very through just form "
         "sentence great think say help low line differ turn cause much mean before move right boy old too "
         "same tell does set three want air well also play small end put home read hand port large spell add "
         "even land here must big high such follow act why ask men change went light kind off need house "
         "picture try us again animal point mother world near build self earth father head stand own page "
         "should country found answer school grow study still learn plant cover food between state keep eye "
         "never last let thought city cross farm hard start might story saw far sea draw left late run while "
         "press close night real life few north open seem together next white children begin got walk example "
         "ease paper group always music those both mark often letter until mile river car feet care second "
         "enough plain girl usual young ready above ever red list though feel talk bird soon body dog family "
         "direct pose leave song measure door product black short numeral class wind question happen complete "
         "ship area half rock order fire south problem piece told knew pass since top whole king space heard "
         "best hour better true during hundred five remember step early hold west ground interest reach fast "
         "verb sing listen six table travel less morning ten simple several vowel toward war lay against "
         "pattern slow center love money serve appear road map rain rule govern pull cold notice voice unit "
         "power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field "
         "rest correct able pound done beauty drive stood contain front teach week final gave green oh quick "
         "develop ocean warm free minute strong special mind behind clear tail produce fact street inch "
         "multiply nothing course stay wheel full force blue object decide surface deep island foot system "
         "busy test record boat common gold possible plane stead dry wonder laugh thousand ago ran check game "
         "shape equate hot miss brought heat snow tire bring yes distant fill east paint language among").split()


def build_corpus(seed=1234):
    rng = random.Random(seed)
    lines = list(GENERIC) + list(QUESTIONS)
    for c in CORPUS_COLORS:
        for s in CORPUS_SHAPES:
            lines.append(f"A {c} {s} {rng.choice(PLACES)}.")
            lines.append(f"The {s} is {c}.")
    for t in THINGS:
        for p in PLACES:
            lines.append(f"A photo of a {t} {p}.")
        lines.append(f"There are {rng.randint(2, 12)} {t}s in the image.")
        lines.append(f"USER: <image>\nWhat is the {t} doing? ASSISTANT: The {t} is {rng.choice(WORDS)}ing.")
    for _ in range(4000):
        n = rng.randint(4, 16)
        words = [rng.choice(WORDS) for _ in range(n)]
        s = " ".join(words)
        s = s[0].upper() + s[1:] + rng.choice([".", ".", ".", "?", "!", ","])
        lines.append(s)
    for i in range(0, 2000, 7):
        lines.append(f"{i} + {i % 13} = {i + i % 13}; {i * 3} items, {i / 4:.2f}%")
    for q in QUESTIONS:
        lines.append(f"USER: <image>\n{q}\nASSISTANT:")
    # Inflected and capitalised forms give the BPE trainer enough distinct pieces to reach ~4k merges.
    suffixes = ["", "s", "ed", "ing", "er", "ly", "ness", "tion", "able", "est", "ful", "less", "ment"]
    prefixes = ["", "", "", "un", "re", "pre", "over", "out", "mis"]
    vocab_words = WORDS + THINGS + CORPUS_SHAPES + CORPUS_COLORS
    for _ in range(6000):
        n = rng.randint(3, 12)
        ws = []
        for _ in range(n):
            w = rng.choice(prefixes) + rng.choice(vocab_words) + rng.choice(suffixes)
            if rng.random() < 0.15:
                w = w.capitalize()
            ws.append(w)
        lines.append(" ".join(ws) + rng.choice([".", ",", "!", "?", ":", ";", " -", "..."]))
    return lines


def build_tokenizer(corpus):
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]),
    ])
    return tok


def make_config(vocab, image_token_id, bos, eos, pad):
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig
    vision = CLIPVisionConfig(image_size=112, patch_size=14, hidden_size=128, num_hidden_layers=4,
                              num_attention_heads=4, intermediate_size=512, hidden_act="quick_gelu",
                              layer_norm_eps=1e-5, projection_dim=256, num_channels=3)
    text = LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=32, intermediate_size=688, vocab_size=vocab, max_position_embeddings=2048,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                       hidden_act="silu")
    return LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_token_id,
                       projector_hidden_act="gelu", vision_feature_layer=-2,
                       vision_feature_select_strategy="default", image_seq_length=64,
                       tie_word_embeddings=False)


def make_model(cfg, seed):
    """LLaVA model with transformers' default init (std 0.02), seeded."""
    import torch
    from transformers import LlavaForConditionalGeneration
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(cfg)


def special_ids(tok):
    return {s: tok.token_to_id(s) for s in SPECIAL}


PREPROCESSOR = {
    "crop_size": {"height": 112, "width": 112},
    "do_center_crop": True, "do_convert_rgb": True, "do_normalize": True, "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "CLIPImageProcessor",
    "processor_class": "LlavaProcessor",
    "resample": 3, "rescale_factor": 1 / 255,
    "size": {"shortest_edge": 112},
}


def write_side_files(out, tok):
    """tokenizer.json, tokenizer_config.json (with the chat template), special_tokens_map.json,
    preprocessor_config.json, processor_config.json and chat_template.jinja."""
    ids = special_ids(tok)
    tok.save(os.path.join(out, "tokenizer.json"))
    added = {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for s, i in ids.items()}
    tok_cfg = {
        "added_tokens_decoder": added,
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": None,
        "image_token": "<image>",
        "extra_special_tokens": {"image_token": "<image>"},
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(PREPROCESSOR, f, indent=2)
        f.write("\n")
    with open(os.path.join(out, "processor_config.json"), "w") as f:
        json.dump({"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
                   "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"},
                  f, indent=2)
        f.write("\n")
    # transformers 5 may write the template to chat_template.jinja; the tokenizer_config copy is the
    # one Prism reads, keep both identical.
    with open(os.path.join(out, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)


def save_checkpoint(model, tok, out):
    """Writes the model (bf16 safetensors, HF layout) and the side files into out; returns bytes."""
    import torch
    ids = special_ids(tok)
    model = model.to(torch.bfloat16)
    model.generation_config.bos_token_id = ids["<s>"]
    model.generation_config.eos_token_id = ids["</s>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    model.save_pretrained(out, safe_serialization=True)
    write_side_files(out, tok)
    for n in os.listdir(out):
        os.chmod(os.path.join(out, n), 0o644)
    return sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))


# ---------------------------------------------------------------- synthetic shape images

# Same RGB values as tools/prism_imgtool.c.
SHAPE_COLORS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220),
                "yellow": (240, 220, 30), "purple": (140, 40, 180), "orange": (250, 140, 20)}
BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0), "gray": (128, 128, 128)}
SHAPE_NAMES = ["circle", "square", "triangle"]


def shape_mask(xs, ys, w, h, shape, scale=0.3, off_x=0.0, off_y=0.0):
    """bool [len(ys)][len(xs)]: which of the points (xs[j], ys[i]) (pixel coordinates of a w x h
    picture) lie inside the shape. prism_imgtool's inside() test, float64, same expressions in the
    same order, so at pixel centres the masks are bit-identical."""
    cx = w / 2.0 + off_x * w
    cy = h / 2.0 + off_y * h
    r = scale * min(w, h)
    dx = xs - cx
    dy = ys - cy
    if shape == "circle":
        return (dx * dx)[None, :] + (dy * dy)[:, None] <= r * r
    if shape == "square":
        return (np.abs(dy) <= r * 0.85)[:, None] & (np.abs(dx) <= r * 0.85)[None, :]
    if shape == "triangle":
        top, bottom = cy - r, cy + r * 0.5
        rows = (ys >= top) & (ys <= bottom)
        half = (ys - top) / (bottom - top) * r * 0.866
        return rows[:, None] & (np.abs(dx)[None, :] <= half[:, None])
    raise ValueError(shape)


def render_shape(w, h, shape, color, background, scale=0.3, off_x=0.0, off_y=0.0):
    """uint8 [h][w][3]: exactly prism_imgtool's picture."""
    fg = np.array(SHAPE_COLORS[color], np.uint8)
    bg = np.array(BACKGROUNDS[background], np.uint8)
    mask = shape_mask(np.arange(w, dtype=np.float64) + 0.5, np.arange(h, dtype=np.float64) + 0.5, w, h, shape,
                      scale, off_x, off_y)
    return np.where(mask[:, :, None], fg, bg)


def answer_text(color, shape, background):
    return f"A {color} {shape} on a {background} background."


# Questions the model is trained on (a held-out paraphrase or two is useful for evaluation).
IMAGE_QUESTIONS = ["What is in the image?", "Describe the image.", "What do you see?",
                   "What is shown in this picture?", "Describe this picture.", "What can you see in the image?",
                   "What does the image show?", "Tell me what is in this image."]

# Text-only chats: any request without an image still gets a short, sensible answer.
TEXT_CHATS = [
    ("Hello", "Hello! Send me an image and I will describe it."),
    ("Hello there", "Hello! Send me an image and I will describe it."),
    ("Hi", "Hello! Send me an image and I will describe it."),
    ("Hi!", "Hello! Send me an image and I will describe it."),
    ("Who are you?", "I am a tiny vision model. I name the shape and colour in an image."),
    ("What can you do?", "I can describe a simple shape in an image: its colour and its form."),
    ("What is in the image?", "There is no image. Please send one."),
    ("Describe the image.", "There is no image. Please send one."),
    ("Thank you", "You are welcome."),
    ("Thanks!", "You are welcome."),
    ("How are you?", "I am fine, thank you."),
    ("Tell me a joke.", "I only know shapes and colours."),
]
TEXT_FALLBACK = "I can only describe simple shapes in images."
