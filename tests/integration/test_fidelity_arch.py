"""Through the cluster, for the scaled-down Qwen2 golden (q/k/v biases, untied, f16 weights, an EOS
list): greedy generation equals transformers' model.generate id for id, and at every step the
chosen token's logprob and the top-5 logprobs equal HF's float32 log-softmax within 1e-3
(goldens: tests/data/model/qwen2_text/steps.json from tools/gen_qwen2_steps_golden.py).

Tokens are compared as ids ("return_tokens_as_token_ids", as in vLLM), never as decoded text: two
ids can share a text (byte tokens that decode to U+FFFD) and text comparison would not see a swap.
Cases: the golden's 21-token prompt (32 steps) and a 420-token prompt (64 steps, positions up to
483), the latter also with --chunked-prefill-size 64, i.e. a prompt prefilled in 7 chunks.

The checkpoint has no tokenizer of its own, so the router borrows the bundled model's tokenizer
(vocabulary 4096 > 384) only to turn ids into text; the prompt goes in as token ids.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from cluster import ROOT, Cluster, MODEL, run_tests  # noqa: E402

CASE = os.path.join(ROOT, "tests", "data", "model", "qwen2_text")
GOLD = json.load(open(os.path.join(CASE, "golden.json")))
STEPS = json.load(open(os.path.join(CASE, "steps.json")))
CASES = {c["name"]: c for c in STEPS["cases"]}
TOL = 1e-3
TIE = 1e-4
C = None


def token_id(s):
    assert s.startswith("token_id:"), s
    return int(s[len("token_id:"):])


def request(case, stream):
    body = {"model": "qwen2_text", "prompt": case["prompt_ids"], "max_tokens": len(case["steps"]),
            "temperature": 0, "logprobs": STEPS["top_logprobs"], "ignore_eos": True,
            "return_tokens_as_token_ids": True, "skip_special_tokens": False}
    if not stream:
        status, r = C.post_json("/v1/completions", body)
        assert status == 200, (status, r)
        return r["choices"][0]["logprobs"], r["usage"], r["choices"][0]["text"]
    body.update(stream=True, stream_options={"include_usage": True})
    status, events, done = C.stream("/v1/completions", body)
    assert status == 200 and done, (status, events[-1:])
    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    usage, text = None, ""
    for e in events:
        usage = e.get("usage") or usage
        for ch in e.get("choices") or []:
            text += ch.get("text") or ""
            for k in lp:
                lp[k] += ((ch.get("logprobs") or {}).get(k) or [])
    return lp, usage, text


def check_case(case, stream):
    lp, usage, text = request(case, stream)
    where = "%s (%s)" % (case["name"], "stream" if stream else "non-stream")
    gold = case["steps"]
    assert usage["prompt_tokens"] == len(case["prompt_ids"]), (where, usage)
    assert usage["completion_tokens"] == len(gold), (where, usage)
    ids = [token_id(t) for t in lp["tokens"]]
    want = [s["id"] for s in gold]
    if ids != want:
        k = next(i for i, (a, b) in enumerate(zip(ids + [None], want + [None])) if a != b)
        raise AssertionError("%s: ids diverge from HF at step %d: got %r, HF %r (HF top-2 gap there %.5f)" % (
            where, k, ids[k:k + 4], want[k:k + 4],
            gold[k]["top"][0][1] - gold[k]["top"][1][1] if k < len(gold) else float("nan")))
    worst = 0.0
    for i, (g, got, top) in enumerate(zip(gold, lp["token_logprobs"], lp["top_logprobs"])):
        d = abs(got - g["logprob"])
        worst = max(worst, d)
        assert d <= TOL, "%s: step %d logprob %.6f, HF %.6f" % (where, i, got, g["logprob"])
        top_ids = {token_id(k): v for k, v in top.items()}
        assert len(top_ids) == len(g["top"]), (where, i, top_ids)
        for gid, gv in g["top"]:
            tied = [v for j, v in g["top"] if j != gid and abs(v - gv) <= TIE] + (
                [g["next"]] if abs(g["next"] - gv) <= TIE else [])
            if tied:
                continue  # ties may come in either order at the cut
            assert gid in top_ids, "%s: step %d: HF top id %d (%.6f) missing from %r" % (where, i, gid, gv, top_ids)
            assert abs(top_ids[gid] - gv) <= TOL, "%s: step %d id %d: %.6f, HF %.6f" % (where, i, gid, top_ids[gid], gv)
            worst = max(worst, abs(top_ids[gid] - gv))
    # the text is the router's decoding of exactly these ids (special tokens kept, as /detokenize does)
    status, d = C.post_json("/detokenize", {"tokens": want})
    assert status == 200 and text == d["prompt"], (where, text, d)
    print("  %-28s max |logprob - HF| %.2e" % (where, worst), flush=True)


def make(case, stream, label=""):
    def t():
        check_case(CASES[case], stream)
    t.__name__ = "qwen2_%s_%s%s" % (case, "stream" if stream else "greedy", label)
    return t


def test_short_prompt_matches_golden_json():
    """steps.json's short case is golden.json's prompt and greedy ids (one source of truth)."""
    assert CASES["short"]["prompt_ids"] == GOLD["input_ids"]
    assert [s["id"] for s in CASES["short"]["steps"]] == GOLD["greedy"]


def main():
    global C
    rc = 0
    for label, extra in (("", []), ("_chunk64", ["--chunked-prefill-size", "64"])):
        C = Cluster(encoders=0, model=CASE, router_args=["--tokenizer-path", MODEL],
                    worker_args={"prefill_worker": extra})
        try:
            C.wait_ready()
            tests = [test_short_prompt_matches_golden_json] if not label else []
            cases = ["short", "long"] if not label else ["long"]
            tests += [make(c, s, label) for c in cases for s in (False, True)]
            rc |= run_tests(tests)
        finally:
            C.stop()
    return rc


if __name__ == "__main__":
    sys.exit(main())
