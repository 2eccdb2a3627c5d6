#!/usr/bin/env python3
"""No request lost to a worker that dies before the request's first token (issue 9).

- A hung (SIGSTOP) encoder or prefill worker holding requests: once the router drops it (missed
  heartbeats), every request it held is sent to the other worker of its tier under a new id and
  answered exactly as an undisturbed run answers it; prism:requests_retried_total counts them.
- A stage that overruns --stage-timeout (a worker alive but making no progress) is retried on
  another worker, and answered 504 naming the stage when none is left.
- A worker that dies is dropped as soon as its connection closes, not after --worker-timeout.
- A tier left with no worker at all: requests wait in the router's queue for a restarted worker
  (bounded by --max-queue-wait; test_admission covers the bound) instead of failing at once.
- 100 streams hung up mid-generation free every pool on every tier: the router's requests, the
  decode worker's running set and KV blocks, the prefill worker's slots and receive pool.
- SIGTERM drains a router: no new connections, /ready-style refusals for keep-alive clients, the
  open stream ends complete, then the router exits 0.
- A decode worker SIGKILLed mid-generation: the request goes on from its last token on the other
  decode worker (migration), streaming and not, greedy, seeded, with penalties and guided: the
  answer equals an undisturbed run's token for token (no gap, no repeat) and
  prism:requests_migrated_total counts it; --max-migrations bounds it (then the SSE error event; 0:
  the old 503 / SSE error event). A prefill worker that dies after the first token while its KV is
  still on the way to the decode worker makes the request migrate too.
"""
import socket
import os
import json
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import (Cluster, check_answer, chat_body, distinct_requests, make_image, reference, run_tests,  # noqa: E402
                     wait_for, work_counters, assert_abort_stopped_decode)

TMP = tempfile.mkdtemp(prefix="prism-faults-")
FAST_HB = ["--heartbeat-interval", "0.1"]
ROUTER = ["--worker-timeout", "2"]
_REQS = []


def requests():
    """Four image requests with distinct answers and their references (made once)."""
    if not _REQS:
        _REQS.extend(distinct_requests(TMP, max_tokens=8, text_only=())[:4])
    return _REQS


def post_all(c, bodies):
    """Posts every body at once; returns [(status, json)] in order."""
    out = [None] * len(bodies)

    def one(i):
        out[i] = c.post_json("/v1/chat/completions", bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a request never came back"
    return out


def hung_worker_requests_retried(tier):
    reqs = requests()
    with Cluster(encoders=2 if tier == "encoder" else 1, prefills=2 if tier == "prefill" else 1,
                 router_args=ROUTER, common_worker_args=FAST_HB) as c:
        c.wait_ready()
        before = c.metric("prism:requests_retried_total") or 0
        victim = c.procs[tier + "-0"]
        victim.send_signal(signal.SIGSTOP)  # alive to the kernel, silent to the router
        try:
            results = post_all(c, [body for body, _ in reqs])
        finally:
            c.kill(tier + "-0")
        for (status, r), (_, ref) in zip(results, reqs):
            check_answer(status, r, ref, "after the %s hung" % tier)
        # the router picks the least loaded worker: some requests were sent to the hung one
        assert (c.metric("prism:requests_retried_total") or 0) > before, "no request was retried"
        assert "retried as" in c.log("router", tail=0)


def test_hung_encoder_requests_retried():
    hung_worker_requests_retried("encoder")


def test_hung_prefill_requests_retried():
    hung_worker_requests_retried("prefill")


def test_stage_timeout_retries_then_504():
    """An encoder that is alive to the router (its silence shorter than --worker-timeout) but makes no
    progress: after --stage-timeout the request goes to the other encoder; with no other, 504."""
    reqs = requests()[:2]
    for encoders, retries in ((2, 2), (1, 0)):
        with Cluster(encoders=encoders, router_args=["--worker-timeout", "120", "--stage-timeout", "1",
                                                     "--max-retries", str(retries)], common_worker_args=FAST_HB) as c:
            c.wait_ready()
            c.procs["encoder-0"].send_signal(signal.SIGSTOP)
            try:
                # two different images at once (the same image twice would follow its cache to one
                # encoder): the least-loaded pick sends one of them to the stopped encoder
                results = post_all(c, [b for b, _ in reqs] if encoders == 2 else [reqs[0][0]])
            finally:
                c.kill("encoder-0")
            assert (c.metric("prism:request_stage_timeouts_total") or 0) >= 1
            if encoders == 2:
                for (status, r), (_, ref) in zip(results, reqs):
                    check_answer(status, r, ref, "after the stage timeout")
            else:
                status, r = results[0]
                assert status == 504 and "encode stage" in r["error"]["message"], (status, r)


def test_killed_worker_noticed_at_once():
    """A worker that dies closes its connection: the router drops it at once (not after
    --worker-timeout, 120 s here), /ready says so, and its requests go elsewhere."""
    reqs = requests()
    with Cluster(encoders=2, router_args=["--worker-timeout", "120"], common_worker_args=FAST_HB) as c:
        c.wait_ready()
        t0 = time.time()
        c.kill("encoder-0")
        wait_for(lambda: c.request("GET", "/ready")[1] is not None and
                 json.loads(c.request("GET", "/ready")[2])["encoders"] == 1, 10, "the router to drop encoder-0")
        assert time.time() - t0 < 10
        assert c.metric("prism:workers_disconnected_total") == 1
        for (status, r), (_, ref) in zip(post_all(c, [b for b, _ in reqs]), reqs):
            check_answer(status, r, ref, "after encoder-0 died")
        c.kill("decode-0")
        wait_for(lambda: c.request("GET", "/ready")[0] == 503, 10, "/ready 503 with no decode worker")
        assert c.metric("prism:workers_disconnected_total") == 2


def test_empty_tier_waits_for_restarted_worker():
    body, ref = chat_body("Hello there", max_tokens=8, temperature=0), reference([], "Hello there", 8)
    with Cluster(router_args=ROUTER, common_worker_args=FAST_HB) as c:
        c.wait_ready()
        c.kill("decode-0")
        wait_for(lambda: c.request("GET", "/ready")[0] == 503, 60, "the router to drop the dead decode worker")
        res = {}
        t = threading.Thread(target=lambda: res.update(r=c.post_json("/v1/chat/completions", body)))
        t.start()
        wait_for(lambda: c.metric("prism:router_requests_in_flight") == 1, 60, "the request held by the router")
        assert t.is_alive(), ("answered while no decode worker exists", res)
        c.start_worker("decode-0", "decode_worker")
        t.join(300)
        assert not t.is_alive(), "the waiting request was never served"
        check_answer(*res["r"], ref, "after the decode worker came back")


def test_text_request_not_held_behind_a_missing_encoder():
    """An image request waiting for an encoder (none registered) holds up image requests behind it,
    not text requests: they need no encoder and go ahead; the image request is served when an
    encoder comes back."""
    (ibody, iref), = requests()[:1]
    tbody, tref = chat_body("Hello there", max_tokens=8, temperature=0), reference([], "Hello there", 8)
    with Cluster(router_args=ROUTER, common_worker_args=FAST_HB) as c:
        c.wait_ready()
        c.kill("encoder-0")
        wait_for(lambda: json.loads(c.request("GET", "/ready")[2]).get("encoders") == 0, 60,
                 "the router to drop the dead encoder")
        res = {}
        t = threading.Thread(target=lambda: res.update(r=c.post_json("/v1/chat/completions", ibody)))
        t.start()
        wait_for(lambda: c.metric("prism:router_requests_in_flight") == 1, 60, "the image request held by the router")
        check_answer(*c.post_json("/v1/chat/completions", tbody), tref, "while an image request waits for an encoder")
        assert t.is_alive(), ("the image request was answered while no encoder exists", res)
        c.start_worker("encoder-0", "encoder_worker")
        t.join(300)
        assert not t.is_alive(), "the waiting image request was never served"
        check_answer(*res["r"], iref, "after the encoder came back")


def pool_state(c):
    """What every tier holds, as the router's /metrics reports it (from the workers' heartbeats)."""
    return {"router_requests": c.metric("prism:router_requests_in_flight"),
            "decode_running": c.metric("prism:worker_running", tier="decode"),
            "decode_waiting": c.metric("prism:worker_waiting", tier="decode"),
            "decode_kv_free": c.metric("prism:worker_kv_free_blocks", tier="decode"),
            "prefill_running": c.metric("prism:worker_running", tier="prefill"),
            "prefill_waiting": c.metric("prism:worker_waiting", tier="prefill"),
            "prefill_pool_free": c.metric("prism:worker_pool_free", tier="prefill"),
            "encoder_running": c.metric("prism:worker_running", tier="encoder"),
            "encoder_waiting": c.metric("prism:worker_waiting", tier="encoder")}


def test_hundred_hung_up_streams_free_every_pool():
    n = 100
    jpg = make_image(os.path.join(TMP, "cancel.jpg"), width=320, height=240, shape="circle", color="red")
    with Cluster(common_worker_args=FAST_HB, router_args=["--max-running-requests", "256"]) as c:
        c.wait_ready()
        beats = c.metric("prism:worker_heartbeats_total", tier="decode")
        wait_for(lambda: c.metric("prism:worker_heartbeats_total", tier="decode") > beats + 1, 30, "fresh heartbeats")
        idle = pool_state(c)
        assert idle["router_requests"] == 0 and idle["decode_running"] == 0, idle
        socks = []
        for i in range(n):  # every other request carries an image: encode jobs and embedding slots too
            body = json.dumps(chat_body("Tell me a long story %d" % i, [jpg] if i % 2 else [], max_tokens=1500,
                                        temperature=0, ignore_eos=True, stream=True)).encode()
            s = socket.create_connection(("127.0.0.1", c.port), timeout=30)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            socks.append(s)
        # all held, every tier busy
        wait_for(lambda: c.metric("prism:router_requests_in_flight") == n, 120, "all requests held by the router")
        # (the decode worker reserves each request's KV for its whole max_tokens: about 10 fit; the
        # rest wait on the prefill worker, holding its slots and embedding pool)
        wait_for(lambda: (c.metric("prism:worker_running", tier="decode") or 0) >= 8 and
                 (c.metric("prism:worker_running", tier="prefill") or 0) >= 10, 120, "every tier busy")
        busy = pool_state(c)
        assert busy["decode_kv_free"] < idle["decode_kv_free"], (busy, idle)
        before = work_counters(c)
        for s in socks:  # the clients hang up mid-stream
            s.close()
        wait_for(lambda: c.metric("prism:router_requests_in_flight") == 0, 60, "the router to forget every request")
        # the sequences decode ran were ended, not run out for nobody (1500 tokens each)
        after = assert_abort_stopped_decode(c, before, int(busy["decode_running"]) * 1500, timeout=60)
        assert after["aborted"] - before["aborted"] >= busy["decode_running"], (before, after, busy)
        beats = c.metric("prism:worker_heartbeats_total")
        wait_for(lambda: pool_state(c) == idle and c.metric("prism:worker_heartbeats_total") > beats + 3, 60,
                 "every pool back to its idle value (idle %s, now %s)" % (idle, pool_state(c)))
        # and the cluster still serves
        status, r = c.post_json("/v1/chat/completions", chat_body("Hi", max_tokens=4))
        assert status == 200, (status, r)


def connect_refused(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return False
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        # connected into the backlog just as the router closed its listener: ask again
        return False


def test_router_sigterm_drains_open_stream():
    n = 200
    with Cluster(router_args=["--drain-timeout", "120"]) as c:
        c.wait_ready()
        s = c.open_stream("/v1/chat/completions", chat_body("Hi", max_tokens=n, temperature=0, ignore_eos=True,
                                                              stream=True, stream_options={"include_usage": True}))
        events = []
        while not any(isinstance(e, dict) and e.get("choices") and e["choices"][0]["delta"].get("content")
                      for e in events):
            events.append(s.next_event())
        router = c.procs["router"]
        router.send_signal(signal.SIGTERM)
        wait_for(lambda: connect_refused(c.port), 30, "the router to stop accepting connections")
        assert router.poll() is None, "the router exited with a stream open"
        while True:
            ev = s.next_event()
            if ev is None:
                break
            events.append(ev)
        assert events[-1] == "[DONE]", events[-3:]
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == n, usage
        finish = [e["choices"][0]["finish_reason"] for e in events if isinstance(e, dict) and e.get("choices")]
        assert finish[-1] == "length", finish[-3:]
        assert router.wait(60) == 0, "the router did not exit cleanly after draining"
        assert "drained: every request finished" in c.log("router", tail=0)


def test_router_sigterm_serves_request_begun_before():
    """A request whose first bytes reached the router before its SIGTERM is served, as the requests in
    flight are: the drain keeps its connection open (only idle ones close), and a 503 there is a
    request lost, not one sent elsewhere: nginx does not pass a request on to another router once it
    has sent its body (proxy_request_buffering off; test_rolling.py's one 503 in 1197 fits this).
    Here its body arrives after the signal, as an upload in progress does."""
    with Cluster(router_args=["--drain-timeout", "120"]) as c:
        c.wait_ready()
        body = json.dumps(chat_body("Hi", max_tokens=4, temperature=0)).encode()
        head = ("POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                "Content-Length: %d\r\n\r\n" % (c.port, len(body))).encode()
        sock = socket.create_connection(("127.0.0.1", c.port), timeout=30)
        try:
            sock.sendall(head + body[:10])
            time.sleep(0.3)   # its headers read and parsed: the request has begun
            router = c.procs["router"]
            router.send_signal(signal.SIGTERM)
            wait_for(lambda: connect_refused(c.port), 30, "the router to stop accepting connections")
            assert router.poll() is None, "the router exited with a request begun"
            sock.sendall(body[10:])
            data = b""
            while True:   # the router closes the connection after its answer (draining: no keep-alive)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        finally:
            sock.close()
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None
        assert status == 200, data[:400]
        assert b"connection: close" in data.lower(), data[:400]   # and nothing more on it
        assert router.wait(60) == 0, "the router did not exit cleanly after draining"


# ---- migration: a decode worker that dies mid-generation ----
# Both decode workers hold each reply for 10 ms (test hook): the compute thread runs ahead, so when the
# decode worker is killed the router has seen only part of the answer, whatever the machine's speed.
# --worker-timeout is long: a dead worker is noticed from its connection, and a decode worker whose
# I/O thread is busy sleeping in the hook must not be judged silent.
MIGRATE_ARGS = dict(decodes=2, router_args=["--worker-timeout", "120"], common_worker_args=FAST_HB,
                    worker_args={"decode_worker": ["--log-level", "debug"]},
                    worker_env={"decode_worker": {"PRISM_TEST_DELAY_REPLIES_S": "0.01"}})
DECODES = ("decode-0", "decode-1")


def admitted(c):
    """Requests each live decode worker has admitted so far (its debug log)."""
    return {n: c.log(n, tail=0).count(" admitted:") for n in DECODES if n in c.procs}


def holder(c, before):
    """The decode worker that admitted a request since `before` (one request at a time here)."""
    now = admitted(c)
    new = [n for n in now if now[n] > before.get(n, 0)]
    return new[0] if len(new) == 1 else None


def gen_body(n, stream, **kw):
    body = chat_body("Tell me a long story about a cat", max_tokens=n, temperature=0, ignore_eos=True, logprobs=True,
                     return_tokens_as_token_ids=True, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(kw)
    return body


def ids_of(entries):
    return [int(e["token"].split(":")[1]) for e in entries]


def stream_answer(events):
    """(token ids, text, finish_reason, completion_tokens) of a streamed chat answer."""
    ids, text, finish, usage = [], "", None, None
    for e in events:
        if e.get("usage"):
            usage = e["usage"]["completion_tokens"]
        for ch in e.get("choices", []):
            text += ch["delta"].get("content") or ""
            if ch.get("logprobs"):
                ids += ids_of(ch["logprobs"]["content"])
            finish = ch.get("finish_reason") or finish
    return ids, text, finish, usage


def whole_answer(r):
    ch = r["choices"][0]
    return ids_of(ch["logprobs"]["content"]), ch["message"]["content"], ch["finish_reason"], \
        r["usage"]["completion_tokens"]


def restart_killed(c, name):
    c.start_worker(name, "decode_worker")
    c.wait_ready()


def read_tokens(s, n, events=None):
    """Reads stream events until n tokens in all came (their logprobs entries); returns the events."""
    events = [] if events is None else events
    while sum(len((ch.get("logprobs") or {}).get("content") or []) for e in events for ch in e.get("choices", [])) < n:
        ev = s.next_event()
        assert isinstance(ev, dict), ("the stream ended early", ev, events[-3:])
        events.append(ev)
    return events


def migrated_stream(c, body, after=10):
    """Streams body, SIGKILLs the decode worker holding it once `after` tokens came; returns (events, killed)."""
    before = admitted(c)
    s = c.open_stream("/v1/chat/completions", body)
    events = read_tokens(s, after)
    victim = wait_for(lambda: holder(c, before), 30, "the decode worker holding the stream")
    c.kill(victim)
    while True:
        ev = s.next_event()
        if ev is None:
            break
        events.append(ev)
    assert s.done, ("no [DONE]", events[-3:])
    return [e for e in events if isinstance(e, dict)], victim


def migrated_whole(c, body):
    """Posts body (not streaming), SIGKILLs the decode worker holding it; returns ((status, json), killed)."""
    before = admitted(c)
    res = {}
    t = threading.Thread(target=lambda: res.update(r=c.post_json("/v1/chat/completions", body)))
    t.start()
    victim = wait_for(lambda: holder(c, before), 60, "the decode worker holding the request")
    c.kill(victim)
    t.join(300)
    assert not t.is_alive(), "the request never came back"
    return res["r"], victim


def test_decode_death_migrates():
    n = 150
    with Cluster(**MIGRATE_ARGS) as c:
        c.wait_ready()
        migrations, texts = 0, {}
        cases = [("greedy", {}),
                 ("seeded", {"temperature": 0.8, "seed": 1234}),
                 ("penalties", {"presence_penalty": 1.5, "frequency_penalty": 1.0,
                                "repetition_penalty": 1.2, "logit_bias": {"100": 2.0}})]
        for name, kw in cases:
            # streaming: the reference first, undisturbed, then the same request with its decode worker killed
            status, ref_events, done = c.stream("/v1/chat/completions", gen_body(n, True, **kw))
            assert status == 200 and done, (name, status, ref_events[-1:])
            ref = stream_answer(ref_events)
            assert len(ref[0]) == n and ref[2] == "length" and ref[3] == n, (name, ref[2:])
            texts[name] = ref[1]
            events, victim = migrated_stream(c, gen_body(n, True, **kw), after=50)
            got = stream_answer(events)
            migrations += 1
            assert got[0] == ref[0], "%s stream: token ids differ from the undisturbed run:\n%s\n%s" % (name, got[0],
                                                                                                       ref[0])
            assert got[1:] == ref[1:], (name, got[1:], ref[1:])
            assert c.metric("prism:requests_migrated_total") == migrations
            restart_killed(c, victim)
            # not streaming
            status, r = c.post_json("/v1/chat/completions", gen_body(n, False, **kw))
            assert status == 200, (status, r)
            ref = whole_answer(r)
            (status, r), victim = migrated_whole(c, gen_body(n, False, **kw))
            assert status == 200, (name, status, r)
            migrations += 1
            assert whole_answer(r) == ref, (name, whole_answer(r), ref)
            assert c.metric("prism:requests_migrated_total") == migrations
            restart_killed(c, victim)
        assert "migrated as" in c.log("router", tail=0)
        # a stop string the greedy answer reaches late: the router's holdback goes on across the
        # migration, the answer ends before it as the undisturbed one does
        text = texts["greedy"]
        stop = next(text[i:i + 8] for i in range(len(text) * 3 // 4, len(text) - 8) if text[i:i + 8] not in text[:i])
        body = gen_body(n, True, stop=[stop])
        status, ref_events, done = c.stream("/v1/chat/completions", body)
        ref = stream_answer(ref_events)
        assert status == 200 and done and ref[2] == "stop" and ref[1] == text[:text.index(stop)], (stop, ref[1:])
        events, victim = migrated_stream(c, body, after=50)
        migrations += 1
        assert stream_answer(events) == ref, ("stop string", stream_answer(events), ref)
        assert c.metric("prism:requests_migrated_total") == migrations
        restart_killed(c, victim)
        # an image request: its image bytes were kept, the new prefill gets the image encoded again
        jpg = make_image(os.path.join(TMP, "migrate.jpg"), width=320, height=240, shape="square", color="green")
        body = gen_body(n, True)
        body["messages"] = chat_body("What is in the image?", [jpg])["messages"]
        encoded = c.metric("prism:worker_embedding_cache_misses_total", tier="encoder") + \
            c.metric("prism:worker_embedding_cache_hits_total", tier="encoder")
        status, ref_events, done = c.stream("/v1/chat/completions", body)
        assert status == 200 and done, (status, ref_events[-1:])
        ref = stream_answer(ref_events)
        events, victim = migrated_stream(c, body, after=50)
        got = stream_answer(events)
        migrations += 1
        assert got == ref, ("image", got, ref)
        assert c.metric("prism:requests_migrated_total") == migrations
        # three encodes: the reference, the request, the request again after its migration
        wait_for(lambda: c.metric("prism:worker_embedding_cache_misses_total", tier="encoder") +
                 c.metric("prism:worker_embedding_cache_hits_total", tier="encoder") >= encoded + 3, 10,
                 "the migrated request's image encoded again")
        restart_killed(c, victim)
        # guided output: the new prefill and decode feed the tokens generated before to the grammar (a
        # matcher started afresh would allow another 25 words after the migration)
        body = gen_body(n, True, guided_regex="(cat|dog|bird)( (cat|dog|bird)){25}")
        body.pop("ignore_eos")
        status, ref_events, done = c.stream("/v1/chat/completions", body)
        ref = stream_answer(ref_events)
        assert status == 200 and done and ref[2] == "stop" and len(ref[1].split()) == 26, ref[1:]
        events, victim = migrated_stream(c, body)
        got = stream_answer(events)
        assert got == ref, ("guided", got, ref)
        assert c.metric("prism:requests_migrated_total") == migrations + 1


def test_decode_death_without_migration_fails():
    """--max-migrations 0: as before migration existed, a 503 (or an SSE error event, then [DONE])."""
    args = dict(MIGRATE_ARGS, router_args=["--worker-timeout", "120", "--max-migrations", "0"])
    with Cluster(**args) as c:
        c.wait_ready()
        events, victim = migrated_stream(c, gen_body(200, True))
        err = [e for e in events if e.get("error")]
        assert err and "decode worker serving this request" in err[-1]["error"]["message"], events[-2:]
        restart_killed(c, victim)
        (status, r), _ = migrated_whole(c, gen_body(200, False))
        assert status == 503 and "decode worker" in r["error"]["message"], (status, r)
        assert c.metric("prism:requests_migrated_total") == 0


def test_prefill_death_before_kv_reached_decode_migrates():
    """A prefill worker that dies after the first token but before the decode worker took the KV (it
    has no KV room yet): the decode worker will never get it, so the request migrates too
    (the others the dead prefill worker held are retried, or migrated when their KV was on its way)."""
    # 64 KV blocks of 16 tokens (a 1024-token context): a 950-token request A takes almost all of
    # them, so the streams' KV (9 blocks each) waits for room (--kv-admission reserve: optimistic
    # admission would take them in and preempt instead)
    # (A's decode steps 5 ms apart at least, test hook: A holds its blocks about 5 s whatever this
    # machine's decode speed, so the kill comes while the streams' KV still waits)
    ctx = ["--context-length", "1024"]
    with Cluster(prefills=2, router_args=["--worker-timeout", "120"] + ctx, common_worker_args=FAST_HB,
                 worker_args={"prefill_worker": ctx,
                              "decode_worker": ctx + ["--kv-blocks", "64", "--kv-admission", "reserve"]},
                 worker_env={"decode_worker": {"PRISM_TEST_DECODE_STEP_GAP_S": "0.005"}}) as c:
        c.wait_ready()
        bodies = [chat_body("Tell me about the colour %s" % col, max_tokens=120, temperature=0, ignore_eos=True,
                            logprobs=True, return_tokens_as_token_ids=True, stream=True)
                  for col in ("red", "green", "blue", "yellow")]
        refs = []
        for b in bodies:
            status, ev, done = c.stream("/v1/chat/completions", b)
            assert status == 200 and done
            refs.append(stream_answer(ev))
        res = {}
        long = threading.Thread(target=lambda: res.update(a=c.post_json("/v1/chat/completions", chat_body(
            "Hi", max_tokens=950, temperature=0, ignore_eos=True))))
        long.start()
        # A holds its 60 blocks (fewer than a stream's 9 left free): the running count alone can be the
        # last reference stream's sequence, not yet released, while A is still in a prefill
        wait_for(lambda: c.metric("prism:worker_running", tier="decode") == 1
                 and (c.metric("prism:worker_kv_free_blocks", worker="decode-0") or 64) < 9, 30,
                 "A running on the decode worker")
        got, first = [[] for _ in bodies], [False] * len(bodies)

        def one(i):
            s = c.open_stream("/v1/chat/completions", bodies[i])
            while True:
                ev = s.next_event()
                if ev is None:
                    break
                got[i].append(ev)
                first[i] = True

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
        for t in threads:
            t.start()
        # every stream has its first token (from a prefill worker); their KV waits: one staged in the
        # decode worker, the rest in the sockets between the workers (prefill's send queue included)
        wait_for(lambda: all(first) and c.metric("prism:worker_waiting", tier="decode") == 1, 30,
                 "every stream's first token sent, its KV waiting")
        assert c.metric("prism:worker_running", tier="decode") == 1, "A ended before the kill: no KV was held"
        c.kill("prefill-0")
        for t in threads:
            t.join(300)
        for evs, ref in zip(got, refs):
            assert evs and evs[-1] == "[DONE]", evs[-2:]
            assert stream_answer([e for e in evs if isinstance(e, dict)]) == ref
        assert c.metric("prism:requests_migrated_total") >= 1
        assert "The prefill worker serving this request stopped responding.; migrated" in c.log("router", tail=0)
        long.join(300)
        assert res["a"][0] == 200, res


def test_migrations_are_bounded():
    """--max-migrations 1: the first decode worker lost mid-stream is survived, the second is not
    (an SSE error event, then [DONE])."""
    args = dict(MIGRATE_ARGS, router_args=["--worker-timeout", "120", "--max-migrations", "1"])
    with Cluster(**args) as c:
        c.wait_ready()
        before = admitted(c)
        s = c.open_stream("/v1/chat/completions", gen_body(400, True))
        events = read_tokens(s, 30)
        first = wait_for(lambda: holder(c, before), 30, "the decode worker holding the stream")
        before = admitted(c)
        c.kill(first)
        second = wait_for(lambda: holder(c, before), 30, "the decode worker the stream migrated to")
        assert second != first
        restart_killed(c, first)
        read_tokens(s, 100, events)
        c.kill(second)
        while True:
            ev = s.next_event()
            if ev is None:
                break
            events.append(ev)
        assert events[-1] == "[DONE]", events[-2:]
        err = [e for e in events if isinstance(e, dict) and e.get("error")]
        assert len(err) == 1 and "decode worker serving this request" in err[0]["error"]["message"], err
        ids = stream_answer([e for e in events if isinstance(e, dict)])[0]
        assert 100 <= len(ids) < 400, len(ids)
        assert c.metric("prism:requests_migrated_total") == 1


if __name__ == "__main__":
    sys.exit(run_tests([test_hung_encoder_requests_retried, test_hung_prefill_requests_retried,
               test_stage_timeout_retries_then_504, test_killed_worker_noticed_at_once, test_empty_tier_waits_for_restarted_worker, test_text_request_not_held_behind_a_missing_encoder,
               test_hundred_hung_up_streams_free_every_pool,
               test_router_sigterm_drains_open_stream, test_router_sigterm_serves_request_begun_before,
               test_decode_death_migrates,
               test_decode_death_without_migration_fails, test_migrations_are_bounded,
               test_prefill_death_before_kv_reached_decode_migrates]))
