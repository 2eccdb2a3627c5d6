#!/usr/bin/env python3
"""The decode tier's KV: where the router sends a request, and transfers that go wrong (issue 28).

- Routing by KV room: of two decode workers, one with a small pool that one long request will
  fill and the other with a large pool running more sequences, new requests go to the one with
  room (a pick by sequence count sends them to the small one, which would preempt).
- A first KV piece that arrives while another transfer is arriving and a third waits for blocks
  cannot wait: its request is preempted before admission and answered by a recompute, token for
  token as alone; with n = 2 (no recompute) it is answered 503 with an OpenAI error and every
  other request is still answered.
- A prefill worker SIGKILLed between two pieces of a KV transfer (test hook
  PRISM_TEST_KV_PIECE_GAP_S): the request goes on through the other prefill worker (a migration),
  the decode worker frees the blocks the half transfer held (prism:worker_kv_free_blocks back to
  its idle value) and the next request is served.
- KV on the wire in bf16 (issue 33, --kv-transfer-dtype): a prefill computing in bf16 sends half the
  bytes (prism:worker_kv_sent_bytes_total), the same answer twice; a decode computing in fp32 takes
  bf16 transfers, and an fp32 prefill's f32 transfers go to a decode whose own flag says bf16.
"""
import concurrent.futures
import json
import os
import signal
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import MODEL, Cluster, chat_body, run_tests, wait_for, fresh_heartbeats  # noqa: E402

FAST_HB = ["--heartbeat-interval", "0.1"]


def worker_metric(c, name, worker):
    return c.metric(name, worker=worker)


def long_prompt(tag, words=135):
    """A prompt of several KV pieces (a piece is 256 tokens of the bundled model)."""
    return "Remember this list %s: " % tag + " ".join("w%d" % (i * 7 % 997) for i in range(words))


def tokens_of(r):
    ch = r["choices"]
    return [[e["token"] for e in c["logprobs"]["content"]] for c in ch]


# Decode steps start 5 ms apart at least (test hook PRISM_TEST_DECODE_STEP_GAP_S): a request meant to
# hold the pool while the test looks and stops the worker still runs then, however fast this machine
# decodes (bf16 weight storage and the faster attention once made them end first).
PACED = {"decode_worker": {"PRISM_TEST_DECODE_STEP_GAP_S": "0.005"}}


def gen(text, max_tokens, **kw):
    return chat_body(text, max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=True,
                     return_tokens_as_token_ids=True, **kw)


# ---------------------------------------------------------------- routing by KV room

def kv_view(c):
    """The router's KV accounting per decode worker (GET /status): (expected, sent since heartbeat)."""
    status, _, data = c.request("GET", "/status")
    assert status == 200, status
    return {w["id"]: (w["kv_expected_blocks"], w["kv_sent_blocks"]) for w in json.loads(data)["workers"]
            if w["id"].startswith("decode")}


def prompts_seen(c):
    """Prompt tokens the prefill tier took in (computed or found in its prefix cache)."""
    return sum(c.metric(m, tier="prefill") or 0 for m in ("prism:worker_prompt_tokens_computed_total",
                                                          "prism:worker_prefix_cache_hits_total"))



def test_new_requests_go_where_kv_room_is():
    """decode-0: 48 blocks of 16 tokens, one request there expected to grow to 45 of them; decode-1:
    512 blocks, two such requests (more running). Both are stopped (SIGSTOP: what they run stays
    in flight, nothing finishes under the test's feet) while four more requests are dispatched:
    each goes to decode-1 (by sequence count, decode-0 would take every other one and run out)."""
    ctx = ["--context-length", "768"]   # a sequence must fit the small pool
    with Cluster(decodes=0, router_args=ctx + ["--worker-timeout", "120"], common_worker_args=FAST_HB,
                 worker_args={"prefill_worker": ctx, "decode_worker": ctx}, worker_env=PACED) as c:
        c.start_worker("decode-0", "decode_worker", ["--kv-blocks", "48", "--max-running-requests", "8"])
        c.expected["decodes"] = 1
        c.wait_ready()
        pool = concurrent.futures.ThreadPoolExecutor(8)
        longs = [pool.submit(c.post_json, "/v1/chat/completions", gen("Count for me, one.", 700))]
        wait_for(lambda: worker_metric(c, "prism:worker_running", "decode-0") == 1, 30, "the long one on decode-0")
        c.procs["decode-0"].send_signal(signal.SIGSTOP)
        try:
            c.start_worker("decode-1", "decode_worker", ["--kv-blocks", "512", "--max-running-requests", "8"])
            c.expected["decodes"] = 2
            c.wait_ready()
            for i in range(2):
                longs.append(pool.submit(c.post_json, "/v1/chat/completions", gen("Count for me, %d." % (i + 2), 700)))
                wait_for(lambda: worker_metric(c, "prism:worker_running", "decode-1") == i + 1, 30, "a long one on decode-1")
            c.procs["decode-1"].send_signal(signal.SIGSTOP)
            seen = prompts_seen(c)
            news = [pool.submit(c.post_json, "/v1/chat/completions", gen("Name a colour, %d." % i, 150))
                    for i in range(4)]
            # each prefilled: its decode worker was picked before
            wait_for(lambda: prompts_seen(c) >= seen + 4 * 10, 30, "the four new ones prefilled")
            view = kv_view(c)
            print("expected blocks, sent since the last heartbeat:", view)
            # one 700-token answer on decode-0 (45 blocks of 16); two of them and four of 150 on decode-1
            assert view["decode-0"][0] == 45 and view["decode-1"][0] >= 2 * 45 + 4 * 10, view
        finally:
            c.procs["decode-0"].send_signal(signal.SIGCONT)
            c.procs["decode-1"].send_signal(signal.SIGCONT)
        for f in longs + news:
            s, r = f.result(300)
            assert s == 200, (s, r)
        pool.shutdown()
        done = {w: c.metric("prism:worker_stage_seconds_count", worker=w, stage="decode") for w in ("decode-0", "decode-1")}
        print("requests decoded per worker:", done)
        assert done == {"decode-0": 1, "decode-1": 6}, ("a new request went to the worker without KV room", done)
        fresh_heartbeats(c, "decode-0")
        assert worker_metric(c, "prism:worker_preemptions_total", "decode-0") == 0
        assert kv_view(c) == {"decode-0": (0, 0), "decode-1": (0, 0)}, "the router's KV count was not given back"


# ---------------------------------------------------------------- a first piece bounced

PIECE_GAP_S = 3   # between a transfer's two pieces: longer than sending the prompts takes until SIGCONT


def bounce_round(c, n, n_tokens):
    """Three long prompts (n_tokens in all) are sent to the decode worker while a reserving request
    holds its pool and the worker is stopped (SIGSTOP); that request is aborted and the worker goes
    on with the three first pieces and the abort queued (the second pieces follow PIECE_GAP_S after):
    at least one first piece cannot fit while another transfer arrives. Returns the three results."""
    hold = c.open_stream("/v1/chat/completions", gen("Hold the pool.", 1200, stream=True))
    ev = hold.next_event()
    assert isinstance(ev, dict), ev
    wait_for(lambda: c.metric("prism:worker_running", tier="decode") == 1, 30, "the pool held")
    dec = c.procs["decode-0"]
    dec.send_signal(signal.SIGSTOP)
    try:
        assert c.metric("prism:worker_running", tier="decode") == 1, "the held request ended too soon"
        seen = prompts_seen(c)
        bodies = [gen(long_prompt(tag), 8, n=n) for tag in ("alpha", "beta", "gamma")]
        ex = concurrent.futures.ThreadPoolExecutor(3)
        t_sent = time.monotonic()
        futs = [ex.submit(c.post_json, "/v1/chat/completions", b) for b in bodies]
        # every prompt prefilled: the transfers wait in the sockets between the workers
        wait_for(lambda: prompts_seen(c) >= seen + n_tokens and
                 c.metric("prism:worker_running", tier="prefill") == 0, 60, "the three prompts prefilled")
        hold.close()   # its abort frees the pool once the worker goes on
        time.sleep(0.3)
        assert time.monotonic() - t_sent < PIECE_GAP_S - 0.5, "too slow: the second pieces may be on their way"
    finally:
        dec.send_signal(signal.SIGCONT)
    res = [f.result(300) for f in futs]
    ex.shutdown()
    return res


def test_first_piece_bounced_while_others_arrive():
    """--kv-admission reserve, 80 blocks of 16 tokens: a 1200-token request holds 76; three
    430-token prompts (27 transfer blocks each, in 2 pieces; 28 blocks reserved, 30 with n = 2)
    come from three prefill workers. Each prefill worker pauses 3 s between a transfer's two
    pieces (test hook PRISM_TEST_KV_PIECE_GAP_S, PIECE_GAP_S), so when the decode worker goes on only the first
    pieces and the hold's abort wait for it, in whatever order its sockets give them: the abort
    first, two are admitted and the third cannot fit while they arrive; the abort last, the first
    one in waits for blocks and the others cannot wait. Either way at least one first piece is
    preempted before admission: recomputed (n = 1: every answer as alone), or 503 (n = 2). Without
    the pause the second pieces could come with the first ones: a transfer whole before the next
    first piece leaves nothing arriving, and a piece that does not fit then waits (CI saw it)."""
    ctx = ["--context-length", "1280"]
    env = dict(PACED, prefill_worker={"PRISM_TEST_KV_PIECE_GAP_S": str(PIECE_GAP_S)})
    with Cluster(prefills=3, router_args=ctx, common_worker_args=FAST_HB,
                 worker_args={"prefill_worker": ctx, "decode_worker": ctx + ["--kv-blocks", "80", "--kv-admission", "reserve",
                                                "--max-running-requests", "8"]}, worker_env=env) as c:
        c.wait_ready()
        refs, n_tokens = [], 0
        for tag in ("alpha", "beta", "gamma"):
            s, r = c.post_json("/v1/chat/completions", gen(long_prompt(tag), 8))
            assert s == 200, (s, r)
            print("prompt tokens:", r["usage"]["prompt_tokens"])
            assert 400 < r["usage"]["prompt_tokens"] < 700, r["usage"]   # two pieces, 46 blocks
            refs.append(tokens_of(r)[0])
            n_tokens += r["usage"]["prompt_tokens"]
        fresh_heartbeats(c, "decode-0")
        before = c.metric("prism:worker_preemptions_total", tier="decode")
        assert before == 0
        res = bounce_round(c, 1, n_tokens)
        for (s, r), ref in zip(res, refs):
            assert s == 200, (s, r)
            assert tokens_of(r) == [ref], "a recomputed answer changed"
        fresh_heartbeats(c, "decode-0")
        bounced = c.metric("prism:worker_preemptions_total", tier="decode") - before
        print("preempted before admission:", bounced)
        assert bounced >= 1, "no first piece was bounced: the test did not reach the spot"
        # n = 2: the bounced one cannot be recomputed: 503, an OpenAI error; the others as alone
        res = bounce_round(c, 2, n_tokens)
        statuses = [s for s, _ in res]
        print("n = 2 statuses:", statuses)
        assert statuses.count(503) >= 1, res
        for (s, r), ref in zip(res, refs):
            if s == 503:
                err = r["error"]
                assert set(err) >= {"message", "type", "code"} and "KV" in err["message"], r
                assert "choices" not in r
            else:
                assert s == 200 and tokens_of(r) == [ref, ref], (s, r)
        s, r = c.post_json("/v1/chat/completions", gen("After.", 4))
        assert s == 200, (s, r)
        fresh_heartbeats(c, "decode-0")
        assert c.metric("prism:worker_kv_free_blocks", tier="decode") == 80, "blocks leaked"
        assert c.metric("prism:router_requests_in_flight") == 0


# ---------------------------------------------------------------- prefill death mid-transfer

def test_prefill_death_mid_transfer_frees_decode_blocks():
    """prefill-0 pauses 60 s after each KV piece (test hook): a 430-token prompt's first piece is
    admitted on the decode worker (its blocks taken), then prefill-0 is SIGKILLed. The request goes
    on through prefill-1 (answer as alone), the decode worker's blocks all come back."""
    with Cluster(prefills=1, common_worker_args=FAST_HB, router_args=["--worker-timeout", "120"],
                 worker_env={"prefill_worker": {"PRISM_TEST_KV_PIECE_GAP_S": "60"}}) as c:
        c.wait_ready()
        fresh_heartbeats(c, "decode-0")
        idle = c.metric("prism:worker_kv_free_blocks", tier="decode")
        res = {}
        t = threading.Thread(target=lambda: res.update(a=c.post_json("/v1/chat/completions",
                                                                     gen(long_prompt("delta"), 8))))
        t.start()
        # the first piece admitted: the decode worker holds the request (receiving) and its blocks
        wait_for(lambda: c.metric("prism:worker_running", tier="decode") == 1 and
                 c.metric("prism:worker_kv_free_blocks", tier="decode") < idle, 30, "the first piece admitted")
        del c.worker_env["prefill_worker"]   # the second prefill worker sends whole transfers
        c.start_worker("prefill-1", "prefill_worker")
        c.expected["prefills"] = 2
        c.wait_ready()
        c.kill("prefill-0")
        t.join(300)
        s, r = res["a"]
        assert s == 200, (s, r)
        assert c.metric("prism:requests_migrated_total") == 1, "the request did not go on through prefill-1"
        s2, r2 = c.post_json("/v1/chat/completions", gen(long_prompt("delta"), 8))
        assert s2 == 200 and tokens_of(r2) == tokens_of(r), "the answer after the death differs from one alone"
        fresh_heartbeats(c, "decode-0")
        assert c.metric("prism:worker_kv_free_blocks", tier="decode") == idle, "the half transfer's blocks leaked"
        assert c.metric("prism:worker_running", tier="decode") == 0
        assert c.metric("prism:router_requests_in_flight") == 0


# ---------------------------------------------------------------- KV on the wire in bf16

def block_bytes():
    """One 16-token block of the bundled model's K/V in fp32 (the decode cache's and the f32 wire's)."""
    with open(os.path.join(MODEL, "config.json")) as f:
        tc = json.load(f)["text_config"]
    return tc["num_hidden_layers"] * 2 * 16 * tc["num_key_value_heads"] * tc["head_dim"] * 4


def kv_sent(c, worker):
    """The worker's KV transfer bytes sent so far, from a heartbeat taken after what came before."""
    fresh_heartbeats(c, worker)
    return c.metric("prism:worker_kv_sent_bytes_total", worker=worker)


def replace_worker(c, old, new, kind, args):
    """Drains old (SIGTERM: the routers send it nothing new; it exits once released) and starts new,
    the tier's only worker from then on."""
    p = c.procs.pop(old)
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0, "%s did not drain cleanly" % old
    c.start_worker(new, kind, args)
    c.wait_ready()
    wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker=new), 30, new + " registered")


def test_kv_transfer_in_bf16():
    """Prefill and decode computing in bf16 (--compute-dtype bf16, --kv-transfer-dtype auto): a
    600-token prompt's KV goes in bf16, half the f32 bytes to the byte (38 blocks of 32 KiB, two
    pieces where f32 takes three), the same tokens twice (temperature 0). Then a decode computing in
    fp32 (whose own --kv-transfer-dtype bf16 governs only its migrations) takes that bf16 transfer;
    the same prefill computation sent in f32 (--kv-transfer-dtype f32) moves twice the bytes and
    answers the same tokens, logprobs within bf16's rounding; an fp32 prefill's f32 transfer is
    answered too. No malformed transfer, every block back."""
    with Cluster(prefills=0, decodes=0, common_worker_args=FAST_HB) as c:
        c.start_worker("prefill-0", "prefill_worker", ["--compute-dtype", "bf16"])
        c.start_worker("decode-0", "decode_worker", ["--compute-dtype", "bf16"])
        c.expected.update(prefills=1, decodes=1)
        c.wait_ready()
        body = gen(long_prompt("epsilon", words=190), 8)
        b0 = kv_sent(c, "prefill-0")
        assert b0 == 0, b0
        s, r1 = c.post_json("/v1/chat/completions", body)
        assert s == 200, (s, r1)
        s, r2 = c.post_json("/v1/chat/completions", body)
        assert s == 200, (s, r2)
        assert tokens_of(r1) == tokens_of(r2) and len(tokens_of(r1)[0]) == 8, "a bf16 transfer's answer is not deterministic"
        n_blocks = (r1["usage"]["prompt_tokens"] + 15) // 16
        assert 32 < n_blocks <= 64, n_blocks   # two bf16 pieces (32 blocks each), three f32 ones
        bf16 = kv_sent(c, "prefill-0") - b0
        print("bf16: %d bytes for 2 transfers of %d blocks" % (bf16, n_blocks))
        assert bf16 == 2 * n_blocks * block_bytes() // 2, (bf16, n_blocks)
        assert "KV transfers go out in bf16" in c.log("prefill-0", tail=0)
        # a bf16 sender to a decode computing in fp32
        replace_worker(c, "decode-0", "decode-1", "decode_worker", ["--kv-transfer-dtype", "bf16"])
        s, via_bf16 = c.post_json("/v1/chat/completions", body)
        assert s == 200 and len(tokens_of(via_bf16)[0]) == 8, (s, via_bf16)
        assert kv_sent(c, "prefill-0") - b0 == 3 * n_blocks * block_bytes() // 2
        # the same prefill computation sending f32 (an explicit flag over auto): twice the bytes, and
        # the answer the bf16 transfer gave within bf16's rounding (a wrongly widened KV is noise)
        replace_worker(c, "prefill-0", "prefill-1", "prefill_worker", ["--compute-dtype", "bf16",
                                                                       "--kv-transfer-dtype", "f32"])
        s, via_f32 = c.post_json("/v1/chat/completions", body)
        assert s == 200, (s, via_f32)
        f32 = kv_sent(c, "prefill-1")
        print("f32: %d bytes for 1 transfer" % f32)
        assert f32 == n_blocks * block_bytes() == bf16, (f32, bf16)
        lp = [[e["logprob"] for e in r["choices"][0]["logprobs"]["content"]] for r in (via_bf16, via_f32)]
        print("logprobs via bf16 / f32:", lp)
        assert tokens_of(via_bf16) == tokens_of(via_f32), (tokens_of(via_bf16), tokens_of(via_f32))
        assert max(abs(a - b) for a, b in zip(*lp)) < 0.02, lp   # seen: 3e-3
        # an fp32 prefill (auto: f32) to that decode
        replace_worker(c, "prefill-1", "prefill-2", "prefill_worker", [])
        s, r = c.post_json("/v1/chat/completions", body)
        assert s == 200 and len(tokens_of(r)[0]) == 8, (s, r)
        assert kv_sent(c, "prefill-2") == f32
        assert "KV transfers go out in bf16" not in c.log("prefill-1", tail=0) + c.log("prefill-2", tail=0)
        fresh_heartbeats(c, "decode-1")
        assert "malformed" not in c.log("decode-1", tail=0)
        assert c.metric("prism:worker_running", worker="decode-1") == 0
        assert c.metric("prism:worker_kv_free_blocks", worker="decode-1") == 1024, "blocks leaked"
        assert c.metric("prism:router_requests_in_flight") == 0


if __name__ == "__main__":
    sys.exit(run_tests([test_new_requests_go_where_kv_room_is, test_first_piece_bounced_while_others_arrive,
                        test_prefill_death_mid_transfer_frees_decode_blocks, test_kv_transfer_in_bf16]))
