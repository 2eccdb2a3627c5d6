#!/usr/bin/env python3
"""tools/make_vllm_model_copy.py (issue 33's side-by-side with vLLM): the copy holds every tensor of
the bundled model, byte for byte, under the name vLLM loads, and its chat template writes the BOS
exactly once. Offline; only the standard library (with transformers and torch installed, also:
transformers loads the copy into the very model it loads from the bundled folder)."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cluster as cl  # noqa: E402

TOOL = os.path.join(cl.ROOT, "tools", "make_vllm_model_copy.py")
TMP = tempfile.mkdtemp(prefix="prism-vllm-copy-")
COPY = os.path.join(TMP, "copy")

# the names vLLM loads of a few bundled tensors, written out by hand (not from the tool's table)
EXPECTED = {
    "language_model.lm_head.weight": "lm_head.weight",
    "language_model.model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
    "language_model.model.layers.3.mlp.up_proj.weight": "model.language_model.layers.3.mlp.up_proj.weight",
    "vision_tower.embeddings.patch_embedding.weight": "model.vision_tower.vision_model.embeddings.patch_embedding.weight",
    "vision_tower.pre_layrnorm.bias": "model.vision_tower.vision_model.pre_layrnorm.bias",
    "vision_tower.encoder.layers.0.self_attn.q_proj.bias":
        "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.bias",
    "multi_modal_projector.linear_2.weight": "model.multi_modal_projector.linear_2.weight",
}


def tensors(path):
    """{name: (dtype, shape, bytes)} of a safetensors file, read with the format's own rules."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        b, e = v["data_offsets"]
        assert 0 <= b <= e <= len(data), (k, b, e, len(data))
        out[k] = (v["dtype"], v["shape"], data[b:e])
    return out


def make_copy():
    if os.path.isdir(COPY):
        shutil.rmtree(COPY)
    subprocess.run([sys.executable, TOOL, COPY], check=True, stdout=subprocess.DEVNULL)


def test_every_tensor_byte_identical_under_its_new_name():
    make_copy()
    old = tensors(os.path.join(cl.MODEL, "model.safetensors"))
    new = tensors(os.path.join(COPY, "model.safetensors"))
    assert len(new) == len(old), (len(new), len(old))
    for k, v in EXPECTED.items():
        assert k in old, k
        assert new.get(v) == old[k], "%s -> %s: missing or not the same bytes" % (k, v)
    by_bytes = {}
    for k, v in new.items():
        assert k.startswith(("model.language_model.", "model.vision_tower.vision_model.", "model.multi_modal_projector.",
                             "lm_head.")), k
        by_bytes.setdefault((v[0], tuple(v[1]), v[2]), []).append(k)
    for k, v in old.items():   # every bundled tensor is in the copy, unchanged
        assert (v[0], tuple(v[1]), v[2]) in by_bytes, "%s is not in the copy unchanged" % k


def test_transformers_loads_the_copy_as_the_bundled_model():
    try:
        import torch
        from transformers import LlavaForConditionalGeneration
    except ImportError:
        raise cl.Skip("transformers / torch not installed")
    if not os.path.isdir(COPY):
        make_copy()
    copy, info = LlavaForConditionalGeneration.from_pretrained(COPY, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    bundled = LlavaForConditionalGeneration.from_pretrained(cl.MODEL).state_dict()
    got = copy.state_dict()
    assert set(got) == set(bundled)
    for k, v in bundled.items():
        assert torch.equal(got[k], v), k


def test_template_writes_bos_once():
    make_copy()
    # a copy of the copy: the BOS is not written twice, the names stay (the tool is idempotent)
    again = os.path.join(TMP, "again")
    subprocess.run([sys.executable, TOOL, again, "--model-path", COPY], check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(again, "chat_template.jinja")) as f, open(os.path.join(COPY, "chat_template.jinja")) as g:
        assert f.read() == g.read(), "the BOS was written twice"
    assert tensors(os.path.join(again, "model.safetensors")) == tensors(os.path.join(COPY, "model.safetensors"))
    with open(os.path.join(cl.MODEL, "chat_template.jinja")) as f:
        orig = f.read()
    with open(os.path.join(COPY, "chat_template.jinja")) as f:
        tpl = f.read()
    assert tpl == "{{ bos_token }}" + orig, tpl[:80]
    with open(os.path.join(cl.MODEL, "tokenizer_config.json")) as f:
        orig_cfg = json.load(f)
    with open(os.path.join(COPY, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    assert cfg["chat_template"] == "{{ bos_token }}" + orig_cfg["chat_template"]
    assert {k: v for k, v in cfg.items() if k != "chat_template"} == \
        {k: v for k, v in orig_cfg.items() if k != "chat_template"}


def test_refuses_the_models_own_folder_and_unknown_names():
    r = subprocess.run([sys.executable, TOOL, cl.MODEL], capture_output=True, text=True)
    assert r.returncode != 0 and "own" in r.stderr, r.stderr
    bad = os.path.join(TMP, "bad")
    os.makedirs(bad, exist_ok=True)
    blob = json.dumps({"text_model.w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    with open(os.path.join(bad, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob + b"\0" * 4)
    r = subprocess.run([sys.executable, TOOL, os.path.join(TMP, "bad_out"), "--model-path", bad],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "unexpected tensor name" in r.stderr, r.stderr


if __name__ == "__main__":
    try:
        rc = cl.run_tests([test_every_tensor_byte_identical_under_its_new_name,
                           test_transformers_loads_the_copy_as_the_bundled_model, test_template_writes_bos_once,
                           test_refuses_the_models_own_folder_and_unknown_names])
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
    sys.exit(rc)
