"""Through the cluster, for the scaled-down Qwen2 golden (q/k/v biases, untied, f16 weights, an EOS
list): greedy generation equals transformers' model.generate token for token, and the first token's
logprob equals HF's log-softmax of the golden logits within 1e-3.

The checkpoint has no tokenizer of its own, so the router borrows the bundled model's tokenizer
(vocabulary 4096 > 384) only to turn ids into text; the prompt goes in as token ids and the output is
compared as the text of the golden ids, decoded by the same router.
"""
import array
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from cluster import ROOT, Cluster, MODEL, run_tests  # noqa: E402

CASE = os.path.join(ROOT, "tests", "data", "model", "qwen2_text")
GOLD = json.load(open(os.path.join(CASE, "golden.json")))
C = None


def test_qwen2_greedy_and_logprobs_match_hf():
    ids, greedy, vocab = GOLD["input_ids"], GOLD["greedy"], GOLD["vocab"]
    body = {"model": "qwen2_text", "prompt": ids, "max_tokens": len(greedy), "temperature": 0, "logprobs": 1}
    status, r = C.post_json("/v1/completions", body)
    assert status == 200, (status, r)
    assert r["usage"]["prompt_tokens"] == len(ids), r["usage"]
    assert r["usage"]["completion_tokens"] == len(greedy), (r["usage"], len(greedy))
    status, d = C.post_json("/detokenize", {"tokens": greedy})
    assert status == 200
    assert r["choices"][0]["text"] == d["prompt"], (r["choices"][0]["text"], d["prompt"])
    logits = array.array("f")
    with open(os.path.join(CASE, "logits.bin"), "rb") as f:
        logits.frombytes(f.read())
    last = logits[(len(ids) - 1) * vocab: len(ids) * vocab]
    mx = max(last)
    lse = mx + math.log(sum(math.exp(x - mx) for x in last))
    want = last[greedy[0]] - lse
    got = r["choices"][0]["logprobs"]["token_logprobs"][0]
    assert abs(got - want) <= 1e-3, (got, want)


if __name__ == "__main__":
    C = Cluster(encoders=0, model=CASE, router_args=["--tokenizer-path", MODEL])
    try:
        C.wait_ready()
        rc = run_tests([test_qwen2_greedy_and_logprobs_match_hf])
    finally:
        C.stop()
    sys.exit(rc)
