#!/usr/bin/env python3
"""Generates the Qwen2.5-VL and Qwen3-VL golden fixtures (fp32, CPU, Hugging Face transformers as the
reference). Deterministic (seeded); rerun after changing a case:

    python3 tools/gen_qwen_goldens.py [--only image,model,model3,request]   # needs torch, transformers, tokenizers, pillow

Writes:
  tests/data/image/qwenvl/       image-processor goldens (Qwen2VLImageProcessorPil, the class
                                 transformers picks without torchvision): pixel values for small
                                 cases, FNV-1a hashes of the float32 bytes for the rest, and the
                                 grid / token table of many sizes (smart_resize) at the real configs.
  tests/data/model/qwen25vl_tiny/
                                 a complete scaled-down Qwen2_5_VLForConditionalGeneration checkpoint
                                 in HF's own layout (config.json, model.safetensors as transformers
                                 saves it, tokenizer + chat template, preprocessor_config.json) and the
                                 goldens of the model cases (see MODEL_CASES).
  tests/data/model/qwen3vl_tiny/ the same for a scaled-down Qwen3VLForConditionalGeneration (model3);
                                 its vision rows carry the DeepStack features after the embedding.

The test picture is tools/gen_llama4_goldens.py's synth_image (tests/unit/image/llama4_synth.h
computes it in C), so no image files are needed.

Pixel values are stored as ONE frame per patch ([n_patches][3][p][p]): HF repeats a still image
temporal_patch_size times (feature c*T*p*p + t*p*p + ...); the script checks that the frames are
equal before dropping the copies (Prism's tower repeats the frame on the device).
"""
import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
IMAGE_OUT = os.path.join(ROOT, "tests", "data", "image", "qwenvl")
MODEL_OUT = os.path.join(ROOT, "tests", "data", "model")

from gen_llama4_goldens import synth_image  # noqa: E402


def fnv1a64(b):
    h = 0xcbf29ce484222325
    for byte in b:
        h ^= byte
        h = (h * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def one_frame(pv, T, p):
    """HF pixel_values [n][3*T*p*p] -> [n][3][p][p] after checking the T frames are equal."""
    n = pv.shape[0]
    x = pv.reshape(n, 3, T, p, p)
    for t in range(1, T):
        assert np.array_equal(x[:, :, t], x[:, :, 0]), "frames of a still image differ"
    return np.ascontiguousarray(x[:, :, 0])


def image_processor(cfg_dict):
    """Qwen2VLImageProcessorPil from a preprocessor_config dict, through AutoImageProcessor (so the
    class is the one transformers would pick)."""
    import tempfile
    from transformers import AutoImageProcessor
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "preprocessor_config.json"), "w") as f:
        json.dump(cfg_dict, f)
    p = AutoImageProcessor.from_pretrained(d)
    assert type(p).__name__ == "Qwen2VLImageProcessorPil", type(p)
    return p


QWEN25_PREPROC = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}
QWEN3_PREPROC = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
}
# A scaled config: max_pixels of 16 LM tokens, so clipping happens at small sizes.
SCALED_PREPROC = dict(QWEN25_PREPROC, min_pixels=3136, max_pixels=28 * 28 * 16)


def gen_image():
    from PIL import Image
    os.makedirs(IMAGE_OUT, exist_ok=True)
    configs = {"qwen25": QWEN25_PREPROC, "qwen3": QWEN3_PREPROC, "scaled": SCALED_PREPROC}
    # (config, w, h, seed, store values): min_pixels upscales (tiny images), exact multiples, odd sizes,
    # max_pixels clipping (scaled config), a 1:150 strip, and the real configs at common sizes.
    cases = [
        ("scaled", 20, 12, 1, True), ("scaled", 56, 56, 2, True), ("scaled", 97, 61, 3, True),
        ("scaled", 300, 200, 4, False), ("scaled", 123, 457, 5, False), ("scaled", 3000, 20, 6, False),
        ("scaled", 1, 1, 7, False), ("scaled", 29, 3, 8, False),
        ("qwen25", 640, 480, 9, False), ("qwen25", 1024, 1024, 10, False), ("qwen25", 333, 1999, 11, False),
        ("qwen25", 4000, 3500, 12, False), ("qwen25", 50, 40, 13, False),
        ("qwen3", 640, 480, 14, False), ("qwen3", 100, 700, 15, False),
        ("scaled", 60, 900, 16, False), ("qwen25", 900, 7000, 17, False),   # tall: Pillow 13 resizes vertically first
    ]
    # A request's mm_processor_kwargs (vLLM passes them to the processor call; a key left out is the
    # config's): a lower max_pixels, a higher min_pixels, both.
    request_cases = [
        ("qwen25", 640, 480, 9, {"max_pixels": 28 * 28 * 64}), ("qwen25", 50, 40, 13, {"min_pixels": 28 * 28 * 16}),
        ("scaled", 300, 200, 4, {"min_pixels": 28 * 28, "max_pixels": 28 * 28 * 4}),
        ("qwen3", 100, 700, 15, {"min_pixels": 32 * 32 * 40, "max_pixels": 32 * 32 * 90}),
    ]
    cases += [(name, w, h, seed, False, kw) for name, w, h, seed, kw in request_cases]
    out = {"configs": configs, "cases": []}
    for name, w, h, seed, store, *request in cases:
        proc = image_processor(configs[name])
        img = Image.fromarray(synth_image(w, h, seed), "RGB")
        kw = {}
        if request:
            c = configs[name]
            size = c.get("size", {})
            mn = request[0].get("min_pixels", c.get("min_pixels", size.get("shortest_edge")))
            mx = request[0].get("max_pixels", c.get("max_pixels", size.get("longest_edge")))
            kw = {"size": {"shortest_edge": mn, "longest_edge": mx}}
        o = proc(images=[img], return_tensors="np", **kw)
        pv, grid = o["pixel_values"], o["image_grid_thw"][0].tolist()
        p = configs[name]["patch_size"]
        frame = one_frame(pv, configs[name]["temporal_patch_size"], p).astype("<f4")
        case = {"config": name, "w": w, "h": h, "seed": seed, "grid_thw": grid, "n_patches": int(frame.shape[0]),
                "fnv1a64_f32": fnv1a64(frame.tobytes())}
        if request:
            case["request"] = request[0]
        if store:
            fn = "%s_%dx%d.f32" % (name, w, h)
            frame.tofile(os.path.join(IMAGE_OUT, fn))
            case["values"] = fn
        out["cases"].append(case)
        print("image %s %dx%d: grid %s" % (name, w, h, grid))
    # Grid table: smart_resize over many sizes at the real configs, from the processor's own
    # get_number_of_image_patches plus the grid of an actual run for a few.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    table = []
    rng = np.random.default_rng(7)
    sizes = [(1, 1), (1, 200), (200, 1), (201, 1), (1, 201), (1000, 4), (27, 28), (28, 28), (42, 42), (41, 43), (55, 57), (56, 56), (3584, 3584),
             (4096, 4096), (8192, 8192), (65535, 328), (1000, 5), (12, 2400)]
    sizes += [(int(a), int(b)) for a, b in rng.integers(1, 9000, size=(300, 2))]
    for name in ("qwen25", "qwen3"):
        c = configs[name]
        size = c.get("size", {})
        mn, mx = c.get("min_pixels", size.get("shortest_edge")), c.get("max_pixels", size.get("longest_edge"))
        f = c["patch_size"] * c["merge_size"]
        for w, h in sizes:
            try:
                rh, rw = smart_resize(h, w, factor=f, min_pixels=mn, max_pixels=mx)
            except ValueError:
                rh = rw = 0
            table.append([name, w, h, rw, rh])
    out["grid_table"] = table
    with open(os.path.join(IMAGE_OUT, "goldens.json"), "w") as fo:
        json.dump(out, fo, indent=1)
        fo.write("\n")


# ----------------------------------------------------------------------------- tokenizer

QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
]
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN_TOK_BASE = 448   # byte-level BPE ids [0, 448); Qwen's special tokens follow, in Qwen's order
QWEN_TOK_TOTAL = 512  # the model's vocab (Qwen pads its embedding beyond the tokenizer too)
# Qwen2.5-VL's chat template (chat_template.json of the released checkpoints)
QWEN25_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")


def build_qwen_tokenizer(out_dir, chat_template=None):
    """A Qwen2-style tokenizer.json (the layout of the real one, scaled): NFC, the Qwen split regex
    (Split Isolated + ByteLevel without its own regex), byte-level BPE, no BOS, Qwen's special tokens
    after the base vocabulary; tokenizer_config.json with Qwen2.5-VL's chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, \
        trainers
    corpus = []
    with open(os.path.join(ROOT, "tests", "data", "tokenizer", "corpus.jsonl")) as f:
        for line in f:
            corpus.append(json.loads(line))
    corpus += ["What is in the image? Describe the picture in one sentence.", "Compare the two pictures.",
               "The quick brown fox jumps over the lazy dog.", "You are a helpful assistant."] * 20
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    t.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    t.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tr = trainers.BpeTrainer(vocab_size=QWEN_TOK_BASE, show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(corpus, tr)
    assert t.get_vocab_size() == QWEN_TOK_BASE, t.get_vocab_size()
    t.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in QWEN_SPECIALS])
    os.makedirs(out_dir, exist_ok=True)
    t.save(os.path.join(out_dir, "tokenizer.json"))
    cfg = {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "model_max_length": 32768, "tokenizer_class": "Qwen2Tokenizer",
        "clean_up_tokenization_spaces": False, "errors": "replace", "split_special_tokens": False,
        "chat_template": chat_template or QWEN25_CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
        f.write("\n")
    return {n: t.token_to_id(n) for n in QWEN_SPECIALS}


# ----------------------------------------------------------------------------- model

N_GREEDY = 16
TINY_PREPROC = dict(QWEN25_PREPROC, min_pixels=3136, max_pixels=28 * 28 * 64)
# (name, messages with synthetic images given as (w, h, seed)); every case ends with text after its
# images, so text positions after an image (M-RoPE's max + 1) are exercised.
MODEL_CASES = [
    ("text", [{"role": "user", "content": [{"type": "text", "text": "Describe a quiet morning in one sentence."}]}]),
    ("one_image", [{"role": "user", "content": [{"type": "image", "image": (200, 150, 21)},
                                                {"type": "text", "text": "What is in the image?"}]}]),
    ("two_images", [{"role": "user", "content": [{"type": "image", "image": (200, 150, 22)},
                                                 {"type": "image", "image": (90, 120, 23)},
                                                 {"type": "text", "text": "Compare the two pictures."}]}]),
    ("min_pixels", [{"role": "user", "content": [{"type": "image", "image": (20, 30, 24)},
                                                 {"type": "text", "text": "What is in the image?"}]}]),
    ("max_pixels", [{"role": "user", "content": [{"type": "image", "image": (640, 480, 25)},
                                                 {"type": "text", "text": "Describe the picture in one sentence."}]}]),
    ("multi_turn", [{"role": "user", "content": [{"type": "image", "image": (150, 200, 26)},
                                                 {"type": "text", "text": "What is in the image?"}]},
                    {"role": "assistant", "content": [{"type": "text", "text": "A picture of a fox."}]},
                    {"role": "user", "content": [{"type": "text", "text": "The quick brown fox jumps over it?"}]}]),
]


def tiny_config(tok):
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "text_config": {
            "model_type": "qwen2_5_vl_text", "vocab_size": QWEN_TOK_TOTAL, "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "bos_token_id": tok["<|endoftext|>"], "eos_token_id": tok["<|im_end|>"], "initializer_range": 0.05,
            "use_sliding_window": False,
        },
        "vision_config": {
            "depth": 4, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "in_channels": 3,
            "out_hidden_size": 128, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "window_size": 56, "fullatt_block_indexes": [1, 3], "hidden_act": "silu", "tokens_per_second": 2,
            "initializer_range": 0.05,
        },
        "image_token_id": tok["<|image_pad|>"], "video_token_id": tok["<|video_pad|>"],
        "vision_start_token_id": tok["<|vision_start|>"], "vision_end_token_id": tok["<|vision_end|>"],
        "tie_word_embeddings": False,
    }


# Qwen3-VL-Instruct's chat template without its tool-calling branches (the fixture's template is a
# test input: Prism renders whatever template a checkpoint ships; what the tests pin is that Prism's
# rendering and the processor's ids equal HF's for the same template). Unlike Qwen2.5-VL's it adds
# no default system turn.
QWEN3_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}{%- if messages[0].content is string %}"
    "{{- messages[0].content }}{%- else %}{%- for content in messages[0].content %}{%- if 'text' in content %}"
    "{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}{%- if add_vision_id %}Picture {{ image_count.value }}: "
    "{% endif -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}{%- else %}{%- for item in message.content %}"
    "{%- if 'text' in item %}{{- item.text }}{%- endif %}{%- endfor %}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen3-VL's processor scaled like TINY_PREPROC (factor 32: 4 to 64 LM tokens), in the real
# config's size {shortest_edge, longest_edge} form.
TINY3_PREPROC = dict(QWEN3_PREPROC, size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64})


def tiny3_config(tok):
    """Qwen3VLForConditionalGeneration scaled down: head_dim 48 apart from hidden / heads, interleaved
    M-RoPE sections of unequal sizes, a 6 x 6 learned position grid (images larger and smaller than
    it), DeepStack after vision layers 0 and 2."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "text_config": {
            "model_type": "qwen3_vl_text", "vocab_size": QWEN_TOK_TOTAL, "hidden_size": 128, "head_dim": 48,
            "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [10, 7, 7],
                                "mrope_interleaved": True},
            "bos_token_id": tok["<|endoftext|>"], "eos_token_id": tok["<|im_end|>"], "initializer_range": 0.05,
        },
        "vision_config": {
            "depth": 4, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "in_channels": 3,
            "out_hidden_size": 128, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
            "num_position_embeddings": 36, "deepstack_visual_indexes": [0, 2], "hidden_act": "gelu_pytorch_tanh",
            "initializer_range": 0.05,
        },
        "image_token_id": tok["<|image_pad|>"], "video_token_id": tok["<|video_pad|>"],
        "vision_start_token_id": tok["<|vision_start|>"], "vision_end_token_id": tok["<|vision_end|>"],
        "tie_word_embeddings": False,
    }


VARIANTS = {
    "qwen25": dict(dir="qwen25vl_tiny", config=tiny_config, preproc=TINY_PREPROC, template=QWEN25_CHAT_TEMPLATE,
                   cfg_class="Qwen2_5_VLConfig", model_class="Qwen2_5_VLForConditionalGeneration",
                   proc_class="Qwen2_5_VLProcessor", patch=14),
    "qwen3": dict(dir="qwen3vl_tiny", config=tiny3_config, preproc=TINY3_PREPROC, template=QWEN3_CHAT_TEMPLATE,
                  cfg_class="Qwen3VLConfig", model_class="Qwen3VLForConditionalGeneration",
                  proc_class="Qwen3VLProcessor", patch=16),
}


def hf_messages(msgs):
    from PIL import Image
    out, images = [], []
    for m in msgs:
        content = []
        for c in m["content"]:
            if c["type"] == "image":
                w, h, seed = c["image"]
                img = Image.fromarray(synth_image(w, h, seed), "RGB")
                images.append(img)
                content.append({"type": "image", "image": img})
            else:
                content.append(c)
        out.append({"role": m["role"], "content": content})
    return out, images


def gen_model(variant="qwen25"):
    import torch
    import transformers
    from safetensors.torch import save_file
    V = VARIANTS[variant]
    torch.manual_seed(0)
    out = os.path.join(MODEL_OUT, V["dir"])
    if os.path.isdir(out):
        for f in os.listdir(out):
            os.remove(os.path.join(out, f))
    tok = build_qwen_tokenizer(out, V["template"])
    cfg_dict = V["config"](tok)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "preprocessor_config.json"), "w") as f:
        json.dump(V["preproc"], f, indent=1)
        f.write("\n")
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tok["<|endoftext|>"], "eos_token_id": [tok["<|im_end|>"], tok["<|endoftext|>"]],
                   "pad_token_id": tok["<|endoftext|>"], "do_sample": False}, f, indent=1)
        f.write("\n")
    config = getattr(transformers, V["cfg_class"])(**cfg_dict)
    config._attn_implementation = "eager"
    model = getattr(transformers, V["model_class"])(config).eval()
    # bf16 checkpoint; the reference computes in float32 on the bf16 values (what Prism loads)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    # The processor without its video half (Qwen2VLVideoProcessor needs torchvision, which would
    # also switch the image processor to the torchvision one): image processor + tokenizer +
    # the checkpoint's chat template, as AutoProcessor assembles them.
    from transformers import AutoImageProcessor, AutoTokenizer
    improc = AutoImageProcessor.from_pretrained(out)
    assert type(improc).__name__ == "Qwen2VLImageProcessorPil", type(improc)
    class NoVideoProcessor(getattr(transformers, V["proc_class"])):
        def check_argument_for_proper_class(self, name, arg):   # video_processor is None here
            return None
    proc = NoVideoProcessor(image_processor=improc, tokenizer=AutoTokenizer.from_pretrained(out),
                            chat_template=V["template"])
    n_ds = len(cfg_dict["vision_config"].get("deepstack_visual_indexes", []))
    golden = {"vocab": QWEN_TOK_TOTAL, "hidden": 128, "n_greedy": N_GREEDY, "tolerance": 1e-4,
              "row_floats": 128 * (1 + n_ds), "cases": []}
    vis = model.model.visual
    for name, msgs in MODEL_CASES:
        hm, images = hf_messages(msgs)
        enc = proc.apply_chat_template(hm, tokenize=True, add_generation_prompt=True, return_dict=True,
                                       return_tensors="pt")
        ids = enc["input_ids"]
        kw = {k: enc[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in enc}
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=enc["attention_mask"], max_new_tokens=N_GREEDY,
                                 do_sample=False, eos_token_id=None, pad_token_id=tok["<|endoftext|>"], **kw)
        greedy = gen[0, ids.shape[1]:].tolist()
        assert len(greedy) == N_GREEDY
        full = gen[:, : ids.shape[1] + N_GREEDY - 1]
        kw2 = dict(kw)
        if "mm_token_type_ids" in kw2:
            kw2["mm_token_type_ids"] = torch.cat(
                [kw2["mm_token_type_ids"], torch.zeros(1, N_GREEDY - 1, dtype=kw2["mm_token_type_ids"].dtype)], 1)
        with torch.no_grad():
            logits = model(input_ids=full, **kw2).logits[0].float()
        n_prompt = ids.shape[1]
        am = logits[n_prompt - 1:].argmax(-1).tolist()
        assert am == greedy, (name, am, greedy)   # generate (KV cache) == teacher-forced recompute
        # the conversation as the router hands it to the template (image parts {"type": "image"}),
        # the text the template renders, and the processor's ids (image pads expanded)
        plain = [{"role": mm["role"], "content": [{"type": "image"} if c["type"] == "image" else c
                                                  for c in mm["content"]]} for mm in msgs]
        text = proc.apply_chat_template(hm, tokenize=False, add_generation_prompt=True)
        case = {"name": name, "messages": plain, "text": text, "input_ids": ids[0].tolist(), "greedy": greedy,
                "images": []}
        # logits: every position for the first image case, the last prompt position + the greedy
        # steps for the others (fixtures stay small)
        rows = logits if name == "one_image" else logits[n_prompt - 1:]
        case["logits_from"] = 0 if name == "one_image" else n_prompt - 1
        write_rows = rows.contiguous().numpy().astype("<f4")
        fn = "logits_%s.bin" % name
        write_rows.tofile(os.path.join(out, fn))
        case["logits"] = fn
        if "image_grid_thw" in kw:
            feats = []
            with torch.no_grad():
                vo = vis(kw["pixel_values"], grid_thw=kw["image_grid_thw"])
            # one row per LM token: the embedding, then (Qwen3-VL) each DeepStack level's feature
            pooled = torch.cat([vo.pooler_output] + list(getattr(vo, "deepstack_features", None) or []), dim=-1)
            off = 0
            for (i, img), grid in zip(enumerate(images), kw["image_grid_thw"].tolist()):
                n_tok = grid[1] * grid[2] // 4
                f = pooled[off: off + n_tok].float().contiguous().numpy().astype("<f4")
                fn = "vision_%s_%d.bin" % (name, i)
                f.tofile(os.path.join(out, fn))
                w, h = img.size
                m = [c for mm in msgs for c in mm["content"] if c["type"] == "image"][i]["image"]
                case["images"].append({"w": w, "h": h, "seed": m[2], "grid": grid, "n_tokens": n_tok,
                                       "features": fn})
                off += n_tok
            assert off == pooled.shape[0]
            pv = one_frame(kw["pixel_values"].numpy(), 2, V["patch"]).astype("<f4")
            case["pixel_fnv1a64_f32"] = fnv1a64(pv.tobytes())
        golden["cases"].append(case)
        print("model case %s: %d prompt tokens, images %s, greedy %s" % (
            name, n_prompt, [c["grid"] for c in case["images"]], greedy))
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
        f.write("\n")


# A request's mm_processor_kwargs on the committed checkpoint (the model cases above regenerate it):
# (name, messages as MODEL_CASES, the request's kwargs, greedy tokens).
REQUEST_CASES = [
    ("max_pixels_request", [{"role": "user", "content": [{"type": "image", "image": (640, 480, 25)},
                                                         {"type": "text", "text": "Describe the picture in one sentence."}]}],
     {"max_pixels": 28 * 28 * 16}, 8),
    ("min_pixels_request", [{"role": "user", "content": [{"type": "image", "image": (20, 30, 24)},
                                                         {"type": "text", "text": "What is in the image?"}]}],
     {"min_pixels": 28 * 28 * 20}, 8),
]


def gen_request(variant="qwen25"):
    """golden_request.json beside the checkpoint: HF's prompt ids and greedy tokens when the processor
    is called with a request's min_pixels / max_pixels (size {shortest_edge, longest_edge}: what
    vLLM's mm_processor_kwargs become; a key left out is the checkpoint's)."""
    import torch
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    V = VARIANTS[variant]
    out = os.path.join(MODEL_OUT, V["dir"])
    model = getattr(transformers, V["model_class"]).from_pretrained(out, torch_dtype=torch.float32,
                                                                    attn_implementation="eager").eval()
    improc = AutoImageProcessor.from_pretrained(out)

    class NoVideoProcessor(getattr(transformers, V["proc_class"])):
        def check_argument_for_proper_class(self, name, arg):
            return None
    proc = NoVideoProcessor(image_processor=improc, tokenizer=AutoTokenizer.from_pretrained(out),
                            chat_template=V["template"])
    pad = proc.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    cases = []
    for name, msgs, kw, n_greedy in REQUEST_CASES:
        hm, images = hf_messages(msgs)
        size = {"shortest_edge": kw.get("min_pixels", V["preproc"]["min_pixels"]),
                "longest_edge": kw.get("max_pixels", V["preproc"]["max_pixels"])}
        text = proc.apply_chat_template(hm, tokenize=False, add_generation_prompt=True)
        enc = proc(text=[text], images=images, images_kwargs={"size": size}, return_tensors="pt")
        ids = enc["input_ids"]
        mm = {k: enc[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in enc}
        with torch.no_grad():
            gen = model.generate(input_ids=ids, attention_mask=enc["attention_mask"], max_new_tokens=n_greedy,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad, **mm)
        greedy = gen[0, ids.shape[1]:].tolist()
        plain = [{"role": m["role"], "content": [{"type": "image"} if c["type"] == "image" else c
                                                 for c in m["content"]]} for m in msgs]
        cases.append({"name": name, "messages": plain, "mm_processor_kwargs": kw, "input_ids": ids[0].tolist(),
                      "grid": enc["image_grid_thw"].tolist(), "greedy": greedy,
                      "images": [{"w": m["image"][0], "h": m["image"][1], "seed": m["image"][2]}
                                 for mm_ in msgs for m in mm_["content"] if m["type"] == "image"]})
        print("request case %s: %d prompt tokens, grid %s, greedy %s" % (name, ids.shape[1], cases[-1]["grid"], greedy))
    with open(os.path.join(out, "golden_request.json"), "w") as f:
        json.dump({"cases": cases}, f, indent=1)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="image,model,model3,request")
    a = ap.parse_args()
    only = set(a.only.split(","))
    if "image" in only:
        gen_image()
    if "model" in only:
        gen_model("qwen25")
    if "model3" in only:
        gen_model("qwen3")
    if "request" in only:
        gen_request("qwen25")


if __name__ == "__main__":
    main()
