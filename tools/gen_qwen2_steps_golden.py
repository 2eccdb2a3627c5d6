#!/usr/bin/env python3
"""Per-step greedy goldens for the scaled-down Qwen2 checkpoint in tests/data/model/qwen2_text
(made by tools/gen_model_goldens.py), read by tests/integration/test_fidelity_arch.py.

For each case: HF transformers (fp32, CPU) greedy generation without stopping at EOS, and at every
step the chosen token id, its float32 log-softmax of the raw logits, and the top 5 ids with their
logprobs (plus the 6th value, for ties at the cut):

  short  the golden's own 21-token prompt, 32 steps (must equal golden.json's "greedy")
  long   a seeded random 420-token prompt, 64 steps: positions up to 484, far beyond the 151 the
         LLaVA goldens reach, so RoPE, paged KV over many blocks and chunked prefill are checked
         against transformers at long positions

    python3 tools/gen_qwen2_steps_golden.py     # writes tests/data/model/qwen2_text/steps.json
"""
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
CASE = os.path.join(ROOT, "tests", "data", "model", "qwen2_text")
TOP = 5


def steps_of(model, ids, n):
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    toks = out.sequences[0, ids.shape[1]:].tolist()
    assert len(toks) == n == len(out.logits), (len(toks), n)
    steps, margin = [], 1e9
    for t, lg in zip(toks, out.logits):
        lp = torch.log_softmax(lg[0].to(torch.float32), dim=-1)
        vals, idx = torch.topk(lp, TOP + 1)
        assert int(idx[0]) == t, "greedy token is not the argmax"
        margin = min(margin, float(vals[0] - vals[1]))
        steps.append({"id": t, "logprob": round(float(lp[t]), 6),
                      "top": [[int(i), round(float(v), 6)] for v, i in zip(vals[:TOP], idx[:TOP])],
                      "next": round(float(vals[TOP]), 6)})
    return toks, steps, margin


def main():
    from transformers import Qwen2ForCausalLM
    import transformers
    torch.set_grad_enabled(False)
    with open(os.path.join(CASE, "golden.json")) as f:
        gold = json.load(f)
    model = Qwen2ForCausalLM.from_pretrained(CASE, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(23)
    cases = []
    for name, ids, n in (("short", torch.tensor([gold["input_ids"]]), len(gold["greedy"])),
                         ("long", torch.randint(8, 384, (1, 420), generator=g), 64)):
        toks, steps, margin = steps_of(model, ids, n)
        if name == "short":
            assert toks == gold["greedy"], "short case disagrees with golden.json's greedy tokens"
        cases.append({"name": name, "prompt_ids": ids[0].tolist(), "steps": steps, "min_top2_gap": round(margin, 6)})
        print("%-6s prompt %3d  steps %2d  last position %d  min top-2 gap %.4f" % (
            name, ids.shape[1], n, ids.shape[1] + n - 1, margin))
    meta = {"generator": "tools/gen_qwen2_steps_golden.py", "transformers": transformers.__version__,
            "torch": torch.__version__, "top_logprobs": TOP, "cases": cases}
    with open(os.path.join(CASE, "steps.json"), "w") as f:
        json.dump(meta, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
