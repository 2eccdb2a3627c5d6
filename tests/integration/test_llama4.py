"""Llama-4 through the cluster (router, encoder, prefill, decode) with the tiny golden checkpoint
tests/data/model/llama4_tiny (tools/gen_llama4_goldens.py: a NoPE layer, 32-token attention chunks,
MoE and dense layers, a vision tower on 56-px tiles with pixel shuffle, max_patches 6).

- The golden request (the chat template, a 300x200 picture that needs 2x3 tiles plus the global
  tile, 180 prompt tokens) answers HF's 32 greedy tokens id for id, streaming or not; its decode
  crosses the attention-chunk boundary at position 192.
- A second cluster prefills in 50-token pieces (every piece crosses a 32-token chunk boundary,
  images split between pieces) with an encoder whose arena holds 2 tiles (a 7-tile image runs in
  4 micro-batches, images of different tile counts share the pixel buffer): same tokens, and
  concurrent requests with different images each get their own prism_generate answer.
- The router's chat template and tokenizer give HF's ids for the template goldens
  (/tokenize), and its image expansion, computed from the header alone, gives Llama4Processor's
  prompt length for one and two images of different tile grids (usage.prompt_tokens); the prefill
  worker checks each image's rows against the <|patch|> positions, so a request completing means
  the encoder produced exactly that many rows.
- Text-only, one-tile (no global tile) and two-image requests equal prism_generate; the embedding
  cache answers a repeat (a multi-unit entry) with the same tokens; no worker allocates on the
  request path; malformed Llama-4 embeddings are dropped without harm.
- Scout's 10M max_position_embeddings: the router and workers serve 131072 tokens unless
  --context-length says otherwise.

Tokens are compared as ids (return_tokens_as_token_ids), never as text.
"""
import concurrent.futures
import json
import os
import re
import shutil
import signal
import struct
import sys
import tempfile
import threading
import time
import zlib

sys.path.insert(0, os.path.dirname(__file__))
from cluster import (ROOT, Cluster, binary, image_url, make_image, run_tool, run_tests,  # noqa: E402
                     fresh_heartbeats, wait_for)

L4 = os.path.join(ROOT, "tests", "data", "model", "llama4_tiny")
GOLD = json.load(open(os.path.join(L4, "golden.json")))
CFG = json.load(open(os.path.join(L4, "config.json")))
TPL = json.load(open(os.path.join(ROOT, "tests", "data", "template", "llama4_goldens.json")))["templates"][0]
QUESTION = "What is in the image? Describe the picture in one sentence, please."
HB = ["--heartbeat-interval", "0.1"]
WORKERS = ("encoder-0", "prefill-0", "decode-0")
TMP = tempfile.mkdtemp(prefix="prism-llama4-")
C = None


def synth_png(w, h, seed):
    """The synthetic picture of tools/gen_llama4_goldens.py (tests/unit/image/llama4_synth.h), as a
    PNG (lossless: the decoded pixels are the ones HF saw)."""
    path = os.path.join(TMP, "synth_%dx%d_%d.png" % (w, h, seed))
    if os.path.exists(path):
        return path
    M = 0xFFFFFFFF
    dw, dh = max(w - 1, 1), max(h - 1, 1)
    raw = bytearray()
    for y in range(h):
        raw.append(0)
        for x in range(w):
            for c in range(3):
                hsh = ((x * 73856093) & M) ^ ((y * 19349663) & M) ^ (((c + seed) * 83492791) & M)
                hsh = ((hsh * 2654435761) & M) >> 27
                grad = (((x * 255) // dw) * (1 + c) + ((y * 255) // dh) * (3 - c)) // 4
                raw.append((grad + hsh) & 255)

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & M)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
                chunk(b"IDAT", zlib.compress(bytes(raw))) + chunk(b"IEND", b""))
    return path


GOLD_IMG = None


def body(text, images=(), max_tokens=32, stream=False, **kw):
    content = [{"type": "image_url", "image_url": {"url": image_url(p)}} for p in images]
    content.append({"type": "text", "text": text})
    b = {"model": "llama4_tiny", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
         "temperature": 0, "logprobs": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    if stream:
        b.update(stream=True, stream_options={"include_usage": True})
    b.update(kw)
    return b


def token_id(s):
    assert s.startswith("token_id:"), s
    return int(s[len("token_id:"):])


def ask(c, b):
    """(token ids, usage) of a chat request, streaming or not."""
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


def reference(images, text, max_tokens):
    """prism_generate (one process, whole-image decode): {prompt_tokens, token_ids, text}."""
    args = [binary("prism_generate"), "--model-path", L4, "--user", text, "--max-tokens", str(max_tokens)]
    if images:
        args += ["--image", ",".join(images)]
    return json.loads(run_tool(args, timeout=300).stdout)


def same_as_reference(ids, ref, max_tokens):
    """The cluster ran with ignore_eos; prism_generate stops at EOS (which it includes)."""
    if len(ref) < max_tokens:
        assert ref[-1] in CFG["text_config"]["eos_token_id"], ref
        return ids[:len(ref)] == ref
    return ids == ref


def check_golden(stream):
    ids, usage = ask(C, body(QUESTION, [GOLD_IMG], stream=stream))
    assert usage["prompt_tokens"] == GOLD["n_prompt"], usage
    if ids != GOLD["greedy"]:
        k = next(i for i, (a, b) in enumerate(zip(ids + [None], GOLD["greedy"] + [None])) if a != b)
        raise AssertionError("token %d differs from HF: got %r, HF %r" % (k, ids[k:k + 4], GOLD["greedy"][k:k + 4]))


# ---------------------------------------------------------------- cluster A: defaults

def test_golden_image_greedy():
    """HF's greedy tokens for the golden image request; the decode crosses an attention-chunk boundary."""
    chunk = CFG["text_config"]["attention_chunk_size"]
    n = GOLD["n_prompt"]
    assert n // chunk != (n + len(GOLD["greedy"]) - 1) // chunk
    check_golden(False)


def test_golden_image_stream():
    check_golden(True)


def test_template_and_tokenizer_through_router():
    """/tokenize renders Llama-4's chat template and tokenizes like HF for every template golden
    (text, system, multi-turn, images, tools, tool calls), images given as HF's {"type": "image"} or
    as OpenAI's image_url parts (the placeholder was dropped for those: one token short per image)."""
    for case in TPL["cases"]:
        req = {"messages": case["messages"], "add_generation_prompt": case["add_generation_prompt"]}
        if case.get("tools"):
            req["tools"] = case["tools"]
        status, r = C.post_json("/tokenize", req)
        assert status == 200, (case["name"], status, r)
        assert r["tokens"] == case["token_ids"], (case["name"], r["tokens"][:20], case["token_ids"][:20])
        if case.get("images"):   # as OpenAI clients send them: one placeholder per image all the same
            status, r = C.post_json("/tokenize", dict(req, messages=openai_messages(case)))
            assert status == 200, (case["name"], status, r)
            assert r["tokens"] == case["token_ids"], (case["name"], len(r["tokens"]), len(case["token_ids"]))


def openai_messages(case):
    """A template golden's HF messages with each {"type": "image"} as an image_url of its picture."""
    imgs = iter(case["images"])
    out = []
    for m in case["messages"]:
        m = dict(m)
        if isinstance(m.get("content"), list):
            parts = []
            for p in m["content"]:
                if p.get("type") == "image":
                    im = next(imgs)
                    parts.append({"type": "image_url",
                                  "image_url": {"url": image_url(synth_png(im["w"], im["h"], im["seed"]))}})
                else:
                    parts.append(p)
            m["content"] = parts
        out.append(m)
    return out


def test_image_prompt_length_equals_processor():
    """For one and two images of different tile grids the router's expansion (from the headers)
    has Llama4Processor's length; the requests complete, so every image's rows matched its tokens."""
    n = 0
    for case in TPL["cases"]:
        if not case.get("images"):
            continue
        b = {"model": "llama4_tiny", "messages": openai_messages(case), "max_tokens": 2, "temperature": 0}
        status, r = C.post_json("/v1/chat/completions", b)
        assert status == 200, (case["name"], status, r)
        assert r["usage"]["prompt_tokens"] == len(case["input_ids"]), (case["name"], r["usage"], len(case["input_ids"]))
        n += 1
    assert n >= 3


def test_text_and_images_match_prism_generate():
    """Text only, a one-tile image (no global tile), a 4:3 JPEG and two images in one request."""
    small = synth_png(40, 30, 7)
    jpg = make_image(os.path.join(TMP, "photo_640x480.jpg"), width=640, height=480, photo=True, seed=3)
    tall = synth_png(100, 300, 61)
    for images, text in (([], "Hello there, who are you?"), ([small], "What is this?"), ([jpg], "Describe it."),
                         ([tall, small], "Compare the two pictures.")):
        ref = reference(images, text, 12)
        ids, usage = ask(C, body(text, images, max_tokens=12))
        assert usage["prompt_tokens"] == ref["prompt_tokens"], (images, usage, ref["prompt_tokens"])
        assert same_as_reference(ids, ref["token_ids"], 12), (images, ids, ref["token_ids"])


def encoder_counts(c):
    return (c.metric("prism:worker_embedding_cache_hits_total", worker="encoder-0") or 0,
            c.metric("prism:worker_embedding_cache_misses_total", worker="encoder-0") or 0)


def test_cache_hit_same_tokens():
    """A repeated 7-tile image is answered from the embedding cache (an entry of 7 tile units)."""
    img = synth_png(300, 200, 9)
    first, _ = ask(C, body("Once more.", [img], max_tokens=8))
    hits0, _ = wait_for(lambda: encoder_counts(C)[1] >= 1 and encoder_counts(C), 10, "encoder counters")
    # a salt of its own: the prompt's cached prefix would send the image to no encoder at all
    again, _ = ask(C, dict(body("Once more.", [img], max_tokens=8), cache_salt="embedding-cache"))
    wait_for(lambda: encoder_counts(C)[0] > hits0, 10, "a cache hit")
    assert again == first


def test_prefix_cache_same_logprobs():
    """The golden request (180 tokens: 7-tile image, 32-token attention chunks) read from the
    prefill's prefix cache (176 tokens: the chunked-attention layers' chunk [160, 192) reads cached
    positions 160-175) and a question that differs after the image (its blocks hit) answer as the
    uncached run does (a fresh cache_salt): ids equal, logprobs and top-5 within 1e-4."""
    def trace(b):
        status, r = C.post_json("/v1/chat/completions", b)
        assert status == 200, (status, r)
        content = r["choices"][0]["logprobs"]["content"]
        return ([t["token"] for t in content], [t["logprob"] for t in content] +
                [x["logprob"] for t in content for x in t["top_logprobs"]])

    def hits():
        return C.metric("vllm:prefix_cache_hits_total") or 0
    for q in (QUESTION, "Name the colours you see, then count them."):
        ref = trace(body(q, [GOLD_IMG], max_tokens=12, top_logprobs=5, cache_salt="fresh-%f" % time.time()))
        trace(body(q, [GOLD_IMG], max_tokens=12, top_logprobs=5))
        h0 = hits()
        got = trace(body(q, [GOLD_IMG], max_tokens=12, top_logprobs=5))
        wait_for(lambda: hits() > h0, 10, "the prefill to count the cached prompt")
        assert got[0] == ref[0], (q, got[0], ref[0])
        assert max(abs(a - b) for a, b in zip(got[1], ref[1])) <= 1e-4, q


def allocations(c):
    return {w: c.metric("prism:worker_heap_allocations_total", worker=w) for w in WORKERS}


def idle(c):
    return all(c.metric("prism:worker_running", worker=w) == 0 and c.metric("prism:worker_waiting", worker=w) == 0
               for w in WORKERS)


def test_no_heap_allocations_while_serving():
    """Llama-4 image and text requests (tiles, micro-batches, paged embeddings, KV rings) leave
    every worker's heap allocation count where it was."""
    imgs = [synth_png(300, 200, 5), synth_png(40, 30, 7), synth_png(100, 300, 61)]

    def serve():
        bodies = [body("Round: what is in it?", [im], max_tokens=6) for im in imgs] + [body("Hi!", max_tokens=6)]
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
    assert all(before[w] > 0 for w in WORKERS), before
    assert after == before, ("heap allocations on the request path", before, after)


def test_malformed_llama4_embeddings_dropped():
    """Embeddings of a row count that is not whole tiles, or of more tiles than an image can have,
    are dropped (logged); the prefill worker keeps serving."""
    log = C.wait_log("prefill-0", "ready in")
    endpoint = re.search(r"data (tcp://[^,\s]+)", log).group(1)
    per_tile = CFG["vision_config"]["image_size"] // CFG["vision_config"]["patch_size"]
    per_tile = (per_tile // 2) ** 2
    hidden = CFG["text_config"]["hidden_size"]
    before = C.log("prefill-0", tail=0).count("malformed embeddings dropped")
    for n_tokens in (per_tile * 7 + 1, per_tile * 8):
        run_tool([binary("prism_wire"), "--endpoint", endpoint, "--request-id", "424242", "--router-id", "nobody",
                  "--n-tokens", str(n_tokens), "--hidden", str(hidden), *C.sec], timeout=30)
    wait_for(lambda: C.log("prefill-0", tail=0).count("malformed embeddings dropped") >= before + 2, 10,
             "both dropped")
    ids, _ = ask(C, body(QUESTION, [GOLD_IMG], max_tokens=4))
    assert ids == GOLD["greedy"][:4]


# ---------------------------------------------------------------- cluster B: small pieces

def test_chunked_prefill_and_micro_batches():
    """Prefill in 50-token pieces (each crosses a chunk boundary; the image's patches span pieces)
    and an encoder arena of 2 tiles: HF's tokens, streaming or not."""
    check_golden(False)
    check_golden(True)


def test_concurrent_distinct_images():
    """Images of 7, 1 and 4 tiles at once (packed by tiles into the encoder's buffer): each request
    gets its own answer."""
    cases = [([synth_png(300, 200, 21)], "What is in the image?"), ([synth_png(40, 30, 22)], "Describe this."),
             ([synth_png(100, 300, 23)], "What do you see?"), ([synth_png(120, 112, 24)], "Tell me about it."),
             ([], "Just text, please.")]
    refs = [reference(im, t, 10)["token_ids"] for im, t in cases]
    assert len({tuple(r) for r in refs}) >= len(refs) - 1, refs
    bodies = [body(t, im, max_tokens=10, stream=i % 2 == 1) for i, (im, t) in enumerate(cases)] * 2
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        res = list(ex.map(lambda b: ask(C, b)[0], bodies))
    for i, got in enumerate(res):
        assert same_as_reference(got, refs[i % len(cases)], 10), (i, got, refs[i % len(cases)])


def test_encoder_queue_bounded_in_bytes():
    """The encoder's queue holds image files; with --max-queued-image-bytes 1 the router sends it
    one image at a time (an image larger than the bound still goes alone) and holds the others, so
    encoder memory does not grow with concurrency. The encoder refuses a job over its bound, so
    without the router's byte bound requests fail (seen: 'encoder queue is full (image bytes)')."""
    paths = []
    for i in range(12):
        p = os.path.join(TMP, "photo_%d.jpg" % i)
        make_image(p, width=1024, height=768, photo=True, quality=92, seed=100 + i)
        paths.append(p)
    bodies = [body("Describe this.", [p], max_tokens=2, stream=i % 2 == 1) for i, p in enumerate(paths)]
    most, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            most[0] = max(most[0], C.metric("prism:worker_waiting", worker="encoder-0") or 0)
            time.sleep(0.02)
    t = threading.Thread(target=watch)
    t.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
            res = list(ex.map(lambda b: ask(C, b)[0], bodies))
    finally:
        stop.set()
        t.join()
    assert all(len(r) == 2 for r in res), res
    assert most[0] <= 1, ("images queued on the encoder at once", most[0])
    assert "encoder queue is full" not in C.log("encoder-0", tail=0)


# ---------------------------------------------------------------- Scout's context

def test_scout_context_is_capped():
    """With max_position_embeddings 10,485,760 (Scout's), router and workers serve 131072 tokens by
    default and --context-length otherwise; a worker planned for the cap registers."""
    d = os.path.join(TMP, "scout_ctx")
    shutil.copytree(L4, d, dirs_exist_ok=True)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["text_config"]["max_position_embeddings"] = 10485760
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with Cluster(model=d, encoders=0, prefills=0, decodes=1,
                 worker_args={"decode_worker": ["--kv-blocks", "8200", "--max-running-requests", "4"]}) as c:
        c.wait_log("router", "decode-0 registered", timeout=60)
        status, r = c.post_json("/tokenize", {"prompt": "hi"})
        assert status == 200 and r["max_model_len"] == 131072, r
        assert "serving 131072" in c.log("router", tail=0)
    with Cluster(model=d, encoders=0, prefills=0, decodes=0, router_args=["--context-length", "4096"]) as c:
        c.wait_log("router", "serving 'scout_ctx'", timeout=30)
        status, r = c.post_json("/tokenize", {"prompt": "hi"})
        assert status == 200 and r["max_model_len"] == 4096, r


def ask_all(c, b):
    """(every choice's token ids by index, usage) of a chat request (not streamed)."""
    status, r = c.post_json("/v1/chat/completions", b)
    assert status == 200, (status, r)
    return [[token_id(t["token"]) for t in ch["logprobs"]["content"]]
            for ch in sorted(r["choices"], key=lambda ch: ch["index"])], r["usage"]


def restart_decode0(extra):
    """decode-0 again, started with the flags extra."""
    C.kill("decode-0")
    wait_for(lambda: C.metric("prism:worker_heartbeats_total", worker="decode-0") is None, 30, "decode-0 dropped")
    C.start_worker("decode-0", "decode_worker", extra)
    wait_for(lambda: C.metric("prism:worker_heartbeats_total", worker="decode-0"), 60, "decode-0 back")
    # one answer through it: the prefill's link to the new worker is up (its CURVE handshake needs
    # the worker running, and run_together stops it)
    ask(C, body("Hello.", max_tokens=2))


def test_preempted_answers_unchanged():
    """Four 600-token answers together (greedy and seeded) on 64 KV blocks (38 each at the end: any
    two running at once outgrow the pool, however the decode worker's credit staggers their
    transfers): sequences are preempted
    and prefilled again from their tokens (in chunks of 50), their chunked-attention layers' rings
    refilled from the transfer, and every answer is token for token its answer alone. Then the same
    on a decode worker with a swap region: preempted by swap (the rings kept by their slots), with an
    n = 2 seeded request of priority 1 beside them (each choice at most 32 blocks: admitted to
    grow): its choices are swapped out one by one (their own rings stay with their slots), none is
    recomputed, and each choice is token for token its answer alone."""
    bodies = [body("Tell me about %s." % w, max_tokens=600, temperature=0.7 if i % 2 else 0, seed=3)
              for i, w in enumerate(("cats", "dogs", "ships", "rain"))]
    alone = [ask(C, b)[0] for b in bodies]
    p0 = C.metric("vllm:num_preemptions_total")
    res = run_together(bodies)
    for i, (got, want) in enumerate(zip(res, alone)):
        assert got == want, (i, len(got), len(want))
    assert C.metric("vllm:num_preemptions_total") > p0, "the pool never ran out: nothing was preempted"
    # The same with a swap region: the victims' pool blocks (the full-attention layers) go to host
    # memory, their rings stay with their batch slots; nothing is recomputed, every answer unchanged.
    two = body("Tell me about owls.", max_tokens=1, n=2, temperature=0.7, seed=5, priority=1)
    two["max_tokens"] = 32 * 16 - ask_all(C, two)[1]["prompt_tokens"] - 1
    two_alone = ask_all(C, two)[0]
    assert two_alone[0] != two_alone[1], "the seeded choices are alike: a mixed-up RNG stream would not show"
    restart_decode0(["--kv-swap-bytes", "64M", "--log-level", "debug"])
    try:
        r0, s0 = C.metric("prism:preemptions_total", how="recompute"), C.metric("prism:preemptions_total", how="swap")
        log0 = len(C.log("decode-0", tail=0))
        res = run_together(bodies + [two], fn=ask_all)
        for i, (got, want) in enumerate(zip(res, alone)):
            assert got == [want], ("answer changed by a swap", i, len(got[0]), len(want))
        assert res[-1] == two_alone, "an n = 2 answer changed by a swap"
        assert re.search(r"swapped out \(KV pool full\): \d+ blocks, priority 1", C.log("decode-0", tail=0)[log0:]), (
            "no choice of the n = 2 request was swapped out: the test proved nothing")
        assert C.metric("prism:preemptions_total", how="swap") > s0, "nothing was swapped out"
        assert C.metric("prism:preemptions_total", how="recompute") == r0, "a victim was recomputed"
    finally:
        restart_decode0([])   # the tests after this one preempt by migration, which swap would go before


def run_together(bodies, meanwhile=lambda: None, fn=ask):
    """The answers to bodies sent at once, decoded together: decode-0 is stopped (SIGSTOP) until every
    first token is out, so all their transfers wait in its socket (this tiny model decodes far faster
    than it prefills: sent at once, they hardly overlap otherwise, and the pool may never run out).
    meanwhile() runs while it is stopped, once every request is dispatched (to decode-0)."""
    firsts = C.metric("vllm:time_to_first_token_seconds_count")
    dec = C.procs["decode-0"]
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        dec.send_signal(signal.SIGSTOP)
        try:
            jobs = [ex.submit(fn, C, b) for b in bodies]
            wait_for(lambda: C.metric("prism:router_requests_in_flight") == len(bodies), 10, "every request dispatched")
            meanwhile()
            wait_for(lambda: C.metric("vllm:time_to_first_token_seconds_count") == firsts + len(bodies), 30,
                     "every first token")
        finally:
            dec.send_signal(signal.SIGCONT)
        return [f.result()[0] for f in jobs]


def test_preempted_by_migration_answers_unchanged():
    """Six such answers together on decode-0 (120 blocks' worth on its 64), with a second decode worker
    started while they are dispatched: the sequences decode-0 preempts go on on decode-1 with their
    KV moved, the chunked-attention layers' part from the slot's ring into the target's, and every
    answer is token for token its answer alone."""
    bodies = [body("Tell me about %s." % w, max_tokens=300, temperature=0.7 if i % 2 else 0, seed=3)
              for i, w in enumerate(("cats", "dogs", "ships", "rain", "trees", "stars"))]
    alone = [ask(C, b)[0] for b in bodies]
    moved = C.metric("prism:preemptions_total", how="migrate")

    def start_target():
        C.start_worker("decode-1", "decode_worker", ["--kv-blocks", "512"])
        wait_for(lambda: C.metric("prism:worker_heartbeats_total", worker="decode-1"), 30, "decode-1 registered")
    try:
        res = run_together(bodies, start_target)
        for i, (got, want) in enumerate(zip(res, alone)):
            assert got == want, (i, len(got), len(want))
        print("migrated:", C.metric("prism:preemptions_total", how="migrate") - moved)
        assert C.metric("prism:preemptions_total", how="migrate") > moved, "nothing migrated"
    finally:
        C.kill("decode-1")
        wait_for(lambda: not C.metric("prism:worker_heartbeats_total", worker="decode-1"), 10, "decode-1 dropped")


def test_short_context_unsplit_cache():
    """A context no longer than one attention chunk: the decode worker keeps every layer in one pool
    (a ring would be the whole context), the transfer layout is the same, and a decode that crosses
    the chunk boundary still equals prism_generate."""
    ctx = ["--context-length", "48"]
    with Cluster(model=L4, router_args=ctx, worker_args={"prefill_worker": ctx, "decode_worker": ctx}) as c:
        c.wait_ready()
        assert "per-sequence rings" not in c.log("decode-0", tail=0)
        text = "Hi!"
        ref = reference([], text, 24)
        ids, usage = ask(c, body(text, max_tokens=24))
        chunk = CFG["text_config"]["attention_chunk_size"]
        assert usage["prompt_tokens"] < chunk < usage["prompt_tokens"] + 24, usage
        assert same_as_reference(ids, ref["token_ids"], 24), (ids, ref)


def test_bf16_transfer_with_chunked_layers():
    """KV on the wire in bf16 (--kv-transfer-dtype bf16 on the prefill) with chunked-attention layers:
    a 201-token prompt's transfer is its 13 blocks of the full layer plus the chunked layers' block of
    the current chunk (from block 12), at half the fp32 bytes, widened into the decode's pool and ring;
    the greedy answer is prism_generate's (fp32 KV; seen: logprobs within 7e-3 of an f32 transfer's)."""
    with Cluster(model=L4, common_worker_args=HB,
                 worker_args={"prefill_worker": ["--kv-transfer-dtype", "bf16"]}) as c:
        c.wait_ready()
        text = "Tell me everything about " + " ".join("w%d" % i for i in range(60))
        ids, usage = ask(c, body(text, max_tokens=16))
        fresh_heartbeats(c, "prefill-0")
        sent = c.metric("prism:worker_kv_sent_bytes_total", worker="prefill-0")
    tc = CFG["text_config"]
    layer = 2 * 16 * tc["num_key_value_heads"] * tc["head_dim"] * 4   # one block's K and V of one layer, fp32
    chunk, n = tc["attention_chunk_size"], usage["prompt_tokens"]
    nb, lfb = (n + 15) // 16, n // chunk * chunk // 16
    n_local = sum(tc["no_rope_layers"])   # the RoPE layers are the chunked ones
    assert n == 201 and nb - lfb == 1, (n, nb, lfb)
    assert sent == (nb * (tc["num_hidden_layers"] - n_local) + (nb - lfb) * n_local) * layer // 2, sent
    ref = reference([], text, 16)
    assert same_as_reference(ids, ref["token_ids"], 16), (ids, ref)


def test_abort_inside_tile_micro_batches():
    """An image aborted while the tower runs the batch's tiles in micro-batches (a 5-tile image and a
    1-tile one in one batch, micro-batches of 2 tiles, one of them mixed) leaves it between two
    layers and its tiles left are skipped; the other image's embeddings are those it gets alone
    (same tokens and logprobs), and the encoder's slots are free again. The abort is sent once the tower
    holds after layer 1 of the mixed micro-batch (test hook PRISM_TEST_HOLD_MIXED_MICRO_BATCH_S, which
    waits there for an abort): by timing alone it landed after a micro-batch's last layer about one
    run in three on a loaded 2-core machine. A heavier random tower (CLIP-L-sized layers) as before."""
    d = os.path.join(TMP, "l4_heavy_vision")
    shutil.copytree(L4, d, dirs_exist_ok=True)
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["vision_config"].update(hidden_size=1024, intermediate_size=4096, num_attention_heads=16,
                                num_hidden_layers=4)
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    from test_liveness import Background, full_log, idle_pool_free, wait_pool_back, wait_until, worker_metric
    a, b, x = synth_png(112, 112, 31), synth_png(56, 56, 32), synth_png(300, 200, 33)
    rand = HB + ["--random-weights"]
    enc = rand + ["--max-batch-images", "2", "--max-batch-seconds", "0", "--embedding-cache-bytes", "0"]
    hold = {"encoder_worker": {"PRISM_TEST_HOLD_MIXED_MICRO_BATCH_S": "30"}}
    with Cluster(model=d, router_args=["--max-retries", "0"], worker_env=hold,
                 worker_args={"encoder_worker": enc, "prefill_worker": rand, "decode_worker": rand}) as c:
        c.wait_ready(timeout=120)

        def bd(img):
            return dict(body("What is in the image?", [img], max_tokens=4), model="l4_heavy_vision")
        status, r = c.post_json("/v1/chat/completions", bd(b))
        assert status == 200, (status, r)
        alone = [(t["token"], t["logprob"]) for t in r["choices"][0]["logprobs"]["content"]]
        free0 = idle_pool_free(c, "encoder-0")
        # a one-image batch runs while a and b queue, so that the next batch holds both
        qx = Background(c, bd(x))
        wait_until(lambda: worker_metric(c, "prism:worker_running", "encoder-0") == 1, 60, "the first batch")
        qa = Background(c, bd(a))
        qb = Background(c, dict(bd(b), cache_salt="again"))   # b's cached prefix would skip the encoder
        status, data = qx.result()
        assert status == 200, (status, data[:300])
        wait_until(lambda: worker_metric(c, "prism:worker_running", "encoder-0") == 2, 60, "the batch of two")
        wait_until(lambda: "holds after layer 1 of a mixed micro-batch" in full_log(c, "encoder-0"), 60,
                   "the tower held inside the mixed micro-batch")
        qa.close()
        status, data = qb.result()
        assert status == 200, (status, data[:300])
        got = [(t["token"], t["logprob"]) for t in json.loads(data)["choices"][0]["logprobs"]["content"]]
        assert [t for t, _ in got] == [t for t, _ in alone], (got, alone)
        assert all(abs(p - q) < 1e-3 for (_, p), (_, q) in zip(got, alone)), (got, alone)
        line = wait_until(lambda: re.search(r"image 0: cancelled [0-9.]+s after its abort arrived, after layer (\d+) "
                                            r"of (\d+) .*: dropped from the batch, 1 image\(s\) go on",
                                            full_log(c, "encoder-0")), 30, "the cancel log line")
        assert int(line[1]) == 1 < int(line[2]), line[0]
        wait_pool_back(c, "encoder-0", free0)


def main():
    global C, GOLD_IMG
    GOLD_IMG = synth_png(GOLD["image_w"], GOLD["image_h"], GOLD["image_seed"])
    rc = 0
    C = Cluster(model=L4, common_worker_args=HB)
    try:
        C.wait_ready()
        rc |= run_tests([test_golden_image_greedy, test_golden_image_stream, test_template_and_tokenizer_through_router,
                         test_image_prompt_length_equals_processor, test_text_and_images_match_prism_generate,
                         test_cache_hit_same_tokens, test_prefix_cache_same_logprobs, test_no_heap_allocations_while_serving,
                         test_malformed_llama4_embeddings_dropped])
    finally:
        C.stop()
    # 64 KV blocks: one 1024-token context, so long answers at once outgrow the decode's pool
    C = Cluster(model=L4, common_worker_args=HB,
                worker_args={"prefill_worker": ["--chunked-prefill-size", "50"],
                             "encoder_worker": ["--max-batch-images", "2", "--max-queued-image-bytes", "1"],
                             "decode_worker": ["--kv-blocks", "64"]})
    try:
        C.wait_ready()
        rc |= run_tests([test_chunked_prefill_and_micro_batches, test_concurrent_distinct_images,
                         test_encoder_queue_bounded_in_bytes, test_preempted_answers_unchanged,
                         test_preempted_by_migration_answers_unchanged])
    finally:
        C.stop()
    rc |= run_tests([test_scout_context_is_capped, test_short_context_unsplit_cache,
                     test_abort_inside_tile_micro_batches, test_bf16_transfer_with_chunked_layers])
    return rc


if __name__ == "__main__":
    sys.exit(main())
