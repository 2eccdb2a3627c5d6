#!/usr/bin/env python3
"""Trains models/prism-tiny-llava: a small LLaVA (CLIP vision tower + gelu projector + Llama text with
grouped-query attention) that names the one coloured shape in a synthetic picture.

    nice -n 10 python3 tools/train_tiny_llava.py [--out models/prism-tiny-llava]

About 12 minutes (20 CPU-minutes) on 2 shared cores. Two phases: (1) the vision tower and projector
alone, on a pool of pictures, against training-only auxiliary heads (per-patch shape occupancy and
per-picture shape/colour/background) -- a from-scratch ViT learns shapes through the language model
far too slowly for a CPU budget, this dense signal gets it there in a few minutes; (2) the whole
model on new examples, answer loss plus the auxiliary losses at half weight.

Task: one circle, square or triangle in red, green, blue, yellow, purple or orange on a white, black
or gray background, near the centre at a random size, drawn exactly like tools/prism_imgtool.c
(tiny_llava_common.render_shape), at random resolutions (64 px to 4096 px, aspect 1:2 to 2:1), stored
as JPEG (several qualities, baseline or progressive; sometimes DCT-scaled on decode as Prism's
encoder does for large JPEGs) or PNG and decoded back with PIL, then preprocessed by transformers'
CLIPImageProcessor loaded from the checkpoint's own preprocessor_config.json. The PIL backend
(CLIPImageProcessorPil) is pinned so the run does not depend on whether torchvision happens to be
installed; Prism's encoder reproduces either backend (common/image/clip.h) and the two differ by
uint8 rounding only. Questions are a few paraphrases of "What is in the image?"; the answer is always
"A <colour> <shape> on a <background> background." then EOS. Some text-only chats are mixed in so
a request without an image gets a short answer too. The loss covers the answer tokens only.

Everything is seeded and runs on 2 CPU threads (torch.set_num_threads(2)); the same torch build
gives the same weights. The tokenizer is the one tools/make_tiny_llava.py has always built (same
corpus, same trainer), so tokenizer goldens are unaffected.

After training the checkpoint is saved (bf16 safetensors, HF layout), reloaded the way inference
loads it, and evaluated on a held-out set (different seed) with greedy decoding under teacher
forcing (an answer counts only if every answer token, EOS included, is the argmax, i.e. exactly what
greedy generation would produce). README.md records the run; a section headed
"## Accuracy through the Prism cluster" is kept from the existing README (it is filled in from
tests/integration/test_accuracy.py, which this script cannot run).
"""
import argparse
import io
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_llava_common as tl  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
CLUSTER_SECTION = "## Accuracy through the Prism cluster"


# ---------------------------------------------------------------- data

def sample_spec(rng, max_side=4096):
    """One random picture. Sizes are log-uniform so small and medium images dominate (they cost
    little to render), with the full 64..4096 range covered."""
    short = math.exp(rng.uniform(math.log(64), math.log(1024)))
    if rng.random() < 0.015:
        short = math.exp(rng.uniform(math.log(1024), math.log(max_side)))
    aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
    if aspect >= 1:
        w, h = short * aspect, short
    else:
        w, h = short, short / aspect
    w, h = max(64, min(max_side, int(round(w)))), max(64, min(max_side, int(round(h))))
    fmt = rng.choice(["jpeg", "jpeg", "jpeg_progressive", "png", "png"])
    return {
        "shape": rng.choice(tl.SHAPE_NAMES),
        "color": rng.choice(sorted(tl.SHAPE_COLORS)),
        "background": rng.choice(sorted(tl.BACKGROUNDS)),
        "width": w, "height": h,
        "scale": round(rng.uniform(0.15, 0.4), 4),
        "offset_x": round(rng.uniform(-0.08, 0.08), 4),
        "offset_y": round(rng.uniform(-0.08, 0.08), 4),
        "format": fmt,
        "quality": rng.choice([40, 60, 75, 85, 95]),
        "dct_scale": rng.random() < 0.5,
    }


def resize_target(w, h, short=112):
    # transformers' get_resize_output_image_size(default_to_square=False)
    if w <= h:
        return short, int(short * h / w)
    return int(short * w / h), short


def load_image(spec):
    """Renders, encodes and decodes the picture the way a client file would reach the model."""
    rgb = tl.render_shape(spec["width"], spec["height"], spec["shape"], spec["color"], spec["background"],
                          spec["scale"], spec["offset_x"], spec["offset_y"])
    img = Image.fromarray(rgb, "RGB")
    if spec["format"] == "png":
        return img  # lossless: decoding gives the same pixels back
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=spec["quality"], subsampling=2,
             progressive=spec["format"] == "jpeg_progressive")
    buf.seek(0)
    out = Image.open(buf)
    if spec["dct_scale"]:
        # Prism's encoder decodes large JPEGs at a reduced DCT scale that still covers the resize target.
        tw, th = resize_target(spec["width"], spec["height"])
        if spec["width"] >= 2 * tw and spec["height"] >= 2 * th:
            out.draft("RGB", (tw, th))
    return out.convert("RGB")


class Encoder:
    """Prompt and answer token ids, exactly as the chat template and tokenizer produce them."""

    def __init__(self, tok_dir, image_seq):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(tok_dir)
        self.image_seq = image_seq
        self.image_id = self.tok.convert_tokens_to_ids("<image>")
        self.eos = self.tok.convert_tokens_to_ids("</s>")
        self.cache = {}

    def prompt(self, question, image):
        key = (question, image)
        if key not in self.cache:
            content = [{"type": "image"}, {"type": "text", "text": question}] if image else question
            text = self.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                tokenize=False)
            ids = []
            for t in self.tok(text)["input_ids"]:
                ids += [t] * self.image_seq if t == self.image_id else [t]
            self.cache[key] = ids
        return self.cache[key]

    def answer(self, text):
        # Generation continues right after "ASSISTANT:", so the answer starts with a space.
        return self.tok(" " + text, add_special_tokens=False)["input_ids"] + [self.eos]


def make_example(rng, enc, processor, text_only_p=0.08):
    if rng.random() < text_only_p:
        if rng.random() < 0.75:
            q, a = rng.choice(tl.TEXT_CHATS)
        else:
            n = rng.randint(2, 8)
            q = " ".join(rng.choice(tl.WORDS) for _ in range(n)).capitalize() + rng.choice(["?", ".", "!"])
            a = tl.TEXT_FALLBACK
        return enc.prompt(q, False), enc.answer(a), None, None
    spec = sample_spec(rng)
    q = rng.choice(tl.IMAGE_QUESTIONS)
    px = processor(images=load_image(spec), return_tensors="pt")["pixel_values"][0]
    a = tl.answer_text(spec["color"], spec["shape"], spec["background"])
    return enc.prompt(q, True), enc.answer(a), px, spec


def collate(examples, pad_id):
    n = max(len(p) + len(a) for p, a, _, _ in examples)
    ids = torch.full((len(examples), n), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), n), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), n), dtype=torch.long)
    pixels = []
    for i, (p, a, px, _) in enumerate(examples):
        seq = p + a
        ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
        labels[i, len(p):len(seq)] = torch.tensor(a)
        if px is not None:
            pixels.append(px)
    return ids, mask, labels, (torch.stack(pixels) if pixels else None)


def answer_logits(model, ids, labels, pixels):
    """Logits at the positions that predict answer tokens only ([n_answer_tokens][vocab]) and their
    targets: the lm_head over the whole prompt would cost more than the rest of the step. Sequences
    are right-padded, so causal attention alone keeps real tokens from seeing the padding and no
    attention mask is needed (with one, SDPA leaves its fast causal path)."""
    kw = {"input_ids": ids}
    if pixels is not None:
        kw["pixel_values"] = pixels
    hidden = model.model(**kw).last_hidden_state
    tgt = labels[:, 1:]
    sel = tgt != -100
    return model.lm_head(hidden[:, :-1][sel]), tgt[sel]


OCC_GRID = 4  # occupancy targets per patch: OCC_GRID x OCC_GRID points


def occupancy_target(spec, crop=112, patch=14, n=OCC_GRID):
    """float [64][n*n]: for each patch of the preprocessed 112x112 picture, which of n x n points in
    it lie inside the shape, mapped back through the processor's resize and center crop to the
    original picture and tested with render_shape's geometry."""
    w, h = spec["width"], spec["height"]
    rw, rh = resize_target(w, h)
    ox, oy = (rw - crop) // 2, (rh - crop) // 2
    g = crop // patch * n
    u = (np.arange(g) + 0.5) * (crop / g)
    m = tl.shape_mask((u + ox) * (w / rw), (u + oy) * (h / rh), w, h, spec["shape"], spec["scale"],
                      spec["offset_x"], spec["offset_y"])
    k = crop // patch
    return torch.from_numpy(m.reshape(k, n, k, n).transpose(0, 2, 1, 3).reshape(k * k, n * n).astype(np.float32))


def aux_targets(specs):
    """(occupancy [B][64][n*n], shape ids [B], colour ids [B], background ids [B])."""
    return (torch.stack([occupancy_target(sp) for sp in specs]),
            torch.tensor([tl.SHAPE_NAMES.index(sp["shape"]) for sp in specs]),
            torch.tensor([sorted(tl.SHAPE_COLORS).index(sp["color"]) for sp in specs]),
            torch.tensor([sorted(tl.BACKGROUNDS).index(sp["background"]) for sp in specs]))


def hflip(pixels, occ):
    """Mirror pictures left-right (every shape here is symmetric about its vertical axis, so the
    labels hold) and their occupancy targets with them."""
    k = int(round(math.sqrt(occ.shape[1])))
    occ = occ.view(occ.shape[0], k, k, OCC_GRID, OCC_GRID).flip(2).flip(4).reshape(occ.shape)
    return pixels.flip(-1), occ


class AuxHeads(torch.nn.Module):
    """Training-only heads (not saved) that give the vision tower a direct, dense signal, so it learns
    to see shapes within the CPU budget: per patch, the shape's occupancy of n x n points (from the
    second layer's output), and per picture, shape/colour/background from the mean projected feature.
    Through the language model alone the tower learns colours fast and shapes very slowly."""

    def __init__(self, v_hidden, t_hidden):
        super().__init__()
        self.occ = torch.nn.Linear(v_hidden, OCC_GRID * OCC_GRID)
        self.cls = torch.nn.Linear(t_hidden, len(tl.SHAPE_NAMES) + len(tl.SHAPE_COLORS) + len(tl.BACKGROUNDS))

    def loss(self, early, proj, targets):
        occ, ys, yc, yb = targets
        l_occ = torch.nn.functional.binary_cross_entropy_with_logits(self.occ(early), occ)
        logits = self.cls(proj.mean(1))
        ns, nc = len(tl.SHAPE_NAMES), len(tl.SHAPE_COLORS)
        ce = torch.nn.functional.cross_entropy
        l_cls = ce(logits[:, :ns], ys) + ce(logits[:, ns:ns + nc], yc) + ce(logits[:, ns + nc:], yb)
        shape_acc = (logits[:, :ns].argmax(-1) == ys).float().mean().item()
        return l_occ + l_cls, shape_acc


def vision_forward(model, pixels, early_layer=2):
    """(hidden states after `early_layer` vision layers [B][64][v_hidden], projected image features
    [B][64][t_hidden]) -- the same features LlavaModel puts in place of the <image> tokens."""
    cfg = model.config
    out = model.model.vision_tower(pixels, output_hidden_states=True, return_dict=True)
    sel = out.hidden_states[cfg.vision_feature_layer]
    if cfg.vision_feature_select_strategy == "default":
        sel = sel[:, 1:]
    return out.hidden_states[early_layer][:, 1:], model.model.multi_modal_projector(sel)


def lm_answer_logits(model, ids, labels, proj):
    """answer_logits with precomputed image features (LlavaModel's own merge: masked_scatter)."""
    emb = model.model.get_input_embeddings()(ids)
    if proj is not None:
        mask = (ids == model.config.image_token_id).unsqueeze(-1).expand_as(emb)
        emb = emb.masked_scatter(mask, proj.reshape(-1, proj.shape[-1]).to(emb.dtype))
    hidden = model.model.language_model(inputs_embeds=emb).last_hidden_state
    tgt = labels[:, 1:]
    sel = tgt != -100
    return model.lm_head(hidden[:, :-1][sel]), tgt[sel]


# ---------------------------------------------------------------- evaluation

def evaluate(model, enc, processor, n, seed, batch=24):
    """Held-out accuracy with greedy decoding under teacher forcing (exact answer, EOS included)."""
    rng = random.Random(seed)
    combos = [(s, c, b) for s in tl.SHAPE_NAMES for c in sorted(tl.SHAPE_COLORS) for b in sorted(tl.BACKGROUNDS)]
    examples = []
    for i in range(n):
        spec = sample_spec(rng)
        spec["shape"], spec["color"], spec["background"] = combos[i % len(combos)]
        q = tl.IMAGE_QUESTIONS[i % len(tl.IMAGE_QUESTIONS)]
        px = processor(images=load_image(spec), return_tensors="pt")["pixel_values"][0]
        a = tl.answer_text(spec["color"], spec["shape"], spec["background"])
        examples.append((enc.prompt(q, True), enc.answer(a), px, spec))
    exact = slot = 0
    wrong = []
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch):
            chunk = examples[i:i + batch]
            ids, _, labels, pixels = collate(chunk, enc.tok.pad_token_id)
            logits, tgt = answer_logits(model, ids, labels, pixels)
            pred = logits.argmax(-1)
            off = 0
            for p, a, _, spec in chunk:
                k = len(a)
                ok = bool((pred[off:off + k] == tgt[off:off + k]).all())
                text = enc.tok.decode(pred[off:off + k].tolist(), skip_special_tokens=True)
                off += k
                exact += ok
                named = spec["color"] in text and spec["shape"] in text
                slot += named
                if not ok:
                    wrong.append((spec, text))
    return exact / n, slot / n, wrong


def generate(model, enc, question, image=None, processor=None, max_new=24):
    ids = torch.tensor([enc.prompt(question, image is not None)])
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": max_new, "do_sample": False}
    if image is not None:
        kw["pixel_values"] = processor(images=image, return_tensors="pt")["pixel_values"]
    out = model.generate(**kw)
    return enc.tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


# ---------------------------------------------------------------- main

def write_readme(out, old_readme, stats):
    keep = ""
    if old_readme and CLUSTER_SECTION in old_readme:
        keep = old_readme[old_readme.index(CLUSTER_SECTION):]
    s = stats
    text = f"""# prism-tiny-llava

A small LLaVA-1.5-shaped vision-language model trained from scratch by `tools/train_tiny_llava.py`
(seeded, CPU only). It really looks at the image: asked what is in a picture of one coloured shape,
it answers e.g. "A red circle on a white background." It is shipped with Prism so the whole cluster
runs and is tested end to end, with checkable answers, without downloading a model.

## What it was trained on

Synthetic pictures drawn exactly like `tools/prism_imgtool.c`: one circle, square or triangle in red,
green, blue, yellow, purple or orange on a white, black or gray background, near the centre (offset up
to 8% of the width/height) with radius 15-40% of the shorter side; random resolutions from 64 px to
4096 px, aspect ratios from 1:2 to 2:1; stored as JPEG (quality 40-95, baseline or progressive, some
decoded at a reduced DCT scale as Prism's encoder does) or PNG and decoded back with PIL, then
preprocessed by transformers' CLIPImageProcessor (PIL backend, bicubic, shortest edge 112, center crop
112). Questions: {len(tl.IMAGE_QUESTIONS)} paraphrases ("What is in the image?", "Describe the image.",
"What do you see?", ...); answer: "A <colour> <shape> on a <background> background." then `</s>`.
About 8% of the examples are text-only chats ("Hello" -> "Hello! Send me an image and I will describe
it.", anything else -> "{tl.TEXT_FALLBACK}"). Loss on the answer tokens only.

## How

    nice -n 10 python3 tools/train_tiny_llava.py

Two phases, AdamW (weight decay 0.01), fp32 on 2 CPU threads, seed {s['seed']}:

1. vision tower + projector alone, {s['vision_steps']} steps of {s['vision_batch']} pictures drawn from a
   pool of {s['vision_pool']} (randomly mirrored), lr {s['vision_lr']} (warm-up, cosine to 30%), against two
   training-only heads that are not saved: per patch, which of 4x4 points lie inside the shape (from
   the second vision layer), and per picture, shape/colour/background (from the mean projected
   feature). Learned through the language model alone, the from-scratch ViT picks up colours at once
   but shapes only after far more pictures than a CPU budget allows; this dense signal gets it there.
2. everything, {s['steps']} steps of {s['batch']} new examples, lr {s['lr']} (vision tower x{s['vision_lr_scale']}), warm-up
   {s['warmup']} steps then cosine to 10%; answer loss plus {s['aux_weight']} x the phase-1 losses.

Weights stored as bf16. Took {s['train_minutes']:.1f} minutes of training ({s['total_minutes']:.1f} minutes in
all, {s['cpu_minutes']:.1f} CPU-minutes) on 2 cores shared with other jobs (AMD EPYC, AVX2), torch
{s['torch']}, transformers {s['transformers']}. Final training loss (mean over the last
{s['loss_window']} steps, per answer token): {s['final_loss']:.4f}.

Held-out set ({s['eval_n']} new pictures, another seed, every colour/shape/background combination),
evaluated with the saved bf16 weights in transformers (greedy, exact answer including `</s>`):
exact answers {100 * s['eval_exact']:.1f}%, colour and shape named correctly {100 * s['eval_slot']:.1f}%.

## Shape

- tokenizer: byte-level BPE (HF tokenizers), vocab {s['vocab']}, specials {s['specials']} (the same
  tokenizer tools/make_tiny_llava.py builds)
- vision: CLIP 112px, patch 14 (64 patches), hidden 128, 4 layers, 4 heads, quick_gelu
- projector: gelu; feature layer -2, strategy default; 64 tokens per image
- text: Llama, hidden 256, 4 layers, 8 heads / 4 kv heads (GQA), head_dim 32, intermediate 688
- weights: bf16 safetensors ({s['size_mb']:.2f} MB folder)

"""
    if keep:
        text += keep
    else:
        text += (CLUSTER_SECTION + "\n\nMeasured by `tests/integration/test_accuracy.py` "
                 "(see that test for the held-out set).\n")
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text)
    os.chmod(os.path.join(out, "README.md"), 0o644)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "models", "prism-tiny-llava"))
    ap.add_argument("--vision-steps", type=int, default=2500, help="phase 1: vision tower + aux heads only")
    ap.add_argument("--vision-batch", type=int, default=32)
    ap.add_argument("--vision-pool", type=int, default=6000, help="pictures phase 1 draws from")
    ap.add_argument("--vision-lr", type=float, default=1e-3)
    ap.add_argument("--vision-lr-scale", type=float, default=0.3, help="vision tower lr factor in phase 2")
    ap.add_argument("--steps", type=int, default=800, help="phase 2: whole model")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=40)
    ap.add_argument("--aux-weight", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=20240611)
    ap.add_argument("--eval-n", type=int, default=216)
    ap.add_argument("--eval-seed", type=int, default=777)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--probe-every", type=int, default=200, help="held-out probe every N steps (0: never)")
    args = ap.parse_args()

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = os.path.abspath(args.out)
    stage = tempfile.mkdtemp(prefix="prism-tiny-llava-")

    tok = tl.build_tokenizer(tl.build_corpus())
    ids = tl.special_ids(tok)
    vocab = tok.get_vocab_size()
    tl.write_side_files(stage, tok)

    from transformers import CLIPImageProcessorPil
    import transformers
    processor = CLIPImageProcessorPil.from_pretrained(stage)
    print("image processor:", type(processor).__name__, flush=True)
    cfg = tl.make_config(vocab, ids["<image>"], ids["<s>"], ids["</s>"], ids["<pad>"])
    enc = Encoder(stage, cfg.image_seq_length)
    model = tl.make_model(cfg, args.seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters, vocab {vocab}, specials {ids}", flush=True)

    heads = AuxHeads(cfg.vision_config.hidden_size, cfg.text_config.hidden_size)
    named = list(model.named_parameters()) + [("aux." + n, p) for n, p in heads.named_parameters()]
    groups = []
    for vision in (True, False):
        for decay in (True, False):
            ps = [p for n, p in named if ("vision_tower" in n) == vision and
                  (p.dim() >= 2 and "embed" not in n) == decay]
            groups.append({"params": ps, "weight_decay": 0.01 if decay else 0.0, "vision": vision})
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    all_params = [p for _, p in named]

    rng = random.Random(args.seed)
    flip_gen = torch.Generator().manual_seed(args.seed)
    t0 = time.time()
    # Phase 1 draws from a pool of pictures (rendering them is most of a step's cost there).
    pool_specs = [sample_spec(rng) for _ in range(args.vision_pool if args.vision_steps else 0)]
    pool_px = torch.stack([processor(images=load_image(sp), return_tensors="pt")["pixel_values"][0]
                           for sp in pool_specs]) if pool_specs else None
    pool_tg = aux_targets(pool_specs) if pool_specs else None
    print(f"phase 1 pool: {len(pool_specs)} pictures in {(time.time() - t0) / 60:.1f} min", flush=True)

    def lr_at(step):
        # Phase 1 (vision tower only): warm-up then constant. Phase 2 (everything): a new warm-up
        # (the language model starts from scratch), then cosine decay to 10%.
        if step < args.vision_steps:
            t = step / max(1, args.vision_steps)
            return args.vision_lr * min(1.0, (step + 1) / args.warmup) * (0.3 + 0.7 * 0.5 * (1 + math.cos(math.pi * t)))
        step -= args.vision_steps
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    losses, shape_accs = [], []
    t_train = time.time()
    t_data = 0.0
    total = args.vision_steps + args.steps
    for step in range(total):
        phase1 = step < args.vision_steps
        t0 = time.time()
        if phase1:
            idx = torch.randint(0, len(pool_specs), (args.vision_batch,), generator=flip_gen)
            pixels = pool_px[idx]
            targets = tuple(t[idx] for t in pool_tg)
            flip = torch.rand(args.vision_batch, generator=flip_gen) < 0.5
            fpx, focc = hflip(pixels[flip], targets[0][flip])
            pixels = pixels.clone()
            pixels[flip] = fpx
            targets[0][flip] = focc
        else:
            batch = [make_example(rng, enc, processor) for _ in range(args.batch)]
            ids_t, _, labels, pixels = collate(batch, ids["<pad>"])
            targets = aux_targets([b[3] for b in batch if b[3] is not None])
        t_data += time.time() - t0
        for g in opt.param_groups:
            # In phase 2 the (already trained) vision tower moves slower than the rest.
            g["lr"] = lr_at(step) * (args.vision_lr_scale if g["vision"] and not phase1 else 1.0)
        loss = torch.zeros(())
        proj = None
        if pixels is not None:
            early, proj = vision_forward(model, pixels)
            aux, acc = heads.loss(early, proj, targets)
            loss = loss + (1.0 if phase1 else args.aux_weight) * aux
            shape_accs.append(acc)
        if not phase1:
            logits, tgt = lm_answer_logits(model, ids_t, labels, proj)
            lm = torch.nn.functional.cross_entropy(logits, tgt)
            loss = loss + lm
            losses.append(lm.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(all_params, 1.0)
        opt.step()
        if step % 25 == 0 or step == total - 1:
            el = time.time() - t_train
            lm_txt = f"answer loss {np.mean(losses[-25:]):.4f}" if losses else f"aux loss {loss.item():.3f}"
            print(f"step {step:5d} {'vision' if phase1 else 'full  '}  {lm_txt}  shape acc "
                  f"{np.mean(shape_accs[-25:]):.2f}  lr {lr_at(step):.2e}  {el / 60:.1f} min "
                  f"(data {t_data / 60:.1f}, cpu {time.process_time() / 60:.1f})", flush=True)
        if args.probe_every and not phase1 and step > args.vision_steps and \
                (step - args.vision_steps) % args.probe_every == 0:
            # Progress on a few held-out pictures (a separate seed: does not disturb training's RNG).
            exact, slot, _ = evaluate(model, enc, processor, 54, args.eval_seed + 1)
            model.train()
            print(f"  probe: exact {100 * exact:.0f}%  colour+shape {100 * slot:.0f}%", flush=True)
    train_minutes = (time.time() - t_train) / 60
    cpu_minutes = time.process_time() / 60
    loss_window = 50
    final_loss = float(np.mean(losses[-loss_window:]))

    size = tl.save_checkpoint(model, tok, stage)
    from transformers import LlavaForConditionalGeneration
    ref = LlavaForConditionalGeneration.from_pretrained(stage, dtype=torch.float32)
    exact, slot, wrong = evaluate(ref, enc, processor, args.eval_n, args.eval_seed)
    print(f"held-out ({args.eval_n}): exact {100 * exact:.1f}%  colour+shape {100 * slot:.1f}%", flush=True)
    for spec, text in wrong[:20]:
        print("  wrong:", {k: spec[k] for k in ("shape", "color", "background", "width", "height", "scale",
                                                   "format")}, "->", repr(text))
    for q in ("Hello", "What is the capital of France?"):
        print(f"text-only {q!r} -> {generate(ref, enc, q)!r}")

    old_readme = None
    if os.path.exists(os.path.join(out, "README.md")):
        with open(os.path.join(out, "README.md")) as f:
            old_readme = f.read()
    stats = {"steps": args.steps, "batch": args.batch, "lr": args.lr, "warmup": args.warmup, "seed": args.seed,
             "train_minutes": train_minutes, "cpu_minutes": cpu_minutes, "total_minutes": (time.time() - t_start) / 60,
             "final_loss": final_loss, "loss_window": loss_window, "eval_n": args.eval_n, "eval_exact": exact,
             "eval_slot": slot, "vocab": vocab, "specials": ids, "size_mb": size / 1e6,
             "transformers": transformers.__version__, "torch": torch.__version__,
             "vision_steps": args.vision_steps, "vision_batch": args.vision_batch, "vision_pool": args.vision_pool,
             "vision_lr": args.vision_lr, "vision_lr_scale": args.vision_lr_scale, "aux_weight": args.aux_weight}
    write_readme(stage, old_readme, stats)
    size = sum(os.path.getsize(os.path.join(stage, n)) for n in os.listdir(stage))
    assert size <= 20e6, "model folder exceeds 20 MB"
    if os.path.isdir(out):
        shutil.rmtree(out)
    shutil.copytree(stage, out)
    os.chmod(out, 0o755)  # the staging folder came from mkdtemp (0700)
    shutil.rmtree(stage)
    print(json.dumps({k: v for k, v in stats.items() if k != "specials"}), flush=True)
    with open(os.path.join(out, "README.md")) as f:
        assert "{s[" not in f.read()
    print(f"wrote {out} ({size / 1e6:.2f} MB) in {(time.time() - t_start) / 60:.1f} min", flush=True)


if __name__ == "__main__":
    main()
