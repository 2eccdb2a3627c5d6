#!/usr/bin/env python3
"""Builds models/prism-tiny-llava: a small random-initialised LLaVA-1.5-shaped checkpoint with a
real byte-level BPE tokenizer, shipped with Prism so the whole cluster runs and is tested without
downloading a model.

Deterministic: the corpus is built in code, the tokenizer trainer and torch are seeded, so running
this twice gives identical files.

    python3 tools/make_tiny_llava.py [--out models/prism-tiny-llava] [--check]

Shape: CLIP vision 112px / patch 14 (64 patches, hidden 128, 4 layers, quick_gelu), gelu projector,
feature layer -2 "default", Llama text (hidden 256, 4 layers, 8 heads / 4 kv heads, head_dim 32,
intermediate 688). Weights are stored in bf16 because fp32 would exceed the 20 MB budget.
"""
import argparse
import json
import os
import random
import shutil

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<s>", "</s>", "<pad>", "<image>"]
VOCAB_SIZE = 4096
# Weight init std. 0.02 (HF's default) makes a random 4-layer model collapse into repeating one
# token forever; 0.1 gives varied greedy output with comfortable top-1/top-2 logit margins, which
# makes streaming/stop-string tests and golden comparisons far more discriminating.
INIT_STD = 0.1
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

COLORS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "pink", "brown", "gray",
          "cyan", "magenta", "golden", "silver", "dark", "light", "bright", "pale"]
SHAPES = ["circle", "square", "triangle", "rectangle", "star", "line", "dot", "cross", "ring", "hexagon",
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
    for c in COLORS:
        for s in SHAPES:
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
    vocab_words = WORDS + THINGS + SHAPES + COLORS
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


def init_weights(model, std, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 and ("norm" in name or "layrnorm" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(std * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


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


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "models", "prism-tiny-llava"))
    ap.add_argument("--check", action="store_true", help="reload with transformers and generate")
    args = ap.parse_args()
    torch.manual_seed(0)
    out = os.path.abspath(args.out)
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)

    tok = build_tokenizer(build_corpus())
    vocab = tok.get_vocab_size()
    ids = {s: tok.token_to_id(s) for s in SPECIAL}
    tok.save(os.path.join(out, "tokenizer.json"))

    from transformers import LlavaForConditionalGeneration
    cfg = make_config(vocab, ids["<image>"], ids["<s>"], ids["</s>"], ids["<pad>"])
    model = LlavaForConditionalGeneration(cfg)
    init_weights(model, INIT_STD, seed=20240611)
    model = model.to(torch.bfloat16)
    model.generation_config.bos_token_id = ids["<s>"]
    model.generation_config.eos_token_id = ids["</s>"]
    model.generation_config.pad_token_id = ids["<pad>"]
    model.save_pretrained(out, safe_serialization=True)

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
    pre = {
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
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f, indent=2)
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
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write("# prism-tiny-llava\n\nRandom-initialised LLaVA-1.5-shaped model generated by "
                "`tools/make_tiny_llava.py` (seeded, deterministic). It produces gibberish: it exists so "
                "the cluster and its tests run end to end without downloading a model.\n\n"
                f"- tokenizer: byte-level BPE, vocab {vocab}, specials {ids}\n"
                "- vision: CLIP 112px, patch 14 (64 patches), hidden 128, 4 layers, quick_gelu\n"
                "- projector: gelu; feature layer -2, strategy default; 64 tokens per image\n"
                "- text: Llama, hidden 256, 4 layers, 8 heads / 4 kv heads, head_dim 32, intermediate 688\n"
                "- weights: bf16 safetensors\n")

    for n in os.listdir(out):
        os.chmod(os.path.join(out, n), 0o644)
    total = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    print(f"wrote {out}: vocab {vocab}, specials {ids}, {total / 1e6:.2f} MB")
    assert total <= 20e6, "model folder exceeds 20 MB"

    if args.check:
        from transformers import AutoProcessor, AutoTokenizer
        m = LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32)
        t = AutoTokenizer.from_pretrained(out)
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]
        prompt = t.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        print("prompt:", repr(prompt))
        proc = AutoProcessor.from_pretrained(out)
        from PIL import Image
        img = Image.new("RGB", (160, 120), (255, 0, 0))
        inp = proc(images=img, text=prompt, return_tensors="pt")
        print("input ids:", inp["input_ids"].shape, "pixels:", inp["pixel_values"].shape)
        g = m.generate(**inp, max_new_tokens=16, do_sample=False)
        print("generated:", g[0, inp["input_ids"].shape[1]:].tolist())
        print("text:", repr(t.decode(g[0, inp["input_ids"].shape[1]:])))


if __name__ == "__main__":
    main()
