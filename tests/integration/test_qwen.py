"""Qwen2.5-VL through the cluster (router, encoder, prefill, decode) with the tiny golden checkpoint
tests/data/model/qwen25vl_tiny (tools/gen_qwen_goldens.py: a scaled Qwen2_5_VLForConditionalGeneration
in HF's layout, bf16, M-RoPE sections [4, 6, 6], a 4-layer tower with 2x2-merged windows and two
full-attention layers; its processor takes 56*56 .. 28*28*64 pixels).

- The six HF golden conversations (text only, one image, two images of different sizes, an image
  upscaled to min_pixels, one clipped by max_pixels, multi-turn) answer HF's 16 greedy tokens id for
  id, and usage.prompt_tokens equals Qwen2_5_VLProcessor's length: the router expanded each
  <|image_pad|> from the image header, the encoder produced that many rows, the prefill laid them
  and derived the M-RoPE positions from the span grids, the decode added the rope delta.
- A second cluster sends every image in pieces of 16 rows (--embed-piece-rows: the 35- and
  48-token images go in 3 pieces, as a 16k-token image goes in 64 pieces of 256) and prefills in
  chunks of 37 tokens: the same tokens, streaming or not; concurrent requests each get their own
  answer; a repeat is an embedding-cache hit (an entry of pieces) with the same tokens; no worker
  allocates on the request path.
- Prefill and decode as tensor-parallel groups of 2 (the leaders' step plans carry the M-RoPE
  positions, the decode leader the rope delta): HF's tokens for every golden conversation.
- A prefill embedding pool of one image, images in pieces, nine one-image requests at once: each
  waits for the pool (the encoder holds it), none is refused with a 503.
- An encoder with --max-image-tokens 20 refuses a 35-token image with a 400 naming the limit and
  the max_pixels that would fit, still serves a 6-token one, and serves the 35-token picture when
  the request asks for that max_pixels (mm_processor_kwargs); the router refuses an aspect ratio
  above 200 with a 400.
- mm_processor_kwargs: the checkpoint's own limits give HF's tokens; a lower max_pixels gives the
  prompt length transformers' smart_resize gives and a fresh encoding (the cache key covers the
  limits); limits beyond the checkpoint's or crossed are 400s.

Tokens are compared as ids (return_tokens_as_token_ids), never as text.
"""
import concurrent.futures
import json
import os
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import ROOT, Cluster, free_port, image_url, run_tests, wait_for  # noqa: E402
from test_llama4 import synth_png as l4_synth_png  # noqa: E402  (the same synthetic picture)

QW = os.path.join(ROOT, "tests", "data", "model", "qwen25vl_tiny")
GOLD = json.load(open(os.path.join(QW, "golden.json")))
HB = ["--heartbeat-interval", "0.1"]
WORKERS = ("encoder-0", "prefill-0", "decode-0")
TMP = tempfile.mkdtemp(prefix="prism-qwen-")
C = None


def synth_png(w, h, seed):
    import test_llama4
    test_llama4.TMP = TMP
    return l4_synth_png(w, h, seed)


def case_messages(case):
    """The golden conversation with each image part as an image_url of its synthetic picture."""
    imgs = iter(case["images"])
    out = []
    for m in case["messages"]:
        parts = []
        for p in m["content"]:
            if p.get("type") == "image":
                im = next(imgs)
                parts.append({"type": "image_url", "image_url": {"url": image_url(synth_png(im["w"], im["h"], im["seed"]))}})
            else:
                parts.append(p)
        out.append({"role": m["role"], "content": parts})
    return out


def body(messages, max_tokens=16, stream=False):
    b = {"model": os.path.basename(QW), "messages": messages, "max_tokens": max_tokens, "temperature": 0,
         "logprobs": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    if stream:
        b.update(stream=True, stream_options={"include_usage": True})
    return b


def token_id(s):
    assert s.startswith("token_id:"), s
    return int(s[len("token_id:"):])


def ask(c, b):
    if not b.get("stream"):
        status, r = c.post_json("/v1/chat/completions", b)
        assert status == 200, (status, r)
        return [token_id(t["token"]) for t in r["choices"][0]["logprobs"]["content"]], r["usage"]
    status, events, done = c.stream("/v1/chat/completions", b)
    assert status == 200 and done, (status, events[-1:])
    ids, usage = [], None
    for e in events:
        usage = e.get("usage") or usage
        for ch in e.get("choices") or []:
            ids += [token_id(t["token"]) for t in ((ch.get("logprobs") or {}).get("content") or [])]
    return ids, usage


def check_cases(c, stream_every=2):
    for i, case in enumerate(GOLD["cases"]):
        ids, usage = ask(c, body(case_messages(case), stream=i % stream_every == 1))
        assert usage["prompt_tokens"] == len(case["input_ids"]), (case["name"], usage, len(case["input_ids"]))
        if ids != case["greedy"]:
            k = next(j for j, (a, b) in enumerate(zip(ids + [None], case["greedy"] + [None])) if a != b)
            raise AssertionError("%s: token %d differs from HF: got %r, HF %r" % (case["name"], k, ids[k:k + 4],
                                                                                 case["greedy"][k:k + 4]))


# ---------------------------------------------------------------- cluster A: defaults

def test_golden_cases():
    """HF's greedy tokens and prompt lengths for all six golden conversations."""
    check_cases(C)


def test_tokenize_text_case():
    """/tokenize renders the checkpoint's chat template and tokenizes like HF (text only)."""
    case = next(x for x in GOLD["cases"] if x["name"] == "text")
    status, r = C.post_json("/tokenize", {"messages": case["messages"], "add_generation_prompt": True})
    assert status == 200, (status, r)
    assert r["tokens"] == case["input_ids"], (r["tokens"][:20], case["input_ids"][:20])


def test_aspect_ratio_refused():
    """smart_resize refuses an aspect ratio above 200: so does the router, from the header."""
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(synth_png(402, 2, 1))}},
                                         {"type": "text", "text": "What is this?"}]}]
    status, r = C.post_json("/v1/chat/completions", body(msgs, max_tokens=2))
    assert status == 400 and "aspect ratio" in r["error"]["message"], (status, r)


def test_mm_processor_kwargs():
    """A request's mm_processor_kwargs (vLLM's) reach the router's prompt and the encoder's
    preprocessing, and key the encoder's cache: the checkpoint's own limits give HF's golden tokens;
    then, for the same picture bytes (whose default-limit embeddings are cached), max_pixels 12544
    (the 640x480 picture at 84x112 px: 12 tokens instead of 54) and min_pixels 15680 (20x30 upscaled
    to 12x8 patches) give HF's prompt length and greedy tokens with the processor called at those
    limits (golden_request.json); limits beyond the checkpoint's, or crossed, are 400s."""
    case = next(x for x in GOLD["cases"] if x["name"] == "max_pixels")
    own = {"min_pixels": 3136, "max_pixels": 50176}   # the checkpoint's preprocessor_config.json
    ids, usage = ask(C, dict(body(case_messages(case)), mm_processor_kwargs=own))
    assert usage["prompt_tokens"] == len(case["input_ids"]) and ids == case["greedy"], (usage, ids, case["greedy"])
    for rc in json.load(open(os.path.join(QW, "golden_request.json")))["cases"]:
        ids, usage = ask(C, dict(body(case_messages(rc), max_tokens=len(rc["greedy"])),
                                 mm_processor_kwargs=rc["mm_processor_kwargs"]))
        assert usage["prompt_tokens"] == len(rc["input_ids"]) and ids == rc["greedy"], (rc["name"], usage, ids,
                                                                                          rc["greedy"])
    for kw, words in (({"max_pixels": 50177}, "exceeds the model's max_pixels (50176)"),
                      ({"min_pixels": 9000, "max_pixels": 8000}, "min_pixels"),
                      ({"min_pixels": 60000}, "min_pixels 60000 exceeds max_pixels 50176"),
                      ({"size": 5}, "not supported")):
        status, r = C.post_json("/v1/chat/completions", dict(body(case_messages(case), max_tokens=2),
                                                             mm_processor_kwargs=kw))
        assert status == 400 and words in r["error"]["message"], (kw, status, r)


def test_memory_plan_is_what_the_workers_allocate():
    """The native-resolution encoder's regions (the tower's weights, arena and host records for the
    largest image, pixels and outputs, the cache in pieces), the prefill's chunk M-RoPE positions and
    the decode's rope deltas are what the workers hold on the heap after start-up."""
    C.check_memory_plan()


# ---------------------------------------------------------------- cluster B: pieces and chunks

def test_pieces_and_chunks():
    """Images in pieces of 16 rows, prompts in chunks of 37 tokens: HF's tokens, streaming or not."""
    check_cases(C, stream_every=1)
    check_cases(C, stream_every=3)


def golden_at_once(cluster):
    """The golden conversations twice, all at once (every other one streamed): each HF's answer."""
    bodies = [body(case_messages(case), stream=i % 2 == 1) for i, case in enumerate(GOLD["cases"])] * 2
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        res = list(ex.map(lambda b: ask(cluster, b)[0], bodies))
    for i, got in enumerate(res):
        want = GOLD["cases"][i % len(GOLD["cases"])]["greedy"]
        assert got == want, (i, got, want)


def test_concurrent_distinct():
    """The golden conversations at once (several images in flight, in pieces): each its own answer."""
    golden_at_once(C)


def test_preempted_answers_unchanged():
    """Four image conversations without max_tokens (to the end of the 256-token context) at once on
    20 KV blocks: sequences are preempted and prefilled again from their tokens, in chunks, with
    their images encoded again (M-RoPE positions and rope delta recomputed), and every answer is
    token for token its answer alone."""
    bodies = []
    for case in GOLD["cases"][:4]:
        b = body(case_messages(case))
        del b["max_tokens"]
        bodies.append(b)
    alone = [ask(C, b)[0] for b in bodies]
    p0 = C.metric("vllm:num_preemptions_total")
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        res = list(ex.map(lambda b: ask(C, b)[0], bodies))
    for i, (got, want) in enumerate(zip(res, alone)):
        assert got == want, (i, len(got), len(want))
    assert C.metric("vllm:num_preemptions_total") > p0, "the pool never ran out: nothing was preempted"


def test_preempted_by_migration_answers_unchanged():
    """The same four conversations all placed on decode-0 (the prefill worker stopped while they are
    dispatched), with a second decode worker started then: the sequences decode-0 preempts go on
    there with their KV moved (M-RoPE's rope delta with it: not prefilled, their images not encoded again)
    and every answer is token for token its answer alone."""
    bodies = []
    for case in GOLD["cases"][:4]:
        b = body(case_messages(case))
        del b["max_tokens"]
        bodies.append(b)
    alone = [ask(C, b)[0] for b in bodies]
    moved = C.metric("prism:preemptions_total", how="migrate")
    pre = C.procs["prefill-0"]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
            pre.send_signal(signal.SIGSTOP)
            try:
                jobs = [ex.submit(ask, C, b) for b in bodies]
                wait_for(lambda: C.metric("prism:router_requests_in_flight") == len(bodies), 10,
                         "every request dispatched")
                C.start_worker("decode-1", "decode_worker", ["--kv-blocks", "200"])
                wait_for(lambda: C.metric("prism:worker_heartbeats_total", worker="decode-1"), 30,
                         "decode-1 registered")
            finally:
                pre.send_signal(signal.SIGCONT)
            res = [f.result()[0] for f in jobs]
        for i, (got, want) in enumerate(zip(res, alone)):
            assert got == want, (i, len(got), len(want))
        print("migrated:", C.metric("prism:preemptions_total", how="migrate") - moved)
        assert C.metric("prism:preemptions_total", how="migrate") > moved, "nothing migrated"
    finally:
        C.kill("decode-1")
        wait_for(lambda: not C.metric("prism:worker_heartbeats_total", worker="decode-1"), 10, "decode-1 dropped")


def encoder_counts(c):
    return (c.metric("prism:worker_embedding_cache_hits_total", worker="encoder-0") or 0,
            c.metric("prism:worker_embedding_cache_misses_total", worker="encoder-0") or 0)


def test_cache_hit_same_tokens():
    """A repeated image comes from the embedding cache (an entry of its pieces): same tokens."""
    case = next(x for x in GOLD["cases"] if x["name"] == "max_pixels")
    wait_for(lambda: encoder_counts(C)[1] >= 1, 10, "encoder counters")
    hits0 = encoder_counts(C)[0]
    # a salt of its own: the prompt's cached prefix would send the image to no encoder at all
    ids, _ = ask(C, dict(body(case_messages(case)), cache_salt="embedding-cache-%f" % time.time()))
    wait_for(lambda: encoder_counts(C)[0] > hits0, 10, "a cache hit")
    assert ids == case["greedy"]


def allocations(c):
    return {w: c.metric("prism:worker_heap_allocations_total", worker=w) for w in WORKERS}


def idle(c):
    return all(c.metric("prism:worker_running", worker=w) == 0 and c.metric("prism:worker_waiting", worker=w) == 0
               for w in WORKERS)


def test_no_heap_allocations_while_serving():
    """Qwen-VL image and text requests (pieces, reserved pool pages, M-RoPE chunks) leave every
    worker's heap allocation count where it was."""
    imgs = [synth_png(120, 90, 51), synth_png(30, 40, 52), synth_png(200, 60, 53)]

    def serve():
        bodies = [body([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(im)}},
                                                     {"type": "text", "text": "Round: what is in it?"}]}],
                       max_tokens=6) for im in imgs]
        bodies.append(body([{"role": "user", "content": "Hi!"}], max_tokens=6))
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            res = list(ex.map(lambda b: ask(C, b), bodies))
        assert all(len(ids) == 6 for ids, _ in res)
        wait_for(lambda: idle(C), 20, "idle workers")
    serve()   # warm-up
    wait_for(lambda: all(v for v in allocations(C).values()), 10, "allocation counters")
    before = allocations(C)
    serve()
    serve()
    after = allocations(C)
    assert after == before, ("heap allocations on the request path", before, after)


# ---------------------------------------------------------------- cluster C: tensor-parallel groups

def start_group(c, name, size, kind):
    leader = "tcp://127.0.0.1:%d" % free_port()
    tp = ["--tp-size", str(size), "--tp-leader", leader]
    c.start_worker(name, kind, extra=tp + ["--tp-rank", "0"])
    for r in range(1, size):
        c._start("%s.r%d" % (name, r), kind,
                 ["--model-path", c.model, "--worker-id", "%s.r%d" % (name, r), *c.sec, *tp, "--tp-rank", str(r)])
    c.expected[kind.split("_")[0] + "s"] = 1


def test_tp_groups():
    """Prefill and decode groups of 2 ranks: HF's tokens for every golden conversation."""
    with Cluster(model=QW, prefills=0, decodes=0, common_worker_args=HB) as c:
        start_group(c, "prefill-0", 2, "prefill_worker")
        start_group(c, "decode-0", 2, "decode_worker")
        c.wait_ready(timeout=300)
        check_cases(c)


def test_batched_mrope():
    """Batched prefill with M-RoPE: the golden conversations at once, twice, on a prefill that pauses
    between forwards (test hook PRISM_TEST_PREFILL_FORWARD_GAP_S) so that the prompts whose images
    are in meet in one forward, each with its own rotary positions: HF's tokens for every one, and
    forwards carried several prompts."""
    with Cluster(model=QW, common_worker_args=HB,
                 worker_env={"prefill_worker": {"PRISM_TEST_PREFILL_FORWARD_GAP_S": "0.3"}}) as c:
        c.wait_ready()

        def shared():   # prompts carried beyond one a forward (the prefill worker's heartbeat)
            return ((c.metric("prism:worker_prefill_forward_prompts_total", worker="prefill-0") or 0) -
                    (c.metric("prism:worker_prefill_forwards_total", worker="prefill-0") or 0))
        before = shared()
        golden_at_once(c)
        wait_for(lambda: shared() > before, 10, "a forward carrying two of the prompts")


def test_full_pool_waits():
    """A prefill embedding pool of one image (--embed-pool-images 1), images in pieces of 16 rows,
    a prefill pausing between forwards (test hook PRISM_TEST_PREFILL_FORWARD_GAP_S) and nine
    one-image requests at once: each image waits for the pool (the encoder holds it) and every
    request answers HF's tokens, none a 503 "prefill embedding pool is full". The pool credits an
    image arriving in pieces with one message beyond its room, which must be that image's next
    piece: the encoder sends an image's pieces back to back, never another image's first between
    them (encoder_worker: flush_batch)."""
    env = {"prefill_worker": {"PRISM_TEST_PREFILL_FORWARD_GAP_S": "0.05"}}
    args = {"encoder_worker": ["--embed-piece-rows", "16"],
            "prefill_worker": ["--embed-pool-images", "1", "--chunked-prefill-size", "37"]}
    cases = [x for x in GOLD["cases"] if x["name"] in ("one_image", "max_pixels", "multi_turn")]
    with Cluster(model=QW, common_worker_args=HB, worker_args=args, worker_env=env) as c:
        c.wait_ready()
        for rnd in range(2):
            # salts of their own: a cached prefix would send its image to no encoder at all
            bodies = [dict(body(case_messages(case), stream=i % 2 == 1), cache_salt="pool-%d-%d" % (rnd, i))
                      for i, case in enumerate(cases * 3)]
            with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
                res = list(ex.map(lambda b: ask(c, b)[0], bodies))
            for i, got in enumerate(res):
                assert got == cases[i % len(cases)]["greedy"], (rnd, i, got)
        wait_for(lambda: c.metric("prism:worker_sends_waited_total", worker="encoder-0"), 10,
                 "embeddings held by the encoder until the pool had room")


# ---------------------------------------------------------------- cluster D: an image bound

def test_image_token_bound():
    """--max-image-tokens 20: a 35-token image is refused with a 400 naming the limit and the
    max_pixels that fits (20 * 28 * 28 = 15680); a 6-token one is served."""
    big = next(x for x in GOLD["cases"] if x["name"] == "one_image")
    small = next(x for x in GOLD["cases"] if x["name"] == "min_pixels")
    status, r = C.post_json("/v1/chat/completions", body(case_messages(big), max_tokens=2))
    assert status == 400, (status, r)
    msg = r["error"]["message"]
    assert "35 image tokens" in msg and "at most 20" in msg and "max_pixels of 15680" in msg, msg
    ids, usage = ask(C, body(case_messages(small)))
    assert ids == small["greedy"], (ids, small["greedy"])
    # the max_pixels the 400 named, as the request's mm_processor_kwargs: 84x140 px, 15 tokens
    ids, usage = ask(C, dict(body(case_messages(big), max_tokens=2), mm_processor_kwargs={"max_pixels": 15680}))
    assert usage["prompt_tokens"] == len(big["input_ids"]) - 35 + 15, usage


def main():
    global C
    rc = 0
    C = Cluster(model=QW, common_worker_args=HB)
    try:
        C.wait_ready()
        rc |= run_tests([test_golden_cases, test_tokenize_text_case, test_aspect_ratio_refused, test_mm_processor_kwargs,
                         test_memory_plan_is_what_the_workers_allocate])
    finally:
        C.stop()
    # a 256-token context and 20 KV blocks (320 tokens): long answers outgrow the decode's pool
    ctx = ["--context-length", "256"]
    C = Cluster(model=QW, common_worker_args=HB, router_args=ctx,
                # two image threads: native-resolution images of a batch decode at once (issue 33)
                worker_args={"encoder_worker": ["--embed-piece-rows", "16", "--image-threads", "2"],
                             "prefill_worker": ["--chunked-prefill-size", "37"] + ctx,
                             "decode_worker": ["--kv-blocks", "20"] + ctx})
    try:
        C.wait_ready()
        rc |= run_tests([test_pieces_and_chunks, test_concurrent_distinct, test_cache_hit_same_tokens,
                         test_no_heap_allocations_while_serving, test_preempted_answers_unchanged,
                         test_preempted_by_migration_answers_unchanged,
                         test_memory_plan_is_what_the_workers_allocate])
    finally:
        C.stop()
    rc |= run_tests([test_tp_groups])
    rc |= run_tests([test_batched_mrope])
    rc |= run_tests([test_full_pool_waits])
    C = Cluster(model=QW, common_worker_args=HB, worker_args={"encoder_worker": ["--max-image-tokens", "20"]})
    try:
        C.wait_ready()
        rc |= run_tests([test_image_token_bound])
    finally:
        C.stop()
    sys.exit(rc)


if __name__ == "__main__":
    main()
