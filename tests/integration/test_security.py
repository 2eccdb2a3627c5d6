"""Security of the internal links, against real processes: an intruder without the cluster's keys (no CURVE,
another cluster's keys, a stranger who knows our public keys, or a cluster key of a role no socket admits)
cannot register, inject Tokens, push embeddings, KV, Prefill or Abort messages; an oversized frame does not
make a process allocate it.

Run: python3 tests/integration/test_security.py   (PRISM_BINARY_DIR=build dir)
"""
import http.client
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import Cluster, binary, free_port, make_keys, run_tests  # noqa: E402

TMP = tempfile.mkdtemp(prefix="prism-sec-")
PF_PORT, DC_PORT = free_port(), free_port()
DATA = {"prefill_worker": ["--data-port", str(PF_PORT)], "decode_worker": ["--data-port", str(DC_PORT)]}
C = Cluster(encoders=1, worker_args=DATA)
PROMPT = {"model": "prism-tiny-llava", "prompt": "A red circle on a white", "temperature": 0, "ignore_eos": True}
MAX_TOKENS = 600
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


def probe(keys, role, targets=("router", "prefill", "decode"), wait=1.5, worker_id="intruder"):
    args = [binary("prism_peer_probe"), "--role", role, "--router-id", router_id(), "--token", str(INJECTED),
            "--first-rid", "1", "--last-rid", "64", "--wait", str(wait), "--worker-id", worker_id,
            "--embedding-bytes", str(64 * 256 * 4)]
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
    t.join(120)
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
    out, _ = probe(C.keys, "decode", targets=("router",), wait=1.5, worker_id=evil)
    assert out == {"router": "handshake ok", "register": "acked"}, out
    status, _, data = C.request("GET", "/metrics")
    text = data.decode()
    assert 'worker="probe\\"} 1\\nvllm:injected_total{x=\\"1"' in text, text[-2000:]
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


def test_api_key_checked_from_headers():
    # finding 18: the key is compared in constant time from the headers, before the body is read;
    # /metrics needs it unless --metrics-open; /health, /ready (and /version) stay open
    key = {"Authorization": "Bearer sekrit"}
    with Cluster(encoders=0, prefills=0, decodes=0, router_args=["--api-key", "sekrit"]) as c:
        wait_http(c)
        assert c.request("GET", "/ready")[0] == 503  # open, just not ready
        assert c.request("GET", "/version")[0] == 200
        assert c.request("GET", "/metrics")[0] == 401
        assert c.request("GET", "/metrics", headers=key)[0] == 200
        for bad in ("Bearer sekrit2", "Bearer sekri", "Bearer ", "Basic sekrit", "sekrit"):
            status, _, data = c.request("GET", "/v1/models", headers={"Authorization": bad})
            assert status == 401 and b"AuthenticationError" in data, (bad, status, data)
        assert c.request("GET", "/v1/models", headers=key)[0] == 200
        # a large declared body and none sent: the 401 comes at once, the body is never awaited
        s = socket.create_connection(("127.0.0.1", c.port), timeout=5)
        t0 = time.time()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                  b"Content-Length: 60000000\r\n\r\n")
        data = s.recv(4096)
        s.close()
        assert data.startswith(b"HTTP/1.1 401"), data
        assert time.time() - t0 < 3
    with Cluster(encoders=0, prefills=0, decodes=0, router_args=["--api-key", "sekrit", "--metrics-open"]) as c:
        wait_http(c)
        assert c.request("GET", "/metrics")[0] == 200
        assert c.request("GET", "/v1/models")[0] == 401


if __name__ == "__main__":
    try:
        rc = run_tests([test_no_curve_refused, test_other_cluster_keys_refused, test_stranger_knowing_public_keys_refused,
                        test_cluster_key_of_wrong_role_refused, test_wrong_role_per_data_socket,
                        test_oversized_frame_curve_cluster, test_oversized_frame_insecure_cluster,
                        test_cluster_key_registers_and_metrics_stay_well_formed, test_api_key_checked_from_headers])
        assert all(C.alive().values()), C.alive()
    finally:
        C.stop()
        shutil.rmtree(TMP, ignore_errors=True)
    sys.exit(rc)
