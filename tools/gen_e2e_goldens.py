#!/usr/bin/env python3
"""Generates the end-to-end fidelity goldens in tests/data/e2e/ (read by
tests/integration/test_fidelity.py): for each case an OpenAI request body and what Hugging Face
transformers answers to it with the bundled models/prism-tiny-llava (fp32, CPU, greedy).

Deterministic (images drawn with numpy/PIL from fixed parameters, fixed encoder settings; greedy
decoding). Rerun whenever the model, its tokenizer or its processor files change:

    PYTHONPATH="$TVLIB" python3 tools/gen_e2e_goldens.py     # writes tests/data/e2e/*

torchvision is required: transformers 5.x gives LlavaProcessor the torchvision CLIPImageProcessor
when torchvision is importable and CLIPImageProcessorPil otherwise; Prism's encoder_worker
implements the torchvision one (common/image/clip.h, impl PRISM_CLIP_RESAMPLE_TORCHVISION, the
default and what vLLM runs). Install it without CUDA packages:
    pip install --no-deps --target "$TVLIB" torchvision==0.29.2

Reference per case (what a user of transformers would do):
  * chat: text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    where each OpenAI image_url part becomes {"type": "image"}; inputs = processor(text=text,
    images=[PIL.Image.open(file) ...]) -- BOS from the tokenizer's post-processor, each <image>
    expanded to image_seq_length tokens by the processor;
  * completions: inputs = tokenizer(prompt) (BOS added, like vLLM's default add_special_tokens);
  * model.generate(**inputs, do_sample=False, max_new_tokens=32, output_logits=True,
    return_dict_in_generate=True): stops after EOS like generate does; the EOS token, when produced,
    counts as a completion token (vLLM/OpenAI usage) but is not part of the text;
  * text = tokenizer.decode(tokens, skip_special_tokens=True);
  * logprobs: float32 log_softmax of the raw logits (output_logits, not the processed scores) at each
    step: the chosen token's and the top 5 (ids, bytes, values).

golden.json: {"model_dir", "max_tokens", "top_logprobs", "cases": [{"name", "endpoint", "request",
"images", "prompt_ids", "tokens", "text", "finish_reason", "steps": [{"logprob", "bytes", "top":
[[id, logprob, bytes], ...], "next": the 6th logprob (ties at the cut)}], "min_top2_gap"}]}. In "request", an image part's url is the image's
file name in tests/data/e2e/; the test turns it into a base64 data URL.
"""
import io
import json
import os
import sys

import numpy as np
import torch
from PIL import Image, ImageDraw

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
OUT = os.path.join(ROOT, "tests", "data", "e2e")
MODEL_DIR = os.path.join(ROOT, "models", "prism-tiny-llava")
MAX_TOKENS = 32
TOP = 5
MODEL_NAME = "prism-tiny-llava"

sys.path.insert(0, HERE)
from tiny_llava_common import render_shape  # noqa: E402  (the pictures the model is trained on)


# ---------------------------------------------------------------- images

def shape_rgb(w, h, shape, color, background, scale=0.3, ox=0.0, oy=0.0):
    return Image.fromarray(render_shape(w, h, shape, color, background, scale, ox, oy), "RGB")


def gradient_rgb(w, h, seed):
    """A smooth photo-like picture (gradients plus a few soft blobs): exercises resampling and JPEG
    chroma more than flat shapes do, while staying small on disk."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w, 3))
    for c in range(3):
        a, b = rng.uniform(-1, 1, 2)
        img[..., c] = 128 + 90 * np.sin(a * x / w * 6 + b * y / h * 6 + c)
    for _ in range(4):
        cx, cy, r = rng.uniform(0, w), rng.uniform(0, h), rng.uniform(0.1, 0.3) * min(w, h)
        col = rng.uniform(0, 255, 3)
        m = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None]
        img = img * (1 - m) + col * m
    return Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8), "RGB")


def rgba_shape(w, h, shape, color, background):
    """RGBA: the shape opaque, the background partly transparent with an alpha ramp, so the
    white compositing of transformers' convert_to_rgb matters."""
    from tiny_llava_common import SHAPE_COLORS
    rgb = render_shape(w, h, shape, color, background, 0.32)
    fg = (rgb == np.array(SHAPE_COLORS[color], np.uint8)).all(-1)
    ramp = np.tile(np.linspace(40, 255, w).astype(np.uint8)[None, :], (h, 1))
    alpha = np.where(fg, 255, ramp).astype(np.uint8)
    return Image.fromarray(np.dstack([rgb, alpha]), "RGBA")


def save(img, name, **kw):
    path = os.path.join(OUT, name)
    fmt = "JPEG" if name.endswith(".jpg") else "PNG"
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    with open(path, "wb") as f:
        f.write(buf.getvalue())
    return name


def make_images():
    imgs = {}
    imgs["circle_red_640x480.jpg"] = save(shape_rgb(640, 480, "circle", "red", "white"),
                                          "circle_red_640x480.jpg", quality=90)
    imgs["square_blue_1500x1000_prog.jpg"] = save(shape_rgb(1500, 1000, "square", "blue", "gray", 0.3, 0.05, -0.03),
                                                  "square_blue_1500x1000_prog.jpg", quality=85, progressive=True)
    imgs["triangle_green_64x64.jpg"] = save(shape_rgb(64, 64, "triangle", "green", "black"),
                                            "triangle_green_64x64.jpg", quality=95)
    imgs["circle_blue_200x150_prog.jpg"] = save(shape_rgb(200, 150, "circle", "blue", "gray"),
                                                "circle_blue_200x150_prog.jpg", quality=88, progressive=True)
    imgs["square_red_300x200.png"] = save(shape_rgb(300, 200, "square", "red", "white"), "square_red_300x200.png")
    imgs["triangle_blue_120x400.png"] = save(shape_rgb(120, 400, "triangle", "blue", "white"),
                                             "triangle_blue_120x400.png")
    imgs["circle_green_256x256_rgba.png"] = save(rgba_shape(256, 256, "circle", "green", "black"),
                                                 "circle_green_256x256_rgba.png")
    imgs["gradient_800x600.jpg"] = save(gradient_rgb(800, 600, 7), "gradient_800x600.jpg", quality=80)
    imgs["gradient_333x217.png"] = save(gradient_rgb(333, 217, 8), "gradient_333x217.png")
    return imgs


# ---------------------------------------------------------------- cases

def chat(name, text, images=(), system=None, history=(), text_first=False):
    parts = [{"type": "image_url", "image_url": {"url": im}} for im in images]
    tpart = {"type": "text", "text": text}
    parts = [tpart] + parts if text_first else parts + [tpart]
    msgs = []
    if system:
        msgs.append({"role": "system", "content": system})
    for u, a in history:
        msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
    msgs.append({"role": "user", "content": parts if images else text})
    return {"name": name, "endpoint": "/v1/chat/completions",
            "request": {"model": MODEL_NAME, "messages": msgs}, "images": list(images)}


def completion(name, prompt):
    return {"name": name, "endpoint": "/v1/completions", "request": {"model": MODEL_NAME, "prompt": prompt},
            "images": []}


def build_cases():
    return [
        chat("jpeg_baseline_640x480", "What is in the image?", ["circle_red_640x480.jpg"]),
        chat("jpeg_progressive_1500x1000", "Describe the image.", ["square_blue_1500x1000_prog.jpg"]),
        chat("jpeg_baseline_64x64", "What do you see?", ["triangle_green_64x64.jpg"]),
        chat("jpeg_progressive_200x150", "What is shown in this picture?", ["circle_blue_200x150_prog.jpg"]),
        chat("png_rgb_300x200", "What is in the image?", ["square_red_300x200.png"]),
        chat("png_rgb_120x400_text_first", "Describe this picture.", ["triangle_blue_120x400.png"], text_first=True),
        chat("png_rgba_256x256", "What can you see in the image?", ["circle_green_256x256_rgba.png"]),
        chat("jpeg_photo_800x600", "What does the image show?", ["gradient_800x600.jpg"]),
        chat("png_photo_333x217", "Tell me what is in this image.", ["gradient_333x217.png"]),
        chat("two_images", "What is in the image?", ["square_red_300x200.png", "circle_red_640x480.jpg"]),
        chat("text_hello", "Hello there"),
        chat("text_system_history", "What can you do?", system="You are a helpful assistant.",
             history=[("Hi", "Hello! Send me an image and I will describe it.")]),
        chat("text_unicode", "Thanks! Größe 🙂 — naïve café"),
        completion("completion_text", "A red circle on a white background. The image shows"),
        completion("completion_short", "Hello"),
        # Long positions (the cases above end by position 151): three image spans up to ~220, and a
        # long text prompt (~450 tokens) whose prefill spans several chunks when the prefill worker
        # runs with a small --chunked-prefill-size.
        chat("three_images", "What is in the image?",
             ["triangle_green_64x64.jpg", "gradient_333x217.png", "circle_blue_200x150_prog.jpg"]),
        completion("completion_long", LONG_PROMPT),
    ]


LONG_PROMPT = " ".join(
    "Picture %d: a %s %s on a %s background, drawn in the middle of the frame." % (i, c, sh, bg)
    for i, (c, sh, bg) in enumerate([(c, sh, bg) for c in ("red", "green", "blue") for sh in ("circle", "square", "triangle")
                                     for bg in ("white", "gray")][:18])) + " The next picture shows"


# ---------------------------------------------------------------- reference

def token_bytes_fn(tok):
    """Raw bytes of one token id (byte-level BPE: map the token's characters back to bytes)."""
    # GPT-2's byte <-> printable-character table (what the ByteLevel pre-tokenizer uses)
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    inv = {chr(c): b for b, c in zip(bs, cs)}
    special = set(tok.all_special_ids) | {int(i) for i in tok.added_tokens_decoder}

    def f(i):
        s = tok.convert_ids_to_tokens(int(i))
        if int(i) in special:
            return list(s.encode("utf-8"))
        return [inv[c] for c in s]
    return f


def hf_messages(msgs):
    out = []
    for m in msgs:
        if isinstance(m["content"], str):
            out.append(dict(m))
        else:
            parts = [{"type": "image"} if p["type"] == "image_url" else dict(p) for p in m["content"]]
            out.append({"role": m["role"], "content": parts})
    return out


def run_case(case, model, proc, tbytes):
    tok = proc.tokenizer
    if case["endpoint"] == "/v1/chat/completions":
        text = proc.apply_chat_template(hf_messages(case["request"]["messages"]), add_generation_prompt=True,
                                        tokenize=False)
        imgs = [Image.open(os.path.join(OUT, n)) for n in case["images"]]
        inputs = proc(text=text, images=imgs or None, return_tensors="pt")
        case["rendered"] = text
    else:
        inputs = tok(case["request"]["prompt"], return_tensors="pt")
    ids = inputs["input_ids"]
    n_img_tok = int((ids == model.config.image_token_index).sum())
    assert n_img_tok == len(case["images"]) * model.config.image_seq_length, n_img_tok
    out = model.generate(**inputs, do_sample=False, max_new_tokens=MAX_TOKENS, output_logits=True,
                         return_dict_in_generate=True)
    toks = out.sequences[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    # generate pads finished sequences only in batches; with one sequence it simply stops.
    assert len(toks) == len(out.logits)
    steps, gaps = [], []
    for t, lg in zip(toks, out.logits):
        lp = torch.log_softmax(lg[0].to(torch.float32), dim=-1)
        vals, idx = torch.topk(lp, TOP + 1)  # one beyond the top-k: the test needs ties at the cut
        assert int(idx[0]) == t or float(vals[0]) == float(lp[t]), "greedy token is not the argmax"
        gaps.append(float(vals[0] - vals[1]))
        steps.append({"logprob": round(float(lp[t]), 6), "bytes": tbytes(t),
                      "top": [[int(i), round(float(v), 6), tbytes(i)] for v, i in zip(vals[:TOP], idx[:TOP])],
                      "next": round(float(vals[TOP]), 6)})
    case["prompt_ids"] = ids[0].tolist()
    case["tokens"] = toks
    case["text"] = tok.decode(toks, skip_special_tokens=True)
    case["finish_reason"] = "stop" if toks and toks[-1] in eos else "length"
    case["steps"] = steps
    case["min_top2_gap"] = round(min(gaps), 6)
    print("%-28s prompt %3d  gen %2d (%s)  min gap %.4f  %r" % (case["name"], len(case["prompt_ids"]), len(toks),
                                                                case["finish_reason"], min(gaps), case["text"][:60]))


def dump_golden(meta):
    """JSON with one line per case field and per generation step: small and diff-friendly."""
    def c(v):
        return json.dumps(v, ensure_ascii=False, separators=(",", ":"))
    lines = ["{"]
    for k, v in meta.items():
        if k != "cases":
            lines.append(" %s: %s," % (c(k), c(v)))
    lines.append(' "cases": [')
    for ci, case in enumerate(meta["cases"]):
        lines.append("  {")
        items = list(case.items())
        for ki, (k, v) in enumerate(items):
            end = "," if ki + 1 < len(items) else ""
            if k == "steps":
                lines.append('   "steps": [')
                lines += ["    %s%s" % (c(st), "," if si + 1 < len(v) else "") for si, st in enumerate(v)]
                lines.append("   ]" + end)
            else:
                lines.append("   %s: %s%s" % (c(k), c(v), end))
        lines.append("  }" + ("," if ci + 1 < len(meta["cases"]) else ""))
    lines += [" ]", "}", ""]
    json.loads("\n".join(lines))
    return "\n".join(lines)


def main():
    import argparse
    global OUT, MODEL_DIR
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=MODEL_DIR, help="LLaVA checkpoint (default: the bundled model)")
    ap.add_argument("--out", default=OUT, help="output folder (default: tests/data/e2e); its files are replaced")
    args = ap.parse_args()
    MODEL_DIR, OUT = os.path.abspath(args.model_dir), os.path.abspath(args.out)
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    proc = AutoProcessor.from_pretrained(MODEL_DIR)
    ip = type(proc.image_processor).__name__
    if ip != "CLIPImageProcessor":
        sys.exit("image processor is %s: install torchvision (see the docstring) so the goldens use the "
                 "torchvision CLIPImageProcessor that Prism's encoder implements" % ip)
    model = LlavaForConditionalGeneration.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()
    os.makedirs(OUT, exist_ok=True)
    for f in os.listdir(OUT):
        if f == "golden.json" or f.endswith((".jpg", ".png")):
            os.remove(os.path.join(OUT, f))
    make_images()
    tbytes = token_bytes_fn(proc.tokenizer)
    cases = build_cases()
    for c in cases:
        run_case(c, model, proc, tbytes)
    import transformers
    rel = os.path.relpath(MODEL_DIR, ROOT)
    meta = {"generator": "tools/gen_e2e_goldens.py", "model_dir": MODEL_DIR if rel.startswith("..") else rel,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "image_processor": ip + " (torchvision backend)", "max_tokens": MAX_TOKENS, "top_logprobs": TOP,
            "cases": cases}
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        f.write(dump_golden(meta))
    fragile = [c["name"] for c in cases if c["min_top2_gap"] < 2e-3]
    if fragile:
        print("note: greedy top-2 gap under 2e-3 in %s: a backend off by ~1e-3 could pick the other token" % fragile)
    total = sum(os.path.getsize(os.path.join(OUT, f)) for f in os.listdir(OUT))
    print("wrote %d cases, %d files, %.1f KB in %s" % (len(cases), len(os.listdir(OUT)), total / 1024, OUT))


if __name__ == "__main__":
    main()
