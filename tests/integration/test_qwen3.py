"""Qwen3-VL through the cluster (router, encoder, prefill, decode) with the tiny golden checkpoint
tests/data/model/qwen3vl_tiny (tools/gen_qwen_goldens.py: a scaled Qwen3VLForConditionalGeneration in
HF's layout, bf16, interleaved M-RoPE sections [10, 7, 7], Qwen3 text with q_norm / k_norm and
head_dim 48, a 4-layer tower with a 6x6 learned position grid and DeepStack after vision layers 0
and 2; its processor takes 32*32*4 .. 32*32*64 pixels). The tests are test_qwen.py's, run on this
checkpoint:

- The six HF golden conversations answer HF's 16 greedy tokens id for id, with Qwen3VLProcessor's
  prompt length: each embedding row the encoder sends carries the image token's embedding and its
  two DeepStack levels (Embeddings.hidden = 3 x 128), the prefill adds the levels after LM layers 0
  and 1 at the image tokens.
- Images in pieces of 16 rows and prompts in chunks of 37 tokens (a chunk may hold part of an image:
  its DeepStack rows go with its tokens); concurrency; the embedding cache; no allocation on the
  request path.
- Prefill and decode as tensor-parallel groups of 2: the leader's step plans carry the whole rows.

Tokens are compared as ids (return_tokens_as_token_ids), never as text.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import test_qwen as tq  # noqa: E402
from cluster import ROOT, Cluster, run_tests  # noqa: E402

tq.QW = os.path.join(ROOT, "tests", "data", "model", "qwen3vl_tiny")
tq.GOLD = json.load(open(os.path.join(tq.QW, "golden.json")))
HB = tq.HB


def main():
    rc = 0
    tq.C = Cluster(model=tq.QW, common_worker_args=HB)
    try:
        tq.C.wait_ready()
        rc |= run_tests([tq.test_golden_cases, tq.test_tokenize_text_case, tq.test_aspect_ratio_refused,
                         tq.test_memory_plan_is_what_the_workers_allocate])
    finally:
        tq.C.stop()
    tq.C = Cluster(model=tq.QW, common_worker_args=HB,
                   worker_args={"encoder_worker": ["--embed-piece-rows", "16"],
                                "prefill_worker": ["--chunked-prefill-size", "37"]})
    try:
        tq.C.wait_ready()
        rc |= run_tests([tq.test_pieces_and_chunks, tq.test_concurrent_distinct, tq.test_cache_hit_same_tokens,
                         tq.test_no_heap_allocations_while_serving])
    finally:
        tq.C.stop()
    rc |= run_tests([tq.test_tp_groups])
    sys.exit(rc)


if __name__ == "__main__":
    main()
