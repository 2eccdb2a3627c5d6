#!/usr/bin/env python3
"""Generates the Llama-4 golden fixtures (fp32, CPU, Hugging Face transformers as the reference).
Deterministic (seeded); rerun after changing a case:

    python3 tools/gen_llama4_goldens.py          # needs torch, torchvision, transformers, tokenizers

Writes:
  tests/data/model/llama4_tiny/   a complete scaled-down Llama4ForConditionalGeneration checkpoint in
                                  HF's own layout (config.json, bf16 model.safetensors with the
                                  'language_model.model.' / 'vision_model.' keys transformers saves,
                                  tokenizer.json + tokenizer_config.json with Llama-4's chat template,
                                  preprocessor_config.json) plus goldens: golden.json (prompt ids from
                                  the real processor, greedy tokens), pixel_values.bin, vision_features.bin,
                                  logits.bin [n_prompt + n_greedy][vocab] (teacher-forced full forward).
  tests/data/model/llama4_text/   a text-only Llama4ForCausalLM ('model.' keys, model_type llama4_text):
                                  top-2 routing, MoE in every layer, no QK norm, f32 weights.
  tests/data/image/llama4/        image-processor goldens: pixel values (bf16, as HF returns them) for
                                  many sizes and aspect ratios at a small tile, FNV hashes at the real
                                  336/16 config, and the tile grid / token count table.
  tests/data/template/llama4_goldens.json
                                  Llama-4's chat template (transformers' Llama4Processor default) over
                                  conversations, the token ids of the rendered text, and the processor's
                                  full input_ids with images expanded.

What each model case exercises (the C tests say which case covers what):
  llama4_tiny  interleaved-pair RoPE with llama3 scaling (original_max_position_embeddings 16, so the
               scaling bands matter at the test positions); NoPE layer 2 (full causal attention) with
               temperature tuning (floor_scale 16, attn_scale 0.4: the scale changes every 16
               positions); chunked attention on the RoPE layers with attention_chunk_size 32 < prompt;
               per-head QK L2 norm; MoE (4 experts, top-1 sigmoid router scaling the expert input,
               shared expert) in layers 1 and 3 (interleave_moe_layer_step 2), dense MLP
               (intermediate_size_mlp) in 0 and 2; vision tower on 56-px tiles (patch 7, 8x8 grid,
               CLS appended last, 2D RoPE, no causal mask), pixel shuffle 0.5, adapter, projector;
               an image needing 2x3 tiles plus the global tile.
  llama4_text  Llama4ForCausalLM alone: top-2 routing (every selected expert gets sigmoid(its logit) x),
               MoE in every layer, use_qk_norm false, chunk 16, NoPE layer 3.

Cross-checks done here before anything is written (the script fails otherwise):
  * an independent torch implementation of the text and vision forwards (written from the math in
    the design notes, not from transformers' code) matches HF within 2e-5 — this covers the chunked
    mask rule (kv <= q and kv // chunk == q // chunk; transformers fixed a bug there, #37351), the
    router-weight order, QK norm per head, the pixel-shuffle index map and the 2D RoPE;
  * HF's generate (DynamicCache, chunked layers) equals greedy by full recompute.

transformers 5.24 quirk: Llama4ForConditionalGeneration.forward reads `outputs.image_outputs` from the
language model's MoeCausalLMOutputWithPast, which has no such field; a class attribute supplies None
(it changes no numbers).
"""
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
MODEL_OUT = os.path.join(ROOT, "tests", "data", "model")
IMAGE_OUT = os.path.join(ROOT, "tests", "data", "image", "llama4")
TEMPLATE_OUT = os.path.join(ROOT, "tests", "data", "template")
N_GREEDY = 32

import transformers  # noqa: E402
from transformers import modeling_outputs  # noqa: E402

if not hasattr(modeling_outputs.MoeCausalLMOutputWithPast, "image_outputs"):
    modeling_outputs.MoeCausalLMOutputWithPast.image_outputs = None


# ----------------------------------------------------------------------------- synthetic images

def synth_image(w, h, seed=0):
    """Deterministic RGB test picture [h][w][3] uint8; tests/unit/image/llama4 computes the same
    formula in C (uint32 wrap-around arithmetic), so no image files are needed: a smooth gradient
    plus a hashed texture, so resampling sees both edges and flat areas."""
    y, x = np.mgrid[0:h, 0:w].astype(np.uint32)
    out = np.zeros((h, w, 3), np.uint8)
    with np.errstate(over="ignore"):          # uint32 wrap-around is the point
        return _synth_fill(out, x, y, w, h, seed)


def _synth_fill(out, x, y, w, h, seed):
    for c in range(3):
        cc = np.uint32(c)
        hsh = (x * np.uint32(73856093)) ^ (y * np.uint32(19349663)) ^ ((cc + np.uint32(seed)) * np.uint32(83492791))
        hsh = (hsh * np.uint32(2654435761)) >> np.uint32(27)           # 0..31
        grad = ((x * np.uint32(255)) // np.uint32(max(w - 1, 1)) * (np.uint32(1) + cc) +
                (y * np.uint32(255)) // np.uint32(max(h - 1, 1)) * (np.uint32(3) - cc)) // np.uint32(4)
        out[:, :, c] = ((grad + hsh) & np.uint32(255)).astype(np.uint8)
    return out


def write_f32(path, t):
    t.detach().to(torch.float32).contiguous().numpy().astype("<f4").tofile(path)


def write_bf16(path, t):
    """bf16 values (exactly representable) as little-endian uint16."""
    u = t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().astype("<i2")
    u.tofile(path)


def fnv1a64_bf16(t):
    b = t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().astype("<i2").tobytes()
    h = 0xcbf29ce484222325
    for byte in b:
        h ^= byte
        h = (h * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def chmod_tree(d):
    for root, _, files in os.walk(d):
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)


# ----------------------------------------------------------------------------- tokenizer

SPECIALS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|header_start|>", "<|header_end|>", "<|eom|>", "<|eot|>", "<|step|>",
    "<|python_start|>", "<|python_end|>", "<|finetune_right_pad|>",
    "<|image_start|>", "<|image_end|>", "<|vision_reserved_special_token_0|>",
    "<|vision_reserved_special_token_1|>", "<|tile_x_separator|>", "<|tile_y_separator|>",
    "<|vision_reserved_special_token_2|>", "<|image|>", "<|vision_reserved_special_token_3|>", "<|patch|>",
    "<|reasoning_thinking_start|>", "<|reasoning_thinking_end|>",
]
O200K_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TOK_BASE = 448      # byte-level BPE ids [0, 448); specials follow, padded with reserved ones to 512
TOK_TOTAL = 512


def build_tokenizer(out_dir):
    """A Llama-4 style tokenizer.json (the layout of the real one, scaled): byte-level BPE with
    ignore_merges, the o200k split regex (Split Isolated + ByteLevel without its own regex), BOS
    added by a TemplateProcessing post-processor, Llama-4's special tokens after the base vocabulary."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    corpus = []
    with open(os.path.join(ROOT, "tests", "data", "tokenizer", "corpus.jsonl")) as f:
        for line in f:
            corpus.append(json.loads(line))
    corpus += ["What is in the image? Describe the picture in one sentence.",
               "The quick brown fox jumps over the lazy dog.", "You are a helpful assistant."] * 20
    t = Tokenizer(models.BPE(ignore_merges=True))
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(O200K_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    t.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tr = trainers.BpeTrainer(vocab_size=TOK_BASE, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(corpus, tr)
    assert t.get_vocab_size() == TOK_BASE, t.get_vocab_size()
    names = list(SPECIALS)
    i = 0
    while len(names) < TOK_TOTAL - TOK_BASE:
        names.append("<|reserved_special_token_%d|>" % i)
        i += 1
    t.add_special_tokens([AddedToken(n, special=True, normalized=False) for n in names])
    bos = t.token_to_id("<|begin_of_text|>")
    t.post_processor = processors.Sequence([
        processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    assert t.get_vocab_size() == TOK_TOTAL
    os.makedirs(out_dir, exist_ok=True)
    t.save(os.path.join(out_dir, "tokenizer.json"))
    from transformers.models.llama4 import processing_llama4
    cfg = {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot|>", "pad_token": "<|finetune_right_pad|>",
        "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False, "add_bos_token": True,
        "chat_template": processing_llama4.chat_template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
        f.write("\n")
    return {n: t.token_to_id(n) for n in SPECIALS}


# ----------------------------------------------------------------------------- reference forwards
# Written from the math in the design notes (not from transformers' code), to cross-check HF.

def ref_inv_freq(rp, dim):
    theta = float(rp["rope_theta"])
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rp.get("rope_type", "default") == "llama3":
        # float32 tensor arithmetic throughout (as the C side computes it)
        factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        lw, hw = old / lo, old / hi
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > lw, inv / factor, inv)
        s = (old / wl - lo) / (hi - lo)
        mid = (~(wl < hw)) & (~(wl > lw))
        inv = torch.where(mid, (1 - s) * scaled / factor + s * scaled, scaled)
    return inv


def rot_pairs(x, ang):
    """Interleaved pairs (x[2i], x[2i+1]) rotated by ang[..., i]; x [..., D], ang broadcastable to [..., D/2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = torch.cos(ang), torch.sin(ang)
    return torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)


def rms(x, w, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def ref_text_logits(sd, pfx, head_key, tc, emb):
    T = emb.shape[0]
    H, nh, nkv, hd = tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads, tc.head_dim
    eps = tc.rms_norm_eps
    pos = torch.arange(T, dtype=torch.float32)
    inv = ref_inv_freq(tc.rope_parameters, hd)
    ang = pos[:, None] * inv[None, :]                        # [T, hd/2]
    qi, kj = torch.arange(T)[:, None], torch.arange(T)[None, :]
    causal = kj <= qi
    chunk = tc.attention_chunk_size
    x = emb.clone()
    for L in range(tc.num_hidden_layers):
        p = "%slayers.%d." % (pfx, L)
        h = rms(x, sd[p + "input_layernorm.weight"], eps)
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(T, nh, hd)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd)
        rope = bool(tc.no_rope_layers[L])
        if rope:
            q, k = rot_pairs(q, ang[:, None, :]), rot_pairs(k, ang[:, None, :])
            if tc.use_qk_norm:
                q, k = rms(q, None, eps), rms(k, None, eps)
        elif tc.attn_temperature_tuning:
            sc = torch.log1p(torch.floor((pos + 1.0) / tc.floor_scale)) * tc.attn_scale + 1.0
            q = q * sc[:, None, None]
        mask = causal & ((kj // chunk) == (qi // chunk)) if (rope and chunk) else causal
        g = nh // nkv
        out = torch.empty(T, nh, hd)
        for hh in range(nh):
            s = (q[:, hh] @ k[:, hh // g].T) * hd ** -0.5
            s = s.masked_fill(~mask, float("-inf"))
            out[:, hh] = torch.softmax(s, -1) @ v[:, hh // g]
        x = x + out.reshape(T, nh * hd) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"], eps)
        f = p + "feed_forward."
        if L in tc.moe_layers:
            def mlp(z, pre):
                return (F.silu(z @ sd[pre + "gate_proj.weight"].T) * (z @ sd[pre + "up_proj.weight"].T)) @ sd[pre + "down_proj.weight"].T
            y = mlp(h, f + "shared_expert.")
            logits = h @ sd[f + "router.weight"].T
            top_v, top_i = torch.topk(logits, tc.num_experts_per_tok, dim=-1)
            gu, dn, I = sd[f + "experts.gate_up_proj"], sd[f + "experts.down_proj"], tc.intermediate_size
            for t in range(T):
                for j in range(tc.num_experts_per_tok):
                    e = int(top_i[t, j])
                    z = torch.sigmoid(top_v[t, j]) * h[t]          # the score scales the expert INPUT
                    a = z @ gu[e]
                    y[t] += (F.silu(a[:I]) * a[I:]) @ dn[e]
        else:
            y = (F.silu(h @ sd[f + "gate_proj.weight"].T) * (h @ sd[f + "up_proj.weight"].T)) @ sd[f + "down_proj.weight"].T
        x = x + y
    return rms(x, sd[pfx + "norm.weight"], eps) @ sd[head_key].T


def ref_pixel_shuffle(x, g):
    """[n, g*g, C] -> [n, (g/2)^2, 4C]: out[h2*(g/2)+w2][(dh*2+dw)*C + c] = x[(2h2+dh)*g + 2w2+dw][c]."""
    n, _, C = x.shape
    out = torch.empty(n, (g // 2) ** 2, 4 * C)
    for h2 in range(g // 2):
        for w2 in range(g // 2):
            for dh in range(2):
                for dw in range(2):
                    out[:, h2 * (g // 2) + w2, (dh * 2 + dw) * C:(dh * 2 + dw + 1) * C] = x[:, (2 * h2 + dh) * g + 2 * w2 + dw]
    return out


def ref_vision(sd, vc, px):
    """Adapter output [n_tiles, tokens, projector_output_dim] before the projector."""
    n, C, S, _ = px.shape
    P, VH, nh = vc.patch_size, vc.hidden_size, vc.num_attention_heads
    g, hd = S // P, VH // nh
    patches = px.reshape(n, C, g, P, g, P).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, C * P * P)
    x = patches @ sd["vision_model.patch_embedding.linear.weight"].T
    x = torch.cat([x, sd["vision_model.class_embedding"].expand(n, 1, VH)], dim=1)   # CLS last
    x = x + sd["vision_model.positional_embedding_vlm"]
    ln = lambda z, pre: F.layer_norm(z, (VH,), sd[pre + ".weight"], sd[pre + ".bias"], 1e-5)
    x = ln(x, "vision_model.layernorm_pre")
    nf = hd // 4
    f = 1.0 / (float(vc.rope_parameters["rope_theta"]) ** (torch.arange(0, 2 * nf, 2, dtype=torch.float32) / (hd // 2)))
    idx = torch.arange(g * g)
    ax = ((idx % g + 1).float()[:, None] * f[None, :])
    ay = ((idx // g + 1).float()[:, None] * f[None, :])
    ang = torch.cat([torch.cat([ax, ay], dim=1), torch.zeros(1, 2 * nf)], dim=0)       # CLS angle 0
    for L in range(vc.num_hidden_layers):
        p = "vision_model.model.layers.%d." % L
        h = ln(x, p + "input_layernorm")
        proj = lambda z, nm: z @ sd[p + "self_attn.%s_proj.weight" % nm].T + sd[p + "self_attn.%s_proj.bias" % nm]
        q, k, v = (proj(h, nm).view(n, g * g + 1, nh, hd) for nm in ("q", "k", "v"))
        q, k = rot_pairs(q, ang[None, :, None, :]), rot_pairs(k, ang[None, :, None, :])
        att = torch.softmax(torch.einsum("nihd,njhd->nhij", q, k) * hd ** -0.5, -1)
        o = torch.einsum("nhij,njhd->nihd", att, v).reshape(n, g * g + 1, VH)
        x = x + o @ sd[p + "self_attn.o_proj.weight"].T + sd[p + "self_attn.o_proj.bias"]
        h = ln(x, p + "post_attention_layernorm")
        h = F.gelu(h @ sd[p + "mlp.fc1.weight"].T + sd[p + "mlp.fc1.bias"])
        x = x + h @ sd[p + "mlp.fc2.weight"].T + sd[p + "mlp.fc2.bias"]
    x = ln(x, "vision_model.layernorm_post")[:, :-1]
    x = ref_pixel_shuffle(x, g)
    x = F.gelu(x @ sd["vision_model.vision_adapter.mlp.fc1.weight"].T)
    return F.gelu(x @ sd["vision_model.vision_adapter.mlp.fc2.weight"].T)


# ----------------------------------------------------------------------------- model cases

def init_random(model, std, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1 and "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def round_to(model, dtype):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).to(torch.float32))


def min_margin(logits):
    top2 = logits.topk(2, dim=-1).values
    return (top2[..., 0] - top2[..., 1]).min().item()


def greedy_full(step_logits_fn, ids, n):
    """Greedy by full recompute (no cache): the reference HF's cached generate must equal."""
    ids = list(ids)
    out = []
    for _ in range(n):
        nxt = int(step_logits_fn(ids)[-1].argmax())
        out.append(nxt)
        ids.append(nxt)
    return out


def text_cfg_tiny(tokens):
    from transformers import Llama4TextConfig
    return Llama4TextConfig(
        vocab_size=TOK_TOTAL, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        no_rope_layers=[1, 1, 0, 1], attention_chunk_size=32, attn_temperature_tuning=True,
        floor_scale=16, attn_scale=0.4, use_qk_norm=True, rms_norm_eps=1e-5, max_position_embeddings=1024,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        bos_token_id=tokens["<|begin_of_text|>"],
        eos_token_id=[tokens["<|end_of_text|>"], tokens["<|eom|>"], tokens["<|eot|>"]],
        pad_token_id=tokens["<|finetune_right_pad|>"], tie_word_embeddings=False)


def vision_cfg_tiny():
    from transformers import Llama4VisionConfig
    return Llama4VisionConfig(
        hidden_size=48, num_hidden_layers=2, num_attention_heads=2, intermediate_size=192, image_size=56,
        patch_size=7, projector_input_dim=64, projector_output_dim=64, vision_output_dim=64,
        pixel_shuffle_ratio=0.5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


TINY_PROC = {"size": {"height": 56, "width": 56}, "max_patches": 6}


def make_processor(model_dir):
    from transformers import AutoTokenizer, Llama4ImageProcessor, Llama4Processor
    tok = AutoTokenizer.from_pretrained(model_dir)
    ip = Llama4ImageProcessor(**TINY_PROC)
    return Llama4Processor(image_processor=ip, tokenizer=tok, patch_size=7, pixel_shuffle_ratio=0.5), tok, ip


def check_close(name, a, b, tol):
    d = (a - b).abs().max().item()
    print("  cross-check %-28s max |diff| %.2e" % (name, d))
    assert d < tol, (name, d)


def case_llama4_tiny():
    from transformers import Llama4Config, Llama4ForConditionalGeneration
    from PIL import Image
    d = os.path.join(MODEL_OUT, "llama4_tiny")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    tokens = build_tokenizer(d)
    tc, vc = text_cfg_tiny(tokens), vision_cfg_tiny()
    cfg = Llama4Config(text_config=tc, vision_config=vc, image_token_index=tokens["<|patch|>"],
                       boi_token_index=tokens["<|image_start|>"], eoi_token_index=tokens["<|image_end|>"])
    torch.manual_seed(31)
    model = Llama4ForConditionalGeneration(cfg)
    init_random(model, 0.15, seed=303)
    round_to(model, torch.bfloat16)   # the checkpoint is bf16: goldens see the same weights
    model.eval()
    model.save_pretrained(d)          # HF's own key layout (language_model.model., vision_model.)
    sd_path = os.path.join(d, "model.safetensors")
    from safetensors.torch import load_file, save_file
    sd = load_file(sd_path)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, sd_path, metadata={"format": "pt"})
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tc.bos_token_id, "eos_token_id": tc.eos_token_id,
                   "pad_token_id": tc.pad_token_id, "do_sample": False}, f, indent=1)
        f.write("\n")
    proc, tok, ip = make_processor(d)
    ip.save_pretrained(d)
    with open(os.path.join(d, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Llama4Processor", "patch_size": 7, "pixel_shuffle_ratio": 0.5}, f, indent=1)
        f.write("\n")

    messages = [{"role": "user", "content": [
        {"type": "image"},
        {"type": "text", "text": "What is in the image? Describe the picture in one sentence, please."}]}]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    img_w, img_h = 300, 200
    img = Image.fromarray(synth_image(img_w, img_h, seed=5))
    # The rendered template already starts with BOS: tokenize without adding another (what
    # apply_chat_template(tokenize=True) and vLLM do).
    enc = proc(text=text, images=[img], return_tensors="pt", add_special_tokens=False)
    input_ids, px = enc["input_ids"], enc["pixel_values"].to(torch.float32)
    aspect = ip(images=[img], return_tensors="pt")["aspect_ratios"][0].tolist()
    n_prompt = input_ids.shape[1]
    sdf = {k: v.to(torch.float32) for k, v in model.state_dict().items()}
    with torch.no_grad():
        adapter = model.get_image_features(pixel_values=px, return_dict=True).last_hidden_state
        feats = model.multi_modal_projector(adapter.reshape(-1, adapter.shape[-1]))
        check_close("vision adapter vs reference", ref_vision(sdf, vc, px), adapter, 2e-5)

        def embeds_for(ids):
            e = model.get_input_embeddings()(torch.tensor([ids]))[0].clone()
            m = torch.tensor(ids) == cfg.image_token_index
            assert int(m.sum()) == feats.shape[0]
            e[m] = feats
            return e

        def full_logits(ids):
            return model(input_ids=torch.tensor([ids]), pixel_values=px).logits[0]

        prompt = input_ids[0].tolist()
        greedy = greedy_full(full_logits, prompt, N_GREEDY)
        gen = model.generate(input_ids=input_ids, pixel_values=px, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=N_GREEDY, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert gen[0, n_prompt:].tolist() == greedy, (gen[0, n_prompt:].tolist(), greedy)
        all_ids = prompt + greedy
        logits = full_logits(all_ids)
        ref = ref_text_logits(sdf, "language_model.model.", "language_model.lm_head.weight", tc, embeds_for(all_ids))
        check_close("text logits vs reference", ref, logits, 2e-5)
    write_f32(os.path.join(d, "pixel_values.bin"), px)
    write_f32(os.path.join(d, "vision_features.bin"), feats)
    write_f32(os.path.join(d, "logits.bin"), logits)
    meta = {
        "input_ids": prompt, "greedy": greedy, "vocab": tc.vocab_size, "hidden": tc.hidden_size,
        "n_prompt": n_prompt, "n_tiles": int(px.shape[0]), "tile_size": int(px.shape[-1]),
        "tokens_per_tile": int(adapter.shape[1]), "aspect_ratio": aspect, "image_w": img_w, "image_h": img_h,
        "image_seed": 5, "image_token_id": cfg.image_token_index, "attention_chunk_size": tc.attention_chunk_size,
        "min_top2_margin": min_margin(logits), "tolerance": 1e-4, "rendered_prompt": text,
        "model_dir": "tests/data/model/llama4_tiny",
    }
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print("llama4_tiny: prompt %d tokens (%d tiles %s), greedy %s..., min top-2 margin %.4f"
          % (n_prompt, px.shape[0], aspect, greedy[:8], meta["min_top2_margin"]))
    return tokens


def case_llama4_text():
    from transformers import Llama4ForCausalLM, Llama4TextConfig
    d = os.path.join(MODEL_OUT, "llama4_text")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    tc = Llama4TextConfig(
        vocab_size=384, hidden_size=48, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=12, num_local_experts=5, num_experts_per_tok=2,
        interleave_moe_layer_step=1, no_rope_layer_interval=4, attention_chunk_size=16,
        attn_temperature_tuning=True, floor_scale=8, attn_scale=0.2, use_qk_norm=False, rms_norm_eps=1e-6,
        max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(41)
    model = Llama4ForCausalLM(tc)
    init_random(model, 0.2, seed=404)
    model.eval()
    model.save_pretrained(d)
    g = torch.Generator().manual_seed(42)
    prompt = torch.randint(3, 384, (60,), generator=g).tolist()
    sdf = {k: v.to(torch.float32) for k, v in model.state_dict().items()}
    with torch.no_grad():
        def full_logits(ids):
            return model(input_ids=torch.tensor([ids])).logits[0]
        greedy = greedy_full(full_logits, prompt, N_GREEDY)
        ids_t = torch.tensor([prompt])
        gen = model.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=N_GREEDY,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        assert gen[0, len(prompt):].tolist() == greedy
        all_ids = prompt + greedy
        logits = full_logits(all_ids)
        emb = sdf["model.embed_tokens.weight"][torch.tensor(all_ids)]
        check_close("text-only logits vs reference", ref_text_logits(sdf, "model.", "lm_head.weight", tc, emb), logits, 2e-5)
    write_f32(os.path.join(d, "logits.bin"), logits)
    meta = {"input_ids": prompt, "greedy": greedy, "vocab": 384, "hidden": 48, "n_prompt": len(prompt), "n_tiles": 0,
            "attention_chunk_size": 16, "min_top2_margin": min_margin(logits), "tolerance": 1e-4,
            "model_dir": "tests/data/model/llama4_text"}
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")
    print("llama4_text: prompt %d tokens, greedy %s..., min top-2 margin %.4f" % (len(prompt), greedy[:8], meta["min_top2_margin"]))


# ----------------------------------------------------------------------------- image processor

def hf_geometry(w, h, tile, max_patches):
    """The canvas / resize geometry exactly as Llama4ImageProcessor._preprocess computes it (same
    functions, same mixing of tensor and Python scalars: the float32-vs-float64 arithmetic that
    decides floor() at exact products is part of the behaviour)."""
    from transformers.image_utils import SizeDict
    from transformers.models.llama4 import image_processing_llama4 as m
    size = SizeDict(height=tile, width=tile)
    res = torch.tensor(m.find_supported_resolutions(max_num_chunks=max_patches, patch_size=size))
    image_size = torch.Size([h, w])
    target = m.get_best_fit(image_size, res, resize_to_max_canvas=False)
    nth = min(max(image_size[0], tile), target[0])
    ntw = min(max(image_size[1], tile), target[1])
    nh, nw = m.get_max_res_without_distortion(image_size, (nth, ntw))
    nh, nw = max(int(nh), 1), max(int(nw), 1)
    return int(target[0]) // tile, int(target[1]) // tile, nh, nw


def prompt_tokens(rows, cols, per_tile):
    n = 3 + per_tile                              # image_start, image, global tile patches, image_end
    if rows * cols > 1:
        n += rows * cols * per_tile + rows * (cols - 1) + rows
    return n


def build_image_goldens():
    from PIL import Image
    from transformers import Llama4ImageProcessor
    if os.path.isdir(IMAGE_OUT):
        shutil.rmtree(IMAGE_OUT)
    os.makedirs(IMAGE_OUT)
    out = {"generator": "tools/gen_llama4_goldens.py", "transformers": transformers.__version__,
           "torchvision": __import__("torchvision").__version__,
           "note": "synth_image(w, h, seed) in the generator; pixel files are bf16 [n_tiles][3][tile][tile]",
           "small": {"tile": 28, "max_patches": 8, "cases": []}, "real": {"tile": 336, "max_patches": 16,
                                                                         "tokens_per_tile": 144, "cases": [],
                                                                         "geometry": []}}
    ip = Llama4ImageProcessor(size={"height": 28, "width": 28}, max_patches=8)
    sizes = [(1, 1), (28, 28), (27, 29), (100, 80), (200, 50), (50, 200), (640, 480), (97, 61), (333, 217),
             (1000, 40), (40, 1000), (56, 84), (123, 45), (300, 300), (2, 300), (57, 28), (85, 29)]
    for i, (w, h) in enumerate(sizes):
        seed = 10 + i
        enc = ip(images=[Image.fromarray(synth_image(w, h, seed))], return_tensors="pt")
        pv = enc["pixel_values"]
        assert pv.dtype == torch.bfloat16
        rows, cols = enc["aspect_ratios"][0].tolist()
        g = hf_geometry(w, h, 28, 8)
        assert (g[0], g[1]) == (rows, cols)
        fname = "small_%dx%d.bf16" % (w, h)
        write_bf16(os.path.join(IMAGE_OUT, fname), pv)
        out["small"]["cases"].append({"w": w, "h": h, "seed": seed, "rows": rows, "cols": cols,
                                      "resized_h": g[2], "resized_w": g[3], "n_tiles": int(pv.shape[0]), "file": fname})
    ipr = Llama4ImageProcessor()   # the real config: 336 px tiles, max_patches 16
    for i, (w, h) in enumerate([(640, 480), (1500, 1001), (200, 3000), (336, 336), (4096, 4096)]):
        seed = 40 + i
        enc = ipr(images=[Image.fromarray(synth_image(w, h, seed))], return_tensors="pt")
        pv = enc["pixel_values"]
        rows, cols = enc["aspect_ratios"][0].tolist()
        flat = pv.to(torch.float32).flatten()
        stride = 997
        out["real"]["cases"].append({"w": w, "h": h, "seed": seed, "rows": rows, "cols": cols,
                                     "n_tiles": int(pv.shape[0]), "fnv1a64_bf16": fnv1a64_bf16(pv),
                                     "sample_stride": stride, "samples": flat[::stride].tolist()})
    dims = [1, 2, 100, 335, 336, 337, 500, 671, 672, 673, 1000, 1024, 1344, 1345, 2048, 3000, 4096, 8000, 20000]
    from transformers.models.llama4.processing_llama4 import Llama4Processor
    for w in dims:
        for h in dims:
            rows, cols, nh, nw = hf_geometry(w, h, 336, 16)
            n = prompt_tokens(rows, cols, 144)
            s = Llama4Processor._prompt_split_image(None, (rows, cols), 144)
            assert s.count("<|") == n, (w, h)
            out["real"]["geometry"].append({"w": w, "h": h, "rows": rows, "cols": cols, "resized_h": nh,
                                            "resized_w": nw, "n_tiles": rows * cols + (rows * cols > 1),
                                            "prompt_tokens": n})
    with open(os.path.join(IMAGE_OUT, "goldens.json"), "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    print("image goldens: %d small cases, %d real cases, %d geometry rows" %
          (len(out["small"]["cases"]), len(out["real"]["cases"]), len(out["real"]["geometry"])))


# ----------------------------------------------------------------------------- chat template

def build_template_goldens():
    """Conversations through Llama-4's chat template, rendered as apply_chat_template does
    (tools/gen_template_goldens.py's renderer, strftime_now pinned), tokenized by the tiny
    checkpoint's tokenizer, and for image prompts the processor's input_ids (images expanded)."""
    sys.path.insert(0, HERE)
    from gen_template_goldens import FIXED_TIME, hf_render_chat
    from PIL import Image
    d = os.path.join(MODEL_OUT, "llama4_tiny")
    proc, tok, ip = make_processor(d)
    src = tok.chat_template
    bos, eos = tok.bos_token, tok.eos_token
    img = lambda: {"type": "image"}
    txt = lambda s: {"type": "text", "text": s}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    convs = [
        ("text", [{"role": "user", "content": "Hello! How are you today?"}], None, True, []),
        ("system-multiturn", [{"role": "system", "content": "  You are terse.  "},
                              {"role": "user", "content": "Name a colour."},
                              {"role": "assistant", "content": "Blue."},
                              {"role": "user", "content": "Another one, with émoji 🎨?"}], None, True, []),
        ("system-parts", [{"role": "system", "content": [txt("Be kind.")]},
                          {"role": "user", "content": [txt("hi")]}], None, False, []),
        ("one-image", [{"role": "user", "content": [img(), txt("What is in the image?")]}], None, True, [(300, 200)]),
        ("two-images", [{"role": "user", "content": [txt("Compare "), img(), txt(" and "), img(), txt(".")]}],
         None, True, [(40, 30), (100, 300)]),
        ("image-multiturn", [{"role": "user", "content": [img(), txt("Describe it.")]},
                             {"role": "assistant", "content": [txt("A pattern.")]},
                             {"role": "user", "content": [txt("And this one?"), img()]}], None, True,
         [(56, 56), (1000, 100)]),
        ("tools", [{"role": "user", "content": "Weather in Paris?"}], tools, True, []),
        ("tool-call", [{"role": "user", "content": "Weather in Paris?"},
                       {"role": "assistant", "content": "", "tool_calls": [
                           {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                       {"role": "tool", "content": {"temp": 21}},
                       {"role": "ipython", "content": "sunny"}], None, True, []),
    ]
    cases = []
    for name, msgs, tl, agp, images in convs:
        expected = hf_render_chat(src, msgs, tl, agp, bos, eos, {})
        ids = tok(expected, add_special_tokens=False)["input_ids"]
        case = {"name": "llama4/" + name, "messages": msgs, "tools": tl, "add_generation_prompt": agp,
                "extra": {}, "expected": expected, "token_ids": ids,
                "images": [{"w": w, "h": h, "seed": 60 + k} for k, (w, h) in enumerate(images)]}
        if images:
            pil = [Image.fromarray(synth_image(w, h, 60 + k)) for k, (w, h) in enumerate(images)]
            enc = proc(text=expected, images=pil, return_tensors="pt", add_special_tokens=False)
            case["input_ids"] = enc["input_ids"][0].tolist()
            case["image_grids"] = ip(images=pil, return_tensors="pt")["aspect_ratios"].tolist()
        cases.append(case)
    special = {n: tok.convert_tokens_to_ids(n) for n in SPECIALS}
    out = {"generator": "tools/gen_llama4_goldens.py", "transformers": transformers.__version__,
           "fixed_time": FIXED_TIME, "tokenizer": "tests/data/model/llama4_tiny/tokenizer.json",
           "processor": dict(TINY_PROC, patch_size=7, pixel_shuffle_ratio=0.5, tokens_per_tile=16),
           "special_tokens": special,
           "templates": [{"name": "llama4", "origin": "transformers.models.llama4.processing_llama4.chat_template",
                          "source": src, "bos_token": bos, "eos_token": eos, "cases": cases}]}
    with open(os.path.join(TEMPLATE_OUT, "llama4_goldens.json"), "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("template goldens: %d conversations" % len(cases))


def main():
    torch.set_grad_enabled(False)
    case_llama4_tiny()
    case_llama4_text()
    build_template_goldens()
    build_image_goldens()
    for d in (os.path.join(MODEL_OUT, "llama4_tiny"), os.path.join(MODEL_OUT, "llama4_text"), IMAGE_OUT):
        chmod_tree(d)
    os.chmod(os.path.join(TEMPLATE_OUT, "llama4_goldens.json"), 0o644)


if __name__ == "__main__":
    main()
