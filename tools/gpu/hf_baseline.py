#!/usr/bin/env python3
"""HF transformers baseline for tools/gpu/gpu_bench: the same shapes (Llama-3-8B decode at batch
1/8/64 with a 512-token context, a 2048-token prefill, CLIP-L/336 + LLaVA projector at batch
1..64) with PyTorch SDPA, bf16, random weights built from a config (no download).

    python3 tools/gpu/hf_baseline.py --json hf.json            # on the GPU machine
    python3 tools/gpu/hf_baseline.py --tiny --device cpu        # smoke test anywhere

Each measurement is one JSON object per line, with the same keys as gpu_bench's where they
correspond (bench, batch, ctx, step_ms, tok_s, ms, images_s, device_bytes)."""
import argparse
import json
import sys
import time

import torch
import transformers
from transformers import CLIPVisionConfig, CLIPVisionModel, LlamaConfig, LlamaForCausalLM


def emit(f, obj):
    line = json.dumps(obj)
    print(line, flush=True)
    if f:
        f.write(line + "\n")
        f.flush()


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def build(cls, cfg, dev, dtype):
    cfg._attn_implementation = "sdpa"
    with torch.device(dev):
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)   # random init straight in bf16, on the device
        try:
            m = cls(cfg)
        finally:
            torch.set_default_dtype(prev)
    return m.to(dev, dtype).eval()


def llama_config(tiny):
    if tiny:
        return LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
                           num_key_value_heads=4, head_dim=32, vocab_size=4096, max_position_embeddings=4096,
                           rope_theta=500000.0)
    return LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5)


def forward_last(model, ids, **kw):
    """Forward that asks for the last token's logits only when this transformers supports it."""
    for key in ("logits_to_keep", "num_logits_to_keep"):
        try:
            return model(input_ids=ids, **kw, **{key: 1})
        except TypeError:
            continue
    return model(input_ids=ids, **kw)


@torch.inference_mode()
def bench_llama(args, dev, f):
    cfg = llama_config(args.tiny)
    t0 = time.perf_counter()
    model = build(LlamaForCausalLM, cfg, dev, torch.bfloat16)
    print(f"llama: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B params in {time.perf_counter() - t0:.1f}s",
          flush=True)
    V = cfg.vocab_size
    for B in args.batches:
        prompt = torch.randint(0, V, (B, args.ctx), device=dev)
        out = forward_last(model, prompt, use_cache=True)
        pkv = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(3):   # warm-up steps
            out = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
            pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync(dev)
        steps = args.steps
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=nxt, past_key_values=pkv, use_cache=True)
            pkv, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        sync(dev)
        dt = (time.perf_counter() - t0) / steps
        emit(f, {"bench": "hf_decode", "batch": B, "ctx": args.ctx, "step_ms": dt * 1e3, "tok_s": B / dt})
        del pkv, out
    T = args.prefill
    ids = torch.randint(0, V, (1, T), device=dev)
    forward_last(model, ids, use_cache=False)
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(3):
        forward_last(model, ids, use_cache=False)
    sync(dev)
    dt = (time.perf_counter() - t0) / 3
    emit(f, {"bench": "hf_prefill", "tokens": T, "ms": dt * 1e3, "tok_s": T / dt})
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()


@torch.inference_mode()
def bench_vit(args, dev, f):
    if args.tiny:
        vc = CLIPVisionConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                              image_size=112, patch_size=14, hidden_act="quick_gelu")
        proj = 256
    else:
        vc = CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                              image_size=336, patch_size=14, hidden_act="quick_gelu", layer_norm_eps=1e-5)
        proj = 4096
    tower = build(CLIPVisionModel, vc, dev, torch.bfloat16)
    projector = torch.nn.Sequential(torch.nn.Linear(vc.hidden_size, proj), torch.nn.GELU(),
                                    torch.nn.Linear(proj, proj)).to(dev, torch.bfloat16).eval()

    def encode(px):
        # LLaVA: hidden_states[-2], drop CLS, projector
        h = tower(pixel_values=px, output_hidden_states=True).hidden_states[-2][:, 1:]
        return projector(h)

    for B in args.vit_batches:
        px = torch.randn(B, 3, vc.image_size, vc.image_size, device=dev, dtype=torch.bfloat16)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        encode(px)
        sync(dev)
        reps = 3 if B >= 32 else 8
        t0 = time.perf_counter()
        for _ in range(reps):
            encode(px)
        sync(dev)
        dt = (time.perf_counter() - t0) / reps
        rec = {"bench": "hf_vit", "batch": B, "ms": dt * 1e3, "images_s": B / dt}
        if dev.type == "cuda":
            rec["device_bytes"] = torch.cuda.max_memory_allocated()
            rec["activation_bytes"] = torch.cuda.max_memory_allocated() - base
        emit(f, rec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes (smoke test)")
    ap.add_argument("--only", choices=["llama", "vit"])
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--vit-batches", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    args = ap.parse_args()
    dev = torch.device(args.device)
    f = open(args.json, "w") if args.json else None
    emit(f, {"bench": "hf_device", "torch": torch.__version__, "transformers": transformers.__version__,
             "name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"})
    torch.manual_seed(0)
    if args.only in (None, "llama"):
        bench_llama(args, dev, f)
    if args.only in (None, "vit"):
        bench_vit(args, dev, f)
    if f:
        f.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
