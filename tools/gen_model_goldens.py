#!/usr/bin/env python3
"""Generates the golden fixtures for tests/unit/model (fp32, CPU, Hugging Face transformers as the
reference). Deterministic (seeded); rerun after changing a case:

    python3 tools/gen_model_goldens.py            # writes tests/data/model/*

Cases:
  tiny_llava   the bundled models/prism-tiny-llava (trained; bf16 weights, HF 'language_model.model.'
               keys) on a real picture (a red circle on white drawn like prism_imgtool, through the
               checkpoint's CLIPImageProcessor), so the greedy tokens spell the model's answer
  llava_like   a scaled-down random LLaVA-1.5-like checkpoint: CLIP quick_gelu, feature layer -2,
               'default' strategy, gelu projector; Llama with GQA, llama3 rope scaling and tied
               embeddings; saved with the newer 'model.language_model.' / 'model.vision_tower.
               vision_model.' key names, sharded in two files with model.safetensors.index.json;
               two images in the prompt
  qwen2_text   a small random Qwen2 text-only checkpoint (q/k/v biases, untied, f16 weights, eos list)

Each case folder holds golden.json (input ids, greedy tokens, shapes) and raw little-endian
float32 files: pixel_values.bin [n][3][S][S], vision_features.bin [n][image_seq][hidden],
logits.bin [n_prompt][vocab].
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
OUT = os.path.join(ROOT, "tests", "data", "model")
N_GREEDY = 32


def init_random(model, std, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 and ("norm" in name or "layrnorm" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def round_to(model, dtype):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(torch.float32))


def write_f32(path, t):
    t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tofile(path)


def greedy(model, input_ids, pixel_values=None):
    """N_GREEDY greedy tokens (no EOS stop: the C test decodes without stopping) and the smallest
    top-1/top-2 logit margin over those steps (a tiny one would make the golden fragile)."""
    gc = model.generation_config
    saved = gc.eos_token_id
    gc.eos_token_id = None
    # Explicit mask: generate would otherwise infer one from pad_token_id and mask real tokens
    # (tiny-llava's BOS id is 0).
    kw = dict(max_new_tokens=N_GREEDY, do_sample=False, attention_mask=torch.ones_like(input_ids),
              output_scores=True, return_dict_in_generate=True)
    if pixel_values is not None:
        kw["pixel_values"] = pixel_values
    out = model.generate(input_ids=input_ids, **kw)
    gc.eos_token_id = saved
    toks = out.sequences[0, input_ids.shape[1]:].tolist()
    assert len(toks) == N_GREEDY, len(toks)
    return toks, min_margin(torch.stack([sc[0] for sc in out.scores]))


def min_margin(logits):
    top2 = logits.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).min().item()


def write_case(name, model, input_ids, pixel_values, extra):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    model.eval()
    with torch.no_grad():
        if pixel_values is not None:
            feats = model.model.get_image_features(
                pixel_values=pixel_values, vision_feature_layer=model.config.vision_feature_layer,
                vision_feature_select_strategy=model.config.vision_feature_select_strategy).pooler_output
            feats = torch.stack(list(feats))
            out = model(input_ids=input_ids, pixel_values=pixel_values)
            write_f32(os.path.join(d, "pixel_values.bin"), pixel_values)
            write_f32(os.path.join(d, "vision_features.bin"), feats)
        else:
            out = model(input_ids=input_ids)
        logits = out.logits[0]
    write_f32(os.path.join(d, "logits.bin"), logits)
    toks, gen_margin = greedy(model, input_ids, pixel_values)
    meta = {
        "input_ids": input_ids[0].tolist(),
        "greedy": toks,
        "vocab": int(logits.shape[-1]),
        "n_images": 0 if pixel_values is None else int(pixel_values.shape[0]),
        "image_size": 0 if pixel_values is None else int(pixel_values.shape[-1]),
        "min_top2_margin": min_margin(logits),
        "min_greedy_margin": gen_margin,
        "tolerance": 1e-3,
    }
    if pixel_values is not None:
        meta["image_seq_length"] = int(feats.shape[1])
        meta["hidden"] = int(feats.shape[2])
    meta.update(extra)
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print(f"{name}: prompt {input_ids.shape[1]} tokens, greedy {toks[:8]}..., "
          f"min top-2 margin {meta['min_top2_margin']:.4f}, over greedy steps {gen_margin:.4f}")


def case_tiny_llava():
    import sys
    from PIL import Image
    from transformers import AutoTokenizer, CLIPImageProcessor, LlavaForConditionalGeneration
    sys.path.insert(0, HERE)
    from tiny_llava_common import render_shape
    mdir = os.path.join(ROOT, "models", "prism-tiny-llava")
    model = LlavaForConditionalGeneration.from_pretrained(mdir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(mdir)
    proc = CLIPImageProcessor.from_pretrained(mdir)
    cfg = model.config
    text = "USER: <image>\nWhat is in the image?\nASSISTANT:"
    ids = tok(text)["input_ids"]
    expanded = []
    for t in ids:
        expanded += [t] * cfg.image_seq_length if t == cfg.image_token_index else [t]
    input_ids = torch.tensor([expanded])
    img = Image.fromarray(render_shape(160, 120, "circle", "red", "white", 0.3, 0.03, -0.02), "RGB")
    px = proc(images=img, return_tensors="pt")["pixel_values"]
    write_case("tiny_llava", model, input_ids, px, {"model_dir": "models/prism-tiny-llava"})
    print("tiny_llava answer:", repr(tok.decode(json.load(open(os.path.join(OUT, "tiny_llava", "golden.json")))
                                                ["greedy"])))


def case_llava_like():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    torch.manual_seed(11)
    vision = CLIPVisionConfig(image_size=56, patch_size=14, hidden_size=64, num_hidden_layers=3,
                              num_attention_heads=4, intermediate_size=128, hidden_act="quick_gelu",
                              layer_norm_eps=1e-5, projection_dim=64)
    text = LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-5,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64},
                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = LlavaConfig(vision_config=vision, text_config=text, image_token_index=500, image_seq_length=16,
                      projector_hidden_act="gelu", vision_feature_layer=-2,
                      vision_feature_select_strategy="default", tie_word_embeddings=True)
    model = LlavaForConditionalGeneration(cfg)
    init_random(model, 0.15, seed=101)
    model.tie_weights()
    model.eval()
    g = torch.Generator().manual_seed(12)
    txt = torch.randint(3, 500, (40,), generator=g).tolist()
    ids = [1] + txt[:5] + [500] * 16 + txt[5:17] + [500] * 16 + txt[17:40]
    input_ids = torch.tensor([ids])
    px = torch.randn((2, 3, 56, 56), generator=g)
    d = os.path.join(OUT, "llava_like")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    # Newer key layout, tied lm_head omitted, sharded across two files.
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue
        k2 = k
        if k.startswith("model.vision_tower.") and not k.startswith("model.vision_tower.vision_model."):
            k2 = "model.vision_tower.vision_model." + k[len("model.vision_tower."):]
        sd[k2] = v.detach().clone().contiguous()
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    wmap = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, os.path.join(d, fname), metadata={"format": "pt"})
        for k in keys:
            wmap[k] = fname
    total = sum(t.numel() * 4 for t in sd.values())
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=1, sort_keys=True)
    cfg.save_pretrained(d)
    write_case("llava_like", model, input_ids, px, {"model_dir": "tests/data/model/llava_like"})


def case_qwen2_text():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(21)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, vocab_size=384, max_position_embeddings=512, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=[5, 7])
    model = Qwen2ForCausalLM(cfg)
    init_random(model, 0.2, seed=202)
    round_to(model, torch.float16)  # stored as f16: goldens must see the same weights
    model.eval()
    d = os.path.join(OUT, "qwen2_text")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(d)
    g = torch.Generator().manual_seed(22)
    input_ids = torch.randint(8, 384, (1, 21), generator=g)
    write_case("qwen2_text", model, input_ids, None, {"model_dir": "tests/data/model/qwen2_text"})


def main():
    torch.set_grad_enabled(False)
    os.makedirs(OUT, exist_ok=True)
    case_tiny_llava()
    case_llava_like()
    case_qwen2_text()
    for root, _, files in os.walk(OUT):
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)


if __name__ == "__main__":
    main()
