#!/usr/bin/env python3
"""Makes a copy of the bundled model (models/prism-tiny-llava) that vLLM serves, for the side-by-side
benchmark of issue 33 (tests/bench/bench_vs_vllm.py). Never commit the copy.

    python3 tools/make_vllm_model_copy.py OUT_DIR [--model-path models/prism-tiny-llava]

Two differences from the bundled folder, nothing else:

* tensor names: the bundled checkpoint (saved by transformers 5.24) keeps LLaVA's legacy top-level
  prefixes (`language_model.model.`, `language_model.lm_head.`) and its CLIP tower's modules
  directly under `vision_tower.`. vLLM 0.32's `LlavaForConditionalGeneration` maps the prefixes
  of checkpoints saved since transformers 4.52 (`model.language_model.`, `model.vision_tower.`,
  `model.multi_modal_projector.`, `lm_head.`) onto its modules, and its CLIP tower is a
  `CLIPVisionModel` with the transformer under `vision_model.`: it refuses the bundled names. The
  copy stores every tensor under those names (`model.vision_tower.vision_model.embeddings...`;
  transformers 5 loads them too). The bytes of every tensor are copied as they are (same dtype,
  same order): only the safetensors header changes.
* BOS: Prism's router adds the tokenizer's BOS to a chat prompt (`add_bos_token`, unless the
  template wrote it), vLLM's chat endpoint tokenizes the rendered template without special tokens.
  The copy's chat template writes `{{ bos_token }}` first, so both servers see the same prompt
  tokens (bench_vs_vllm.py checks `usage.prompt_tokens` of both before it measures).

Only the standard library is needed.
"""
import argparse
import json
import os
import shutil
import struct
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
BUNDLED = os.path.join(ROOT, "models", "prism-tiny-llava")
MAX_HEADER = 100 << 20   # safetensors' own limit on the JSON header

# bundled prefix -> the prefix vLLM loads, longest first
RENAMES = [("language_model.lm_head.", "lm_head."),
           ("language_model.model.", "model.language_model."),
           ("vision_tower.vision_model.", "model.vision_tower.vision_model."),
           ("vision_tower.", "model.vision_tower.vision_model."),
           ("multi_modal_projector.", "model.multi_modal_projector.")]


def new_name(name):
    for old, new in RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    if name.startswith(("model.", "lm_head.")):
        return name   # already the layout vLLM loads
    raise ValueError("unexpected tensor name %r: not a LLaVA checkpoint this tool knows" % name)


def read_header(f):
    raw = f.read(8)
    if len(raw) != 8:
        raise ValueError("not a safetensors file (shorter than its header length)")
    n = struct.unpack("<Q", raw)[0]
    if n > MAX_HEADER:
        raise ValueError("safetensors header of %d bytes: too large" % n)
    header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError("safetensors header is not an object")
    return header


def rename_safetensors(src, dst):
    with open(src, "rb") as f:
        header = read_header(f)
        out, seen = {}, set()
        for k, v in header.items():
            if k == "__metadata__":
                out[k] = v
                continue
            n = new_name(k)
            if n in seen:
                raise ValueError("two tensors map to %s" % n)
            seen.add(n)
            out[n] = v
        blob = json.dumps(out, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)   # keep the data section 8-byte aligned, as writers do
        with open(dst + ".tmp", "wb") as g:
            g.write(struct.pack("<Q", len(blob)))
            g.write(blob)
            shutil.copyfileobj(f, g, 1 << 20)   # the tensors' bytes, unchanged
    os.replace(dst + ".tmp", dst)
    return len(seen)


def with_bos(template):
    if template.lstrip().startswith("{{ bos_token }}"):
        return template
    return "{{ bos_token }}" + template


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output folder (created; must not be the bundled model's)")
    ap.add_argument("--model-path", default=BUNDLED)
    args = ap.parse_args()
    src, out = os.path.abspath(args.model_path), os.path.abspath(args.out)
    if src == out:
        sys.exit("make_vllm_model_copy: the output folder is the model's own")
    os.makedirs(out, exist_ok=True)
    n = 0
    for name in sorted(os.listdir(src)):
        p = os.path.join(src, name)
        if not os.path.isfile(p):
            continue
        if name.endswith(".safetensors"):
            n += rename_safetensors(p, os.path.join(out, name))
        elif name == "model.safetensors.index.json":
            with open(p) as f:
                idx = json.load(f)
            idx["weight_map"] = {new_name(k): v for k, v in idx["weight_map"].items()}
            with open(os.path.join(out, name), "w") as f:
                json.dump(idx, f, indent=2)
        elif name == "chat_template.jinja":
            with open(p) as f:
                t = f.read()
            with open(os.path.join(out, name), "w") as f:
                f.write(with_bos(t))
        elif name == "tokenizer_config.json":
            with open(p) as f:
                cfg = json.load(f)
            if isinstance(cfg.get("chat_template"), str):
                cfg["chat_template"] = with_bos(cfg["chat_template"])
            with open(os.path.join(out, name), "w") as f:
                json.dump(cfg, f, indent=2)
        else:
            shutil.copy(p, os.path.join(out, name))
    print("vLLM copy of %s in %s: %d tensors renamed, chat template with BOS" % (src, out, n))


if __name__ == "__main__":
    main()
