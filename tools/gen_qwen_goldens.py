#!/usr/bin/env python3
"""Generates the Qwen2.5-VL golden fixtures (fp32, CPU, Hugging Face transformers as the reference).
Deterministic (seeded); rerun after changing a case:

    python3 tools/gen_qwen_goldens.py [--only image,model]   # needs torch, transformers, tokenizers, pillow

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
    out = {"configs": configs, "cases": []}
    for name, w, h, seed, store in cases:
        proc = image_processor(configs[name])
        img = Image.fromarray(synth_image(w, h, seed), "RGB")
        o = proc(images=[img], return_tensors="np")
        pv, grid = o["pixel_values"], o["image_grid_thw"][0].tolist()
        p = configs[name]["patch_size"]
        frame = one_frame(pv, configs[name]["temporal_patch_size"], p).astype("<f4")
        case = {"config": name, "w": w, "h": h, "seed": seed, "grid_thw": grid, "n_patches": int(frame.shape[0]),
                "fnv1a64_f32": fnv1a64(frame.tobytes())}
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="image")
    a = ap.parse_args()
    only = set(a.only.split(","))
    if "image" in only:
        gen_image()
    if "model" in only:
        raise SystemExit("model goldens: not written yet")


if __name__ == "__main__":
    main()
