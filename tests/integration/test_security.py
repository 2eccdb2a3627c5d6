"""Security of the internal links, against real processes: an intruder without the cluster's keys (no CURVE,
another cluster's keys, a stranger who knows our public keys, or a cluster key of a role no socket admits)
cannot register, inject Tokens, push embeddings, KV, Prefill or Abort messages; an oversized frame does not
make a process allocate it. A peer inside the boundary (holding a cluster key) cannot alias a live worker's id,
register under another role, write into a request it does not hold or aim at a request id; decode checks what
prefill forwards and remembers aborts that come before the KV.

Run: python3 tests/integration/test_security.py   (PRISM_BINARY_DIR=build dir)
"""
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import (MODEL, Cluster, binary, chat_body, free_port, make_image, make_keys, run_tests,  # noqa: E402
                     run_tool, wait_for)

TMP = tempfile.mkdtemp(prefix="prism-sec-")
PF_PORT, DC_PORT = free_port(), free_port()
DATA = {"prefill_worker": ["--data-port", str(PF_PORT), "--log-level", "debug"],
        "decode_worker": ["--data-port", str(DC_PORT), "--log-level", "debug"]}
# debug log: the tests that play a cluster worker read a running request's id from the router's log
# the parse bound given, not derived from the budget (less under ASan): /tokenize bodies of a few MB
# the decode worker's steps start 4 ms apart at least (test hook): a stream's length no longer
# depends on how fast this machine decodes
C = Cluster(encoders=1, worker_args=DATA, router_args=["--log-level", "debug", "--max-parse-bytes", "8M"],
            worker_env={"decode_worker": {"PRISM_TEST_DECODE_STEP_GAP_S": "0.004"}})
PROMPT = {"model": "prism-tiny-llava", "prompt": "A red circle on a white", "temperature": 0, "ignore_eos": True}
# a stream long enough to outlast the intruder probe (its --wait 1.5 s and start-up): at least 2.8 s
# in a release build (700 steps 4 ms apart; 1900 tokens unpaced took 1.6 s until bf16 weight storage
# made the decode faster, and then less than the probe); the sanitizer build decodes ~40x slower, so
# 240 tokens take ~8 s there (600 took tens of seconds, eight times over: the streams were most of
# this test's CI time). Too short a stream fails the tests (t_end > t_probe), it cannot pass unnoticed.
MAX_TOKENS = 240 if os.environ.get("ASAN_OPTIONS") else 700
INJECTED = 7  # token id the intruder tries to slip into answers


def metrics():
    status, _, data = C.request("GET", "/metrics")
    assert status == 200, status
    out = {}
    for line in data.decode().splitlines():
        m = re.match(r'^(prism:\w*peer_auth_failures_total)(\{[^}]*\})? ([0-9.e+]+)$', line)
        if m:
            w = re.search(r'worker="([^"]*)"', m.group(2) or "")
            out[w.group(1) if w else "router"] = float(m.group(3))
    return out


def ready_counts():
    status, _, data = C.request("GET", "/ready")
    return json.loads(data)


def reference_text():
    status, r = C.post_json("/v1/completions", dict(PROMPT, max_tokens=MAX_TOKENS))
    assert status == 200, (status, r)
    assert r["usage"]["completion_tokens"] == MAX_TOKENS, r["usage"]
    return r["choices"][0]["text"]


try:
    C.wait_ready()
    REF = reference_text()
except BaseException:
    C.stop()
    raise


def stream_in_background():
    """Starts a long greedy stream; returns (thread, result dict, event set at the first chunk)."""
    first, res = threading.Event(), {}

    def run():
        h = http.client.HTTPConnection("127.0.0.1", C.port, timeout=120)
        body = dict(PROMPT, max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True})
        h.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = h.getresponse()
        res["status"] = r.status
        buf, text, usage, finish = b"", "", None, None
        while True:
            chunk = r.read1(65536)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                payload = ev[6:]
                if payload == b"[DONE]":
                    continue
                d = json.loads(payload)
                if "error" in d:
                    res["error"] = d["error"]
                    continue
                if d.get("usage"):
                    usage = d["usage"]
                for ch in d.get("choices", []):
                    text += ch.get("text") or ""
                    finish = ch.get("finish_reason") or finish
                first.set()
        h.close()
        res.update(text=text, usage=usage, finish=finish, t_end=time.time())
        first.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, res, first


def router_id():
    return "router-%s-%d-%d" % (socket.gethostname()[:63], C.procs["router"].pid, C.port)


def probe(keys, role, targets=("router", "prefill", "decode"), wait=1.5, worker_id="intruder", rids=(1, 64),
          extra=()):
    args = [binary("prism_peer_probe"), "--role", role, "--router-id", router_id(), "--token", str(INJECTED),
            "--first-rid", str(rids[0]), "--last-rid", str(rids[1]), "--wait", str(wait), "--worker-id", worker_id,
            "--embedding-bytes", str(64 * 256 * 4), *extra]
    if keys:
        args += ["--curve-keys", keys]
    if "router" in targets:
        args += ["--router", C.ctl]
    if "prefill" in targets:
        args += ["--prefill-data", "tcp://127.0.0.1:%d" % PF_PORT]
    if "decode" in targets:
        args += ["--decode-data", "tcp://127.0.0.1:%d" % DC_PORT]
    p = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, (p.returncode, p.stderr)
    return dict(line.split(": ", 1) for line in p.stdout.strip().splitlines()), time.time()


def wait_counters_above(before, names, timeout=15):
    deadline = time.time() + timeout
    while time.time() < deadline:
        now = metrics()
        if all(now.get(n, 0) > before.get(n, 0) for n in names):
            return now
        time.sleep(0.2)
    raise AssertionError("refusals not counted: before %s, now %s" % (before, metrics()))


def stranger_keys():
    """A stranger's directory: its own keys, but our public keys (they are no secret)."""
    d = make_keys(os.path.join(TMP, "stranger"))
    for role in ("router", "prefill", "decode"):
        shutil.copy(os.path.join(C.keys, role + ".pub"), os.path.join(d, role + ".pub"))
    return d


def attack_refused(keys, role, extra=None):
    before = metrics()
    t, res, first = stream_in_background()
    assert first.wait(60), "the stream never started"
    out, t_probe = probe(keys, role)
    if extra:
        extra()
    t.join(600)
    assert not t.is_alive(), "the stream did not finish"
    # every link refused at the handshake, registration never answered
    assert out == {"router": "handshake refused", "register": "no answer", "prefill-data": "handshake refused",
                   "decode-data": "handshake refused"}, out
    # the attack overlapped the stream, and the stream is exactly what it is without an intruder
    assert res["t_end"] > t_probe, "the stream ended before the intruder was done; make MAX_TOKENS larger"
    assert res["status"] == 200 and "error" not in res, res
    assert res["text"] == REF, "the answer changed under attack"
    assert res["usage"]["completion_tokens"] == MAX_TOKENS and res["finish"] == "length", res
    r = ready_counts()
    assert (r["encoders"], r["prefills"], r["decodes"]) == (1, 1, 1), r
    # each target counted the refusal (so the attempts did reach it)
    wait_counters_above(before, ["router", "prefill-0", "decode-0"])


def null_greeting(port):
    """A whole ZMTP 3.0 greeting naming the NULL mechanism, sent in one write, then read to EOF.
    libzmq's own NULL client may close as soon as it reads the server's greeting, before flushing
    the rest of its own; the server then sees a handshake cut short (not counted: it looks like a
    health probe). Sending the whole greeting makes the server always reach its mechanism check."""
    g = b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
    assert len(g) == 64
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(g)
        while s.recv(4096):
            pass


def test_no_curve_refused():
    attack_refused(None, "encoder", extra=lambda: [null_greeting(p) for p in
                                                   (int(C.ctl.rsplit(":", 1)[1]), PF_PORT, DC_PORT)])


def test_other_cluster_keys_refused():
    attack_refused(make_keys(os.path.join(TMP, "other-cluster")), "encoder")


def test_stranger_knowing_public_keys_refused():
    attack_refused(stranger_keys(), "encoder")


def test_cluster_key_of_wrong_role_refused():
    # the router's own key: no socket admits a router as a peer
    attack_refused(C.keys, "router")


def test_wrong_role_per_data_socket():
    # cluster keys, but of the role the data socket does not expect: decode -> prefill data, encoder -> decode data
    before = metrics()
    out, _ = probe(C.keys, "decode", targets=("prefill",), wait=1.0)
    assert out == {"prefill-data": "handshake refused"}, out
    out, _ = probe(C.keys, "encoder", targets=("decode",), wait=1.0)
    assert out == {"decode-data": "handshake refused"}, out
    wait_counters_above(before, ["prefill-0", "decode-0"])
    # the control: a decode key is admitted at decode data (preemption by migration moves KV between
    # decode workers), as a prefill key is; it sends nothing here
    out, _ = probe(C.keys, "decode", targets=("decode",), wait=1.0, rids=(1, 0))
    assert out == {"decode-data": "handshake ok"}, out


def control_refused():
    return C.metric("prism:router_control_messages_refused_total")


def running_rid():
    """The id of the request the router dispatched last (its debug log line)."""
    ids = re.findall(r"request (\d+): \d+ prompt tokens", C.log("router", tail=0))
    assert ids, C.log("router")
    return int(ids[-1])


def inside_attack(role, worker_id, expect_register, extra=()):
    """A peer holding a cluster key (inside the CURVE boundary) registers and sends Tokens for the request
    that is streaming; the stream must be exactly what it is without it."""
    refused0 = control_refused()
    t, res, first = stream_in_background()
    assert first.wait(60), "the stream never started"
    rid = running_rid()
    rid = rid - (1 << 64) if rid >= 1 << 63 else rid  # the probe's flags are int64; it sends the same 64 bits
    out, t_probe = probe(C.keys, role, targets=("router",), worker_id=worker_id, rids=(rid, rid), extra=extra)
    t.join(600)
    assert not t.is_alive(), "the stream did not finish"
    assert out == {"router": "handshake ok", "register": expect_register}, out
    assert res["t_end"] > t_probe, "the stream ended before the intruder was done; make MAX_TOKENS larger"
    assert res["status"] == 200 and "error" not in res, res
    assert res["text"] == REF, "the answer changed: the intruder's tokens were taken"
    assert res["usage"]["completion_tokens"] == MAX_TOKENS and res["finish"] == "length", res
    assert control_refused() > refused0


def test_tokens_only_from_the_worker_holding_the_request():
    # finding 2: a registered worker that does not hold the request cannot write into its answer,
    # neither as its decode nor as its prefill's first token
    inside_attack("decode", "intruder", "acked")
    inside_attack("prefill", "intruder-pf", "acked", extra=["--from-prefill", "--register-as", "prefill"])


def test_nul_identity_cannot_alias_a_worker():
    # finding 3: identity "decode-0\0x" used to be cut to "decode-0" and took over the live worker's record
    inside_attack("decode", "decode-0", "refused", extra=["--identity-nul-suffix", "x"])


def test_key_of_another_role_cannot_register_it():
    # an encoder key registering a decode worker is refused (the key says the role)
    out, _ = probe(C.keys, "encoder", targets=("router",), worker_id="enc-as-decode", wait=1.0)
    assert out == {"router": "handshake ok", "register": "refused"}, out


def test_registration_fields_checked():
    # a data endpoint is handed to other workers: one longer than the router keeps was cut short into
    # another endpoint, and a non-tcp one (ipc://) pointed them at local files
    for ep in ("tcp://127.0.0.1:1" + "1" * 300, "ipc:///tmp/prism-evil"):
        out, _ = probe(C.keys, "decode", targets=("router",), worker_id="bad-endpoint", wait=1.0,
                       extra=["--data-endpoint", ep])
        assert out == {"router": "handshake ok", "register": "refused"}, (ep[:40], out)


def test_request_ids_unguessable():
    # request ids are 128 bits from the kernel's CSPRNG, not a counter a peer can walk
    ids = []
    for _ in range(3):
        status, r = C.post_json("/v1/completions", dict(PROMPT, max_tokens=2))
        assert status == 200, (status, r)
        ids.append(running_rid())
    assert len(set(ids)) == 3, ids
    assert all(abs(a - b) > 1 << 20 for a, b in zip(ids, ids[1:])), ids
    assert max(ids) > 1 << 40, ids
    # and 64 more random bits each, which every message about the request must carry too
    his = [int(h, 16) for h in re.findall(r"prompt tokens.*id high half ([0-9a-f]+)", C.log("router", tail=0))[-3:]]
    assert len(set(his)) == 3 and max(his) > 1 << 40, his


def test_embeddings_need_the_whole_request_id():
    # request ids are 128 random bits and a data message must name both halves: embeddings that name a
    # request a prefill holds by the low half alone (a guess, or an id read from a log) touch nothing of
    # it. Before, the low 64 bits were the whole id: such embeddings became the request's image.
    with open(os.path.join(MODEL, "config.json")) as f:
        cfg = json.load(f)
    img = make_image(os.path.join(TMP, "halves.png"), width=48, height=40, shape="circle")
    body = chat_body("What is this?", [img], max_tokens=8, temperature=0, ignore_eos=True)
    status, ref = C.post_json("/v1/chat/completions", body)
    assert status == 200, (status, ref)
    enc = C.procs["encoder-0"]
    log0 = len(C.log("router", tail=0))
    plog0 = len(C.log("prefill-0", tail=0))
    enc.send_signal(signal.SIGSTOP)   # the request waits at the prefill for its image (briefly: heartbeats)
    try:
        res = {}
        t = threading.Thread(target=lambda: res.update(r=C.post_json("/v1/chat/completions", body, timeout=120)))
        t.start()
        m = wait_for(lambda: re.search(r"request (\d+): \d+ prompt tokens", C.log("router", tail=0)[log0:]), 20,
                     "dispatch")
        rid = int(m.group(1))
        run_tool([binary("prism_wire"), "--endpoint", "tcp://127.0.0.1:%d" % PF_PORT,
                  "--request-id", str(rid - (1 << 64) if rid >= 1 << 63 else rid), "--request-id-hi", "1",
                  "--router-id", router_id(), "--n-tokens", str(cfg["image_seq_length"]),
                  "--hidden", str(cfg["text_config"]["hidden_size"]), "--curve-keys", C.keys], timeout=30)
        wait_for(lambda: "embeddings with the wrong high half of its id dropped" in C.log("prefill-0", tail=0)[plog0:],
                 20, "the prefill dropping the embeddings")
    finally:
        enc.send_signal(signal.SIGCONT)
    t.join(120)
    status, r = res["r"]
    assert status == 200, (status, r)
    assert r["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"], (r, ref)


def test_decode_checks_kv_sampling():
    # finding 4: Kv.sampling.max_tokens was trusted; 0xFFFFFFFF overflowed the block reservation (a sequence
    # writing KV through blocks it never got, decoding to the context end for nobody), 0x80000000 made it
    # negative. Decode now checks every Sampling field against its model and context.
    with open(os.path.join(MODEL, "config.json")) as f:
        tc = json.load(f)["text_config"]
    block_bytes = tc["num_hidden_layers"] * 2 * 16 * tc["num_key_value_heads"] * tc["head_dim"] * 4
    log0 = len(C.log("decode-0", tail=0))
    for max_tokens in ("-1", str(1 << 31)):
        run_tool([binary("prism_wire"), "--endpoint", "tcp://127.0.0.1:%d" % DC_PORT, "--type", "kv",
                  "--curve-keys", C.keys, "--n-tokens", "16", "--block-size", "16", "--block-bytes", str(block_bytes),
                  "--max-tokens", max_tokens, "--router-id", "no-such-router"], timeout=30)
    wait_for(lambda: C.log("decode-0", tail=0)[log0:].count("dropped (max_tokens exceeds the context length)") == 2,
             20, "decode refusing both KV transfers")
    # nothing runs for them, and the decode worker still serves
    status, r = C.post_json("/v1/completions", dict(PROMPT, max_tokens=4))
    assert status == 200, (status, r)
    hb = C.metric("prism:worker_heartbeats_total", worker="decode-0")
    wait_for(lambda: C.metric("prism:worker_heartbeats_total", worker="decode-0") > hb + 1, 20, "decode heartbeats")
    assert C.metric("prism:worker_running", worker="decode-0") == 0


def test_decode_checks_kv_wire_dtype():
    # issue 33: Kv.wire_dtype says what a transfer's frames hold (f32, or bf16 at half the bytes; block
    # sizes are the wire's). A first piece claiming bf16 with f32-sized blocks, f32 with bf16-sized ones,
    # or an unknown type (with either size) is refused as malformed: nothing admitted, no block held, the
    # worker up. A well-formed bf16 one (made up, for a router that does not exist) decodes and ends.
    with open(os.path.join(MODEL, "config.json")) as f:
        tc = json.load(f)["text_config"]
    bb = tc["num_hidden_layers"] * 2 * 16 * tc["num_key_value_heads"] * tc["head_dim"] * 4
    hb = C.metric("prism:worker_heartbeats_total", worker="decode-0")
    wait_for(lambda: C.metric("prism:worker_heartbeats_total", worker="decode-0") > hb + 1, 20, "decode heartbeats")
    free0 = C.metric("prism:worker_kv_free_blocks", worker="decode-0")
    log0 = len(C.log("decode-0", tail=0))

    def send(rid, dtype, block_bytes, max_tokens=16):
        run_tool([binary("prism_wire"), "--endpoint", "tcp://127.0.0.1:%d" % DC_PORT, "--type", "kv",
                  "--curve-keys", C.keys, "--n-tokens", "16", "--block-size", "16", "--block-bytes", str(block_bytes),
                  "--kv-dtype", str(dtype), "--max-tokens", str(max_tokens), "--request-id", str(rid),
                  "--router-id", "no-such-router"], timeout=30)

    for rid, dtype, size in ((7301, 1, bb), (7302, 0, bb // 2), (7303, 7, bb // 2), (7304, 7, bb), (7305, -1, bb)):
        send(rid, dtype, size)
    wait_for(lambda: C.log("decode-0", tail=0)[log0:].count("malformed KV transfer dropped") == 5, 20,
             "decode refusing the five transfers")
    assert C.log("decode-0", tail=0)[log0:].count("dropped (unknown wire dtype)") == 3
    tokens0 = C.metric("prism:worker_tokens_generated_total", worker="decode-0")
    send(7306, 1, bb // 2, max_tokens=4)
    # 3 tokens: the first is the sender's
    wait_for(lambda: C.metric("prism:worker_tokens_generated_total", worker="decode-0") >= tokens0 + 3, 20,
             "the bf16 transfer decoded")
    status, r = C.post_json("/v1/completions", dict(PROMPT, max_tokens=4))
    assert status == 200, (status, r)
    assert C.log("decode-0", tail=0)[log0:].count("malformed KV transfer") == 5, "the bf16 transfer was refused"
    wait_for(lambda: (C.metric("prism:worker_running", worker="decode-0"),
                      C.metric("prism:worker_kv_free_blocks", worker="decode-0")) == (0, free0), 20,
             "nothing running, no block held (a leak stays)")


def test_decode_told_to_stop_made_up_kv():
    # a peer holding a prefill key pushes KV for a made-up request naming our router: decode cannot know
    # it was never dispatched, but its first Tokens reach a router that holds no such request, which
    # tells it to stop. Before, the sequence decoded to its max_tokens for nobody.
    with open(os.path.join(MODEL, "config.json")) as f:
        tc = json.load(f)["text_config"]
    block_bytes = tc["num_hidden_layers"] * 2 * 16 * tc["num_key_value_heads"] * tc["head_dim"] * 4
    junk = 0x5EC0DE
    log0 = len(C.log("decode-0", tail=0))
    run_tool([binary("prism_wire"), "--endpoint", "tcp://127.0.0.1:%d" % DC_PORT, "--type", "kv",
              "--curve-keys", C.keys, "--n-tokens", "16", "--block-size", "16", "--block-bytes", str(block_bytes),
              "--max-tokens", str(tc["max_position_embeddings"] - 32), "--request-id", str(junk),
              "--router-id", router_id()], timeout=30)
    wait_for(lambda: "request %d aborted" % junk in C.log("decode-0", tail=0)[log0:], 20,
             "decode stopping the made-up sequence")
    hb = C.metric("prism:worker_heartbeats_total", worker="decode-0")
    wait_for(lambda: C.metric("prism:worker_heartbeats_total", worker="decode-0") > hb + 1, 20, "decode heartbeats")
    assert C.metric("prism:worker_running", worker="decode-0") == 0


def test_abort_before_kv_is_remembered():
    # finding 7: a client that hangs up while its prompt is in prefill makes the router abort decode before
    # the KV gets there; decode used to admit the KV later and decode to max_tokens for nobody
    prompt = [10 + i % 500 for i in range(1000)]
    body = json.dumps({"model": "prism-tiny-llava", "prompt": prompt, "max_tokens": 100, "ignore_eos": True,
                       "temperature": 0}).encode()
    plog0, dlog0 = len(C.log("prefill-0", tail=0)), len(C.log("decode-0", tail=0))
    s = socket.create_connection(("127.0.0.1", C.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % len(body) + body)
    # hang up once prefill is computing (an abort that reaches prefill before that drops the request there)
    m = wait_for(lambda: re.search(r"request (\d+): prefill of 1000 tokens started", C.log("prefill-0", tail=0)[plog0:]),
                 60, "prefill started")
    s.close()
    rid = int(m.group(1))
    # Two outcomes are right: prefill sees the abort between two layers and stops (no KV ever leaves),
    # or the prompt ends first and the KV goes out after decode heard the abort: decode must drop it.
    cancelled = "request %d: cancelled" % rid
    admitted = re.compile(r"request %d choice \d+ admitted" % rid)   # decode's debug line, one per choice
    wait_for(lambda: cancelled in C.log("prefill-0", tail=0)[plog0:] or
             ("request %d: KV dropped" % rid) in C.log("decode-0", tail=0)[dlog0:] or
             admitted.search(C.log("decode-0", tail=0)[dlog0:]), 300, "prefill or decode to drop it")
    assert not admitted.search(C.log("decode-0", tail=0)[dlog0:]), "decode ran an aborted request for nobody"


def test_cache_hits_not_shown_to_clients():
    # finding 16: x-prism-timing told any client whether someone else had sent the same image (cache_hits=1,
    # image_decode_ms=0); it is an operator's header now (--timing-header), and the cache key is keyed by a
    # cluster secret. The cache still works: the second request is a hit, seen in the metrics only.
    img = make_image(os.path.join(TMP, "hit16.png"), width=48, height=40, shape="triangle")
    body = chat_body("What is this?", [img], max_tokens=2, temperature=0)
    hits0 = C.metric("prism:worker_embedding_cache_hits_total", worker="encoder-0") or 0
    for _ in range(2):
        status, headers, data = C.request("POST", "/v1/chat/completions", json.dumps(body).encode(),
                                          headers={"Content-Type": "application/json"})
        assert status == 200, (status, data[:300])
        low = {k.lower(): v for k, v in headers.items()}
        assert "x-prism-timing" not in low, low
        assert "cache" not in json.dumps(low).lower(), low
    wait_for(lambda: (C.metric("prism:worker_embedding_cache_hits_total", worker="encoder-0") or 0) > hits0, 20,
             "the second image counted as a cache hit (metrics)")


def fake_decode_answers(right_high_half, request_timeout):
    """A fake decode (the only one, so it holds the request) sends Tokens with a token id outside the
    vocabulary, naming the request by its low half and the right or a wrong high half. Returns the
    answer, the seconds from its Tokens to the answer, and the router's log."""
    with Cluster(encoders=0, prefills=1, decodes=0,
                 router_args=["--log-level", "debug", "--worker-timeout", "60",
                              "--request-timeout", str(request_timeout)]) as c:
        rid_file = os.path.join(TMP, "fake-decode-%d.rid" % right_high_half)
        fake = subprocess.Popen([binary("prism_peer_probe"), "--role", "decode", "--register-as", "decode",
                                 "--worker-id", "fake-decode", "--router", c.ctl, "--curve-keys", c.keys, "--wait", "90",
                                 "--token", "999999", "--first-rid", "1", "--last-rid", "0", "--rid-file", rid_file,
                                 "--kv-blocks", "4096"],  # the only decode: it must look able to hold the request
                                stdout=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: ready_of(c).get("prefills") == 1 and ready_of(c).get("decodes") == 1, 60,
                     "prefill and the fake decode registered")
            res = {}
            t = threading.Thread(target=lambda: res.update(r=c.post_json("/v1/completions", dict(PROMPT, max_tokens=8),
                                                                           timeout=120)))
            t.start()
            m = wait_for(lambda: re.search(r"request (\d+): \d+ prompt tokens.*id high half ([0-9a-f]+)",
                                           c.log("router", tail=0)), 30, "dispatch")
            rid, hi = int(m.group(1)), m.group(2)
            if not right_high_half:
                hi = "%016x" % (int(hi, 16) ^ 1)
            t0 = time.time()
            with open(rid_file + ".tmp", "w") as f:
                f.write("%d %s" % (rid - (1 << 64) if rid >= 1 << 63 else rid, hi))
            os.rename(rid_file + ".tmp", rid_file)
            t.join(120)
        finally:
            fake.kill()
            fake.wait()
        return res["r"], time.time() - t0, c.log("router", tail=0)


def test_router_checks_tokens_from_the_holding_decode():
    # every field of a Tokens message is checked, even from the worker that holds the request: a token id
    # outside the vocabulary fails the request (500) at once instead of being streamed or waited out
    (status, body), took, _ = fake_decode_answers(True, 60)
    assert status == 500 and "malformed" in body["error"]["message"], (status, body)
    assert took < 30, "the request waited for its timeout"


def test_tokens_need_the_whole_request_id():
    # the same Tokens naming the request by its low half and a wrong high half: not the request's at all
    # (dropped and counted); the request is left to its own end (here its timeout), not failed by them
    (status, body), took, log = fake_decode_answers(False, 6)
    assert "Tokens from decode worker fake-decode with the wrong high half of its id: dropped" in log, log[-2000:]
    assert status == 503 and "timed out" in body["error"]["message"], (status, body)


def test_junk_embeddings_cannot_fill_the_pool():
    # finding 5: embeddings for made-up request ids (a peer holding an encoder key) took every slot of the
    # prefill's pool until --orphan-timeout, locking every image request out. Orphans may hold half the pool;
    # past that the oldest makes room.
    with open(os.path.join(MODEL, "config.json")) as f:
        cfg = json.load(f)
    img = make_image(os.path.join(TMP, "pool5.png"), width=40, height=40, shape="circle")
    body = chat_body("What is this?", [img], max_tokens=2, temperature=0)
    with Cluster(common_worker_args=["--heartbeat-interval", "0.1"],
                 worker_args={"prefill_worker": ["--embed-pool-images", "2", "--orphan-timeout", "600"]}) as c:
        c.wait_ready()
        endpoint = re.search(r"data (tcp://[^,\s]+)", c.wait_log("prefill-0", "ready in")).group(1)
        for rid in (101, 102, 103):
            run_tool([binary("prism_wire"), "--endpoint", endpoint, "--request-id", str(rid), "--router-id", "junk",
                      "--n-tokens", str(cfg["image_seq_length"]), "--hidden", str(cfg["text_config"]["hidden_size"]),
                      "--curve-keys", c.keys], timeout=30)
        wait_for(lambda: c.metric("prism:worker_pool_free", tier="prefill") == 0, 20, "junk in the pool")
        try:
            status, r = c.post_json("/v1/chat/completions", body, timeout=30)
        except OSError as e:
            raise AssertionError("the image request never completed: junk held the embedding pool (%r)" % e)
        assert status == 200, (status, r)


def ready_of(c):
    try:
        return json.loads(c.request("GET", "/ready")[2])
    except OSError:
        return {}


def test_encoder_freed_when_its_prefill_dies():
    # finding 9: an encoder whose embeddings wait for a prefill that died (backpressure) was wedged for
    # good: aborts freed only queued jobs. A prefill that takes nothing: the probe registered as one, with
    # a data endpoint nobody listens on; then it goes away and a real prefill comes.
    img = make_image(os.path.join(TMP, "enc9.png"), width=64, height=64, shape="circle")
    body = chat_body("What is this?", [img], max_tokens=2, temperature=0)
    with Cluster(encoders=1, prefills=0, decodes=1, router_args=["--worker-timeout", "2"],
                 worker_args={"encoder_worker": ["--max-queued-images", "2", "--max-batch-images", "1"]}) as c:
        wait_for(lambda: ready_of(c).get("encoders") == 1 and ready_of(c).get("decodes") == 1, 60,
                 "encoder and decode registered")
        args = [binary("prism_peer_probe"), "--role", "prefill", "--register-as", "prefill", "--worker-id",
                "dead-prefill", "--router", c.ctl, "--curve-keys", c.keys, "--wait", "4", "--first-rid", "1",
                "--last-rid", "0", "--rid-file", os.path.join(TMP, "never")]  # stays registered 4 s
        probe_p = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        wait_for(lambda: ready_of(c).get("prefills") == 1, 30, "the dead prefill registered")
        results = []
        threads = [threading.Thread(target=lambda: results.append(c.post_json("/v1/chat/completions", body,
                                                                               timeout=300)[0])) for _ in range(2)]
        for t in threads:
            t.start()
        # the encoder pushes their embeddings to the dead endpoint (one fits the link's queue, the next
        # waits); the fake prefill goes away, the router takes the requests back (aborts to the encoder)
        # and they wait for a prefill; a real one comes
        probe_p.wait(60)
        wait_for(lambda: ready_of(c).get("prefills") == 0, 30, "the dead prefill dropped")
        c.start_worker("prefill-0", "prefill_worker")
        wait_for(lambda: ready_of(c).get("prefills") == 1, 60, "the real prefill")
        for t in threads:
            t.join(300)
        assert len(results) == 2 and all(st in (200, 503) for st in results), results
        try:
            status, r = c.post_json("/v1/chat/completions", body, timeout=60)
        except OSError as e:
            raise AssertionError("the encoder is wedged: the image request never finished (%r)" % e)
        assert status == 200, (status, r)


def vm_peak_kib(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("VmPeak:"):
                return int(line.split()[1])
    return 0


def zmtp_null_greeting(sock_type):
    """ZMTP 3.0 greeting and READY for the NULL mechanism: what a peer without CURVE sends."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(sock_type)) + sock_type
    return greeting + b"\x04" + bytes([len(body)]) + body


def oversized_frame(cluster, port, proc, sock_type):
    """Announces a 1 GiB frame and sends its first MiB: the process must drop the link, not allocate 1 GiB."""
    pid = cluster.procs[proc].pid
    peak0 = vm_peak_kib(pid)
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    closed = False
    try:
        s.sendall(zmtp_null_greeting(sock_type))
        s.sendall(b"\x02" + struct.pack(">Q", 1 << 30))
        chunk = b"\x00" * 65536
        for _ in range(16):
            s.sendall(chunk)
        s.settimeout(5)
        while True:
            d = s.recv(65536)
            if not d:
                closed = True
                break
    except (ConnectionResetError, BrokenPipeError):
        closed = True
    except socket.timeout:
        pass
    finally:
        s.close()
    grew_mib = (vm_peak_kib(pid) - peak0) / 1024
    assert closed, "%s kept the link open after a 1 GiB frame header" % proc
    assert grew_mib < 256, "%s grew by %.0f MiB" % (proc, grew_mib)
    assert cluster.alive()[proc], proc


def test_oversized_frame_curve_cluster():
    oversized_frame(C, int(C.ctl.rsplit(":", 1)[1]), "router", b"DEALER")
    oversized_frame(C, DC_PORT, "decode-0", b"PUSH")


def test_oversized_frame_insecure_cluster():
    # without CURVE, ZMQ_MAXMSGSIZE is the only bound: a peer gets as far as sending frames
    pf, dc = free_port(), free_port()
    with Cluster(curve=False, worker_args={"prefill_worker": ["--data-port", str(pf)],
                                                       "decode_worker": ["--data-port", str(dc)]}) as c:
        c.wait_ready()
        oversized_frame(c, int(c.ctl.rsplit(":", 1)[1]), "router", b"DEALER")
        oversized_frame(c, pf, "prefill-0", b"PUSH")
        oversized_frame(c, dc, "decode-0", b"PUSH")
        status, r = c.post_json("/v1/completions", dict(PROMPT, max_tokens=4))
        assert status == 200, (status, r)


SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\\n]|\\["\\n])*",?)*\})? \S+$')


def test_cluster_key_registers_and_metrics_stay_well_formed():
    # the control for everything above: with the cluster's decode key the same probe is admitted;
    # its worker id (any bytes a peer likes) must not break the Prometheus exposition (finding 21)
    evil = 'probe"} 1\nvllm:injected_total{x="1'
    # (it stays connected while /metrics is read: the router drops a worker when its connection closes)
    p = subprocess.Popen([binary("prism_peer_probe"), "--role", "decode", "--router", C.ctl, "--curve-keys", C.keys,
                          "--worker-id", evil, "--wait", "6", "--first-rid", "1", "--last-rid", "0",
                          "--rid-file", os.path.join(TMP, "never")], stdout=subprocess.PIPE, text=True)
    label = 'worker="probe\\"} 1\\nvllm:injected_total{x=\\"1"'
    text = wait_for(lambda: (lambda t: label in t and t)(C.request("GET", "/metrics")[2].decode()), 30,
                    "the probe's worker in /metrics")
    out = dict(line.split(": ", 1) for line in p.communicate(timeout=60)[0].strip().splitlines())
    assert out == {"router": "handshake ok", "register": "acked"}, out
    for line in text.splitlines():
        assert line.startswith("#") or SAMPLE.match(line), "malformed exposition line: %r" % line
        assert not line.startswith("vllm:injected"), line


def wait_http(c, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if c.request("GET", "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("router not up: " + c.log("router"))


KEY = "sekrit-0123456789"


def key_file(key, mode=0o600):
    d = tempfile.mkdtemp(prefix="apikey-", dir=TMP)
    path = os.path.join(d, "api-key")
    with open(path, "w") as f:
        f.write(key + "\n")
    os.chmod(path, mode)
    return path


def test_api_key_checked_from_headers():
    # finding 18: the key is compared in constant time from the headers, before the body is read;
    # /metrics needs it unless --metrics-open; /health, /ready (and /version) stay open
    key = {"Authorization": "Bearer " + KEY}
    with Cluster(encoders=0, prefills=0, decodes=0, router_args=["--api-key", KEY]) as c:
        wait_http(c)
        assert c.request("GET", "/ready")[0] == 503  # open, just not ready
        assert c.request("GET", "/version")[0] == 200
        assert c.request("GET", "/metrics")[0] == 401
        assert c.request("GET", "/metrics", headers=key)[0] == 200
        for bad in ("Bearer " + KEY + "2", "Bearer " + KEY[:-1], "Bearer ", "Basic " + KEY, KEY):
            status, _, data = c.request("GET", "/v1/models", headers={"Authorization": bad})
            assert status == 401 and b"AuthenticationError" in data, (bad, status, data)
        assert c.request("GET", "/v1/models", headers=key)[0] == 200
        # a large declared body and none sent: the 401 comes at once, the body is never awaited
        s = socket.create_connection(("127.0.0.1", c.port), timeout=5)
        t0 = time.time()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer nope\r\n"
                  b"Content-Length: 60000000\r\n\r\n")
        data = s.recv(4096)
        s.close()
        assert data.startswith(b"HTTP/1.1 401"), data
        assert time.time() - t0 < 3
    with Cluster(encoders=0, prefills=0, decodes=0, router_args=["--api-key-file", key_file(KEY), "--metrics-open"]) as c:
        wait_http(c)
        assert c.request("GET", "/metrics")[0] == 200
        assert c.request("GET", "/v1/models")[0] == 401


def test_api_key_from_a_file_or_the_environment():
    """Issue 26 finding 10: the key was accepted only in argv (every local user reads
    /proc/PID/cmdline). --api-key-file and PRISM_API_KEY give it without; the file must be readable
    by no other user; one source at most; a key under 16 characters (the shipped placeholder
    "replace-me") keeps the router from starting."""
    for how, args, env in (("file", ["--api-key-file", key_file(KEY)], None), ("env", [], {"PRISM_API_KEY": KEY})):
        with Cluster(encoders=0, prefills=0, decodes=0, router_args=args, worker_env={"router": env} if env else None) as c:
            wait_http(c)
            assert c.request("GET", "/v1/models")[0] == 401, how
            assert c.request("GET", "/v1/models", headers={"Authorization": "Bearer " + KEY})[0] == 200, how
            with open("/proc/%d/cmdline" % c.procs["router"].pid, "rb") as f:
                assert KEY.encode() not in f.read(), how
    for why, args, env, said in (
            ("readable by others", ["--api-key-file", key_file(KEY, 0o644)], None, "readable by other users"),
            ("a placeholder", ["--api-key-file", key_file("replace-me")], None, "placeholder is not a key"),
            ("a short key", ["--api-key", "sekrit"], None, "at least 16"),
            ("two sources", ["--api-key-file", key_file(KEY)], {"PRISM_API_KEY": KEY}, "one way"),
            ("no such file", ["--api-key-file", "/nonexistent/api-key"], None, "cannot read")):
        r = subprocess.run([binary("router"), "--port", "0", *args], capture_output=True, text=True, timeout=30,
                           env=dict(os.environ, **(env or {})))
        assert r.returncode == 2 and said in r.stderr, (why, r.returncode, r.stderr[-500:])


def router_memory():
    status, _, data = C.request("GET", "/metrics")
    m = re.search(rb"^prism:router_memory_bytes(?:\{\})? ([0-9.e+]+)$", data, re.M)
    return float(m.group(1))


def raw_status(port, request, timeout=10):
    """The status of the answer to raw request bytes."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(request)
        data = s.recv(4096)
    finally:
        s.close()
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else data


def test_unread_answers_do_not_pin_memory():
    """Issue 26 finding 3: four /tokenize requests with Connection: close whose answers (MBs) the
    client never reads. Their answers used to stay in the router's heap for good (the closing
    connection ran no timer and left the connection count); now the write deadline drops them."""
    prompt = "ab cd " * 400000
    body = json.dumps({"model": "prism-tiny-llava", "prompt": prompt}).encode()
    base = router_memory()
    socks = []
    for _ in range(4):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", C.port))
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        socks.append(s)
    try:
        wait_for(lambda: router_memory() > base + 8e6, 60, "the answers to be written", interval=0.2)
        peak = router_memory()
        t0 = time.time()
        wait_for(lambda: router_memory() < base + 2e6, 60, "the unread answers to be dropped", interval=0.2)
        print("  %.1f MB of unread answers held, dropped %.1f s later" % ((peak - base) / 1e6, time.time() - t0))
    finally:
        for s in socks:
            s.close()


def tokenize_prompt(n_words, seed):
    """A prompt of n_words varied words: about 0.2 s of tokenizing per MB on the development machine."""
    rnd = random.Random(seed)
    words = ["".join(rnd.choice("abcdefghij") for _ in range(rnd.randint(2, 7))) for _ in range(5000)]
    return " ".join(rnd.choice(words) for _ in range(n_words))


def post_raw(port, path, body, close=False):
    """A socket that has sent one whole POST (the answer not read)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n%sContent-Length: %d\r\n\r\n"
              % (path.encode(), b"Connection: close\r\n" if close else b"", len(body)) + body)
    return s


def read_status_to_end(s):
    """The status of a Connection: close answer, read to its end."""
    data = b""
    while True:
        chunk = s.recv(1 << 20)
        if not chunk:
            break
        data += chunk
    s.close()
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else None


def test_tokenize_admitted_behind_generation_and_dropped_when_gone():
    """Issue 26 finding 4: /tokenize and /detokenize skipped admission and shared the preparation
    threads' FIFO with chat requests (49 queued 4 MiB jobs held a one-token chat 26 s), and a job
    whose client left still ran. Now they count against --max-running-requests (429 beyond), wait
    in a lane of their own that generation requests pass and that leaves one thread to them, and a
    waiting job whose client left is taken out unrun."""
    big = json.dumps({"model": "prism-tiny-llava", "prompt": tokenize_prompt(600000, 1)}).encode()   # ~3.3 MB
    with Cluster(router_args=["--prep-threads", "2", "--max-parse-bytes", "8M"]) as c:   # the 3.3 MB body
        c.wait_ready()
        t0 = time.time()
        assert c.request("POST", "/tokenize", big)[0] == 200
        one = time.time() - t0
        # eight big jobs sent first, their answers read as they come; then a one-token chat
        done, lock = [], threading.Lock()

        def tokenize(k):
            st = read_status_to_end(post_raw(c.port, "/tokenize", big, close=True))
            with lock:
                done.append((time.time(), st))
        threads = [threading.Thread(target=tokenize, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        wait_for(lambda: (c.metric("prism:router_prep_waiting", lane="utility") or 0) >= 5, 30,
                 "the /tokenize jobs to wait for a thread")
        t_chat = time.time()
        status, r = c.post_json("/v1/chat/completions", chat_body("Hi", max_tokens=1))
        chat_s, t_chat_end = time.time() - t_chat, time.time()
        for t in threads:
            t.join(120)
        assert status == 200, r
        assert sorted(st for _, st in done) == [200] * 8, done
        before = sum(1 for t, _ in done if t < t_chat_end)
        print("  one 3.3 MB /tokenize %.2f s; a chat behind eight answered in %.2f s, after %d of them (all done "
              "%.1f s after it)" % (one, chat_s, before, max(t for t, _ in done) - t_chat_end))
        assert before <= 2, "the chat waited for %d /tokenize jobs (%.2f s)" % (before, chat_s)
        # jobs whose clients left before a thread took them never run
        started = c.metric("prism:router_prep_jobs_total", lane="utility")
        for k in range(10):
            post_raw(c.port, "/tokenize", big).close()
        wait_for(lambda: (c.metric("prism:router_prep_cancelled_total", lane="utility") or 0) >= 7, 30,
                 "the jobs of clients that left to be taken out")
        t0 = time.time()
        assert c.request("POST", "/tokenize", {"prompt": "Hi"})[0] == 200
        small_s = time.time() - t0
        ran = c.metric("prism:router_prep_jobs_total", lane="utility") - started - 1
        print("  ten clients gone: %d of their jobs ran; a small /tokenize then took %.2f s" % (ran, small_s))
        assert ran <= 3 and small_s < 3 * one + 1, (ran, small_s)
    # the bound: /tokenize counts against --max-running-requests
    with Cluster(encoders=0, prefills=0, decodes=0, router_args=["--prep-threads", "2", "--max-running-requests", "6",
                                                                 "--max-parse-bytes", "8M"]) as c:
        wait_http(c)
        socks = [post_raw(c.port, "/tokenize", big, close=True) for _ in range(12)]
        statuses = [read_status_to_end(s) for s in socks]
        print("  12 /tokenize at --max-running-requests 6: %s" % statuses)
        assert statuses.count(429) >= 3 and statuses.count(200) >= 6, statuses
        assert c.metric("prism:requests_refused_total", reason="queue_full") == statuses.count(429)


def test_dns_rebinding_and_form_posts_refused():
    """Issue 26 finding 11: a router bound to loopback answers only its loopback names (a page that
    reaches it by DNS rebinding sends its own), and POST bodies must be JSON (a cross-site form
    cannot send that without a CORS preflight). --allowed-hosts names others."""
    get = b"GET /v1/models HTTP/1.1\r\nHost: %s\r\n\r\n"
    for host, want in ((b"evil.example", 403), (b"evil.example:%d" % C.port, 403), (b"127.0.0.1.evil.example", 403),
                       (b"localhost:%d" % C.port, 200), (b"127.0.0.1:%d" % C.port, 200), (b"[::1]:%d" % C.port, 200)):
        assert raw_status(C.port, get % host) == want, (host, want)
    body = json.dumps(dict(PROMPT, max_tokens=1)).encode()
    for ctype, want in ((b"text/plain", 415), (b"application/x-www-form-urlencoded", 415), (None, 415),
                        (b"application/json; charset=utf-8", 200)):
        head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        if ctype:
            head += b"Content-Type: " + ctype + b"\r\n"
        assert raw_status(C.port, head + b"Content-Length: %d\r\n\r\n" % len(body) + body) == want, (ctype, want)
    with Cluster(encoders=0, prefills=0, decodes=0, router_args=["--allowed-hosts", "api.example"]) as c:
        wait_http(c)
        assert raw_status(c.port, get % b"api.example") == 200
        assert raw_status(c.port, get % b"127.0.0.1") == 200    # the bind address, always
        assert raw_status(c.port, get % b"localhost") == 403


def test_lenient_framing_refused():
    """Issue 26 finding 15: what a front end might read otherwise than the router is refused (400)."""
    for req in (b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-A: a\r\n b\r\n\r\n",
                b"POST /tokenize HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
                b"GET /health HTTP/1.1\r\n\r\n",
                b"GET /health HTTP/1.1\r\nHost: localhost\r\nHost: localhost\r\n\r\n"):
        assert raw_status(C.port, req) == 400, req
    assert raw_status(C.port, b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n") == 200


if __name__ == "__main__":
    try:
        rc = run_tests([test_no_curve_refused, test_other_cluster_keys_refused, test_stranger_knowing_public_keys_refused,
                        test_cluster_key_of_wrong_role_refused, test_wrong_role_per_data_socket,
                        test_oversized_frame_curve_cluster, test_oversized_frame_insecure_cluster,
                        test_cluster_key_registers_and_metrics_stay_well_formed, test_api_key_checked_from_headers, test_api_key_from_a_file_or_the_environment,
                        test_tokens_only_from_the_worker_holding_the_request, test_nul_identity_cannot_alias_a_worker,
                        test_key_of_another_role_cannot_register_it, test_request_ids_unguessable,
                        test_decode_checks_kv_sampling, test_decode_checks_kv_wire_dtype, test_abort_before_kv_is_remembered,
                        test_encoder_freed_when_its_prefill_dies, test_cache_hits_not_shown_to_clients,
                        test_router_checks_tokens_from_the_holding_decode, test_registration_fields_checked,
                        test_junk_embeddings_cannot_fill_the_pool, test_embeddings_need_the_whole_request_id,
                        test_tokens_need_the_whole_request_id, test_decode_told_to_stop_made_up_kv,
                        test_unread_answers_do_not_pin_memory, test_tokenize_admitted_behind_generation_and_dropped_when_gone, test_dns_rebinding_and_form_posts_refused,
                        test_lenient_framing_refused])
        assert all(C.alive().values()), C.alive()
    finally:
        C.stop()
        shutil.rmtree(TMP, ignore_errors=True)
    sys.exit(rc)
