"""Test harness: starts a real Prism cluster (router + workers) on loopback and talks HTTP to it.

Only the Python standard library is used, so CI needs nothing beyond python3.
"""
import base64
import fcntl
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.environ.get("PRISM_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
BUILD = os.environ.get("PRISM_BINARY_DIR") or os.path.join(ROOT, "build")
MODEL = os.path.join(ROOT, "models", "prism-tiny-llava")


SANITIZER_MARKS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                   "SUMMARY: UndefinedBehaviorSanitizer")


# What a memory plan leaves out (Cluster.check_memory_plan): the libraries' small records (the model's,
# the KV cache's, the sockets'). About 24 KiB for prefill and decode with the tiny LLaVA, 6 KiB for its
# encoder; any pool or library region larger than the margin that a worker allocated outside its plan
# (or planned and never allocated) fails.
PLAN_MARGIN = 48 << 10


def ephemeral_port_range():
    """(low, high): the kernel's range for the local ports of outgoing connections and of binds to
    port 0 (net.ipv4.ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


_PORTS_HANDED_OUT = set()  # by this process: never handed out twice
_PORT_LOCKS = []           # [fd] of the lock file; one locked byte per port handed out (see free_port_range)
PORT_FLOOR = 10000         # well-known and registered-service ports stay out of it


def _port_lock_fd():
    """The shared lock file's descriptor, opened once (a POSIX lock goes when its process closes any
    descriptor of the file, so there is only this one); None where it cannot be opened."""
    if not _PORT_LOCKS:
        path = os.path.join(tempfile.gettempdir(), "prism-test-ports.lock")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                os.fchmod(fd, 0o666)  # every user's tests share it
            except OSError:
                pass
        except OSError:
            fd = None
        _PORT_LOCKS.append(fd)
    return _PORT_LOCKS[0]


def _reserve(port):
    """Takes port for this process until it exits: False when another test process holds it."""
    fd = _port_lock_fd()
    if fd is None:
        return True
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
        return True
    except OSError:
        return False


def _bindable(port):
    """Whether a server can listen on 127.0.0.1:port now, binding as the routers (libuv), ZeroMQ's tcp
    binds, nginx and HAProxy do: with SO_REUSEADDR, so a port whose old connections sit in TIME_WAIT
    counts as free, and listening, so another socket's bind or listen on it counts as taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
            return True
        except OSError:
            return False


def free_port_range(n=1):
    """Base of n consecutive loopback ports for servers a test starts (routers, control endpoints,
    link leaders, balancers, launch.sh's ports): free now, and below the kernel's ephemeral range
    (ephemeral_port_range; above it if no room below). A port found free, closed and bound by a
    server later is a race: a port from the ephemeral range (what binding port 0 gives) may meanwhile
    become the local port of any outgoing connection (ZeroMQ reconnects, nginx's upstream connections,
    curl), and the server's bind fails (about 1 cluster start in 100 did); ports outside it are never
    handed to a connection. Ports handed out are not handed out again by this process, nor by another
    test process while this one runs (one locked byte per port in a shared lock file)."""
    low, high = ephemeral_port_range()
    spans = [(a, b) for a, b in ((PORT_FLOOR, low - 1), (high + 1, 65535)) if b - a + 1 >= max(n, 1000)]
    if not spans:
        print("warning: no room for test ports outside the ephemeral range %d-%d; they may race outgoing "
              "connections (narrow net.ipv4.ip_local_port_range)" % (low, high), file=sys.stderr, flush=True)
        spans = [(PORT_FLOOR, 65535)]
    rnd = random.Random()
    for _ in range(500):
        a, b = rnd.choice(spans)
        base = rnd.randrange(a, b - n + 2)
        ports = range(base, base + n)
        if any(p in _PORTS_HANDED_OUT for p in ports) or not all(_bindable(p) for p in ports):
            continue
        if all(_reserve(p) for p in ports):  # a port taken here stays taken: a later try skips it
            _PORTS_HANDED_OUT.update(ports)
            return base
    raise RuntimeError("no %d consecutive free ports outside the ephemeral range %d-%d" % (n, low, high))


def free_port():
    """One port, as free_port_range(1)."""
    return free_port_range(1)


def tool_env():
    """Environment for one-shot tools (reference generation, image making): under a sanitizer
    build their exit-time leaks are noise (they free nothing before exiting); errors still abort."""
    env = dict(os.environ)
    if env.get("ASAN_OPTIONS"):
        env["ASAN_OPTIONS"] += ":detect_leaks=0"
    return env


def run_tool(args, **kw):
    return subprocess.run(args, check=True, capture_output=True, text=True, env=tool_env(), **kw)


def binary(name):
    sub = {"router": "router", "encoder_worker": "encoder_worker", "prefill_worker": "prefill_worker",
           "decode_worker": "decode_worker", "prism_imgtool": "tools", "prism_generate": "tools",
           "prism_wire": "tools", "prism_keygen": "tools", "prism_peer_probe": "tests/integration"}[name]
    return os.path.join(BUILD, sub, name)


def sanitized():
    """Whether the binaries are a sanitizer build (AddressSanitizer's shadow and quarantine are
    resident: memory bounds are not the product's there, and start-up alone takes tens of MiB)."""
    try:
        out = subprocess.run(["ldd", binary("router")], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "libasan" in out or "libtsan" in out


def make_keys(directory):
    """A cluster's CURVE key directory (prism_keygen): one keypair per role."""
    subprocess.run([binary("prism_keygen"), "--out", directory], check=True, stdout=subprocess.DEVNULL)
    return directory


class Cluster:
    """routers > 1 starts that many routers; every worker connects to all of them (--router a,b).
    common_worker_args go to every worker (e.g. a short --heartbeat-interval for tests that read
    worker state from /metrics). curve=True (the default, as in deploy/launch.sh): internal links
    authenticated with a fresh key directory (self.keys); curve=False runs every process with
    --insecure-no-curve. worker_env: {kind: {VAR: value}} added to that kind's environment (test
    hooks such as PRISM_TEST_STALL_AFTER_LAYERS)."""

    def __init__(self, encoders=1, prefills=1, decodes=1, model=MODEL, router_args=(), worker_args=None,
                 log_dir=None, routers=1, common_worker_args=(), curve=True, worker_env=None):
        base = free_port_range(2 * routers)
        self.ports = [base + i for i in range(routers)]
        self.ctls = ["tcp://127.0.0.1:%d" % (base + routers + i) for i in range(routers)]
        self.port = self.ports[0]
        self.ctl = ",".join(self.ctls)
        self.model = model
        self.procs = {}
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="prism-it-")
        self.keys = make_keys(os.path.join(self.log_dir, "curve-keys")) if curve else None
        self.sec = ["--curve-keys", self.keys] if curve else ["--insecure-no-curve"]
        self.worker_args = worker_args or {}
        self.worker_env = worker_env or {}
        self.common_worker_args = list(common_worker_args)
        for i in range(routers):
            self._start("router" if i == 0 else "router-%d" % i, "router",
                        ["--model-path", model, "--port", str(self.ports[i]), "--control-endpoint", self.ctls[i],
                         "--drain-timeout", "0", *self.sec, *router_args])  # teardown: no drain (tests may ask)
        self.expected = {"encoders": encoders, "prefills": prefills, "decodes": decodes}
        for kind, n in (("encoder_worker", encoders), ("prefill_worker", prefills), ("decode_worker", decodes)):
            for i in range(n):
                self.start_worker("%s-%d" % (kind.split("_")[0], i), kind)
        self.t_start = time.time()

    def start_worker(self, name, kind, extra=()):
        """Starts (or restarts, under the same id) one worker connected to every router, with the
        cluster's keys."""
        self._start(name, kind, ["--model-path", self.model, "--router", self.ctl, "--worker-id", name,
                                 *self.sec, *self.common_worker_args, *self.worker_args.get(kind, ()), *extra])

    def _start(self, name, kind, args):
        log = open(os.path.join(self.log_dir, name + ".log"), "ab")
        env = dict(os.environ, **self.worker_env[kind]) if kind in self.worker_env else None
        self.procs[name] = subprocess.Popen([binary(kind), *args], stdout=log, stderr=subprocess.STDOUT, env=env)

    def kill(self, name):
        """SIGKILL, as a crash would: no goodbye to the router."""
        p = self.procs.pop(name)
        p.kill()
        p.wait()

    def wait_ready(self, timeout=60):
        deadline = time.time() + timeout
        for r in range(len(self.ports)):
            while True:
                if time.time() > deadline:
                    raise RuntimeError("cluster not ready after %ss" % timeout)
                for name, p in self.procs.items():
                    if p.poll() is not None:
                        log = self.log(name)
                        clash = ("\n(a port it was given was taken between free_port_range's pick and its bind)"
                                 if "address already in use" in log.lower() else "")
                        raise RuntimeError("%s exited during start-up (rc %s):\n%s%s" % (name, p.returncode, log,
                                                                                        clash))
                try:
                    status, _, data = self.request("GET", "/ready", router=r)
                    # ready, and every worker this cluster started registered with this router
                    if status == 200 and all(json.loads(data).get(k, 0) >= n
                                             for k, n in getattr(self, "expected", {}).items()):
                        break
                except OSError:
                    pass
                time.sleep(0.05)
        return time.time() - self.t_start

    def log(self, name, tail=4000):
        with open(os.path.join(self.log_dir, name + ".log"), "rb") as f:
            text = f.read().decode("utf-8", "replace")
        return text[-tail:] if tail else text

    def wait_log(self, name, text, timeout=20):
        """Waits until the process's log contains text; returns the whole log."""
        return wait_for(lambda: text in self.log(name, tail=0) and self.log(name, tail=0), timeout,
                        "%r in %s's log" % (text, name))

    def plan_regions(self, worker):
        """[(name, kind, bytes)] of worker's memory plan, as its budget check logged them."""
        region = re.compile(r"memory plan: (\S+)\s+.*\s(pool|library|outside)\s+\((\d+) bytes\)")
        return [(m.group(1), m.group(2), int(m.group(3))) for m in region.finditer(self.log(worker, tail=0))]

    def check_memory_plan(self, tiers=("encoder", "prefill", "decode")):
        """Each worker's memory plan is one table of regions (common/worker/start.h) that both totals
        the plan and carves the pools: registration's prism:worker_memory_planned_bytes is the sum of
        the regions the worker logged, and the regions held on the heap (pools and libraries, on the
        CPU backend) add up to the heap the counting allocator saw in use once start-up ended, within
        PLAN_MARGIN. One worker of each tier, named <tier>-0."""
        total = re.compile(r"memory plan: total\s+.*\((\d+) bytes\)")
        held = re.compile(r"memory plan: pools and libraries (\d+) bytes; heap in use after start-up (\d+) bytes")
        for tier in tiers:
            log = self.log(tier + "-0", tail=0)
            regions = self.plan_regions(tier + "-0")
            planned = self.metric("prism:worker_memory_planned_bytes", tier=tier)
            assert regions and planned == sum(b for _, _, b in regions) == int(total.search(log).group(1)), \
                (tier, planned, regions)
            heap_regions = sum(b for _, kind, b in regions if kind != "outside")
            m = held.search(log)
            assert m and int(m.group(1)) == heap_regions, (tier, m and m.group(0), heap_regions)
            in_use = int(m.group(2))
            assert abs(in_use - heap_regions) <= PLAN_MARGIN, \
                ("%s: %d bytes on the heap after start-up, the plan's pools and libraries %d (%+d): a region is "
                 "missing from the plan or planned and not allocated" % (tier, in_use, heap_regions,
                                                                         in_use - heap_regions), regions)

    def alive(self):
        return {n: p.poll() is None for n, p in self.procs.items()}

    def stop(self):
        if getattr(self, "stopped", False):
            return
        self.stopped = True
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 30  # sanitizer builds take a while to exit (leak check)
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.check_sanitizers()

    def check_sanitizers(self):
        """Fails when any process of this cluster (killed ones included) logged an AddressSanitizer,
        LeakSanitizer or UndefinedBehaviorSanitizer report: under a sanitizer build
        (tests/run-all.sh runs the integration tests on build-asan too) the request life is checked
        in every process, not only in unit tests."""
        bad = []
        for f in sorted(os.listdir(self.log_dir)):
            if not f.endswith(".log"):
                continue  # e.g. the curve-keys directory
            with open(os.path.join(self.log_dir, f), "rb") as fh:
                text = fh.read().decode("utf-8", "replace")
            for mark in SANITIZER_MARKS:
                i = text.find(mark)
                if i >= 0:
                    bad.append("%s: %s" % (f, text[max(0, i - 200):i + 1500]))
                    break
        if bad:
            raise AssertionError("sanitizer report(s) in %s:\n%s" % (self.log_dir, "\n".join(bad)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---- HTTP ----
    def _port(self, router):
        """HTTP port of router number `router` (views made elsewhere may set only .port)."""
        ports = getattr(self, "ports", None)
        if ports:
            return ports[router]
        assert router == 0, router
        return self.port

    def request(self, method, path, body=None, headers=None, timeout=120, router=0):
        conn = http.client.HTTPConnection("127.0.0.1", self._port(router), timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            hdrs = {"Content-Type": "application/json"}
            hdrs.update(headers or {})
            conn.request(method, path, body=body, headers=hdrs)
            r = conn.getresponse()
            data = r.read()
            return r.status, dict(r.getheaders()), data
        finally:
            conn.close()

    def post_json(self, path, body, **kw):
        status, headers, data = self.request("POST", path, body, **kw)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data

    def stream(self, path, body, timeout=120, router=0, headers=None):
        """POSTs with stream=true; returns (status, [parsed events], saw_done)."""
        conn = http.client.HTTPConnection("127.0.0.1", self._port(router), timeout=timeout)
        try:
            hdrs = {"Content-Type": "application/json"}
            hdrs.update(headers or {})
            conn.request("POST", path, body=json.dumps(body).encode(), headers=hdrs)
            r = conn.getresponse()
            if r.status != 200:
                return r.status, [json.loads(r.read())], False
            events, done = [], False
            buf = b""
            while True:
                chunk = r.read1(65536) if hasattr(r, "read1") else r.read(65536)
                if not chunk:
                    break
                buf += chunk
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    assert ev.startswith(b"data: "), ev
                    payload = ev[6:]
                    if payload == b"[DONE]":
                        done = True
                    else:
                        events.append(json.loads(payload))
            return r.status, events, done
        finally:
            conn.close()

    def open_stream(self, path, body, timeout=120, router=0):
        """Starts a streaming request and returns an SseStream to read events one at a time (and to
        drop the connection mid-stream)."""
        conn = http.client.HTTPConnection("127.0.0.1", self._port(router), timeout=timeout)
        conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, (r.status, r.read()[:300])
        return SseStream(conn, r)

    # ---- /metrics ----
    def metrics(self, router=0):
        """[(name, {label: value}, float)] from the Prometheus text."""
        status, _, data = self.request("GET", "/metrics", router=router)
        assert status == 200, status
        out = []
        for line in data.decode().splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r'([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)$', line)
            if m:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(3) or ""))
                out.append((m.group(1), labels, float(m.group(4))))
        return out

    def metric(self, name, router=0, **labels):
        """Sum of the samples of name whose labels include `labels`; None when there is none."""
        vals = [v for n, lb, v in self.metrics(router) if n == name and all(lb.get(k) == x for k, x in labels.items())]
        return sum(vals) if vals else None


class SseStream:
    """One streaming response, read event by event."""

    def __init__(self, conn, resp):
        self.conn, self.resp, self.buf, self.done = conn, resp, b"", False

    def next_event(self):
        """The next parsed event; "[DONE]" for the end marker; None at end of stream."""
        while b"\n\n" not in self.buf:
            chunk = self.resp.read1(65536)
            if not chunk:
                return None
            self.buf += chunk
        ev, self.buf = self.buf.split(b"\n\n", 1)
        assert ev.startswith(b"data: "), ev
        if ev[6:] == b"[DONE]":
            self.done = True
            return "[DONE]"
        return json.loads(ev[6:])

    def close(self):
        """Drops the connection (a client that goes away mid-stream)."""
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


def read_response(s):
    """(status, headers, body) of one HTTP/1.1 response with a Content-Length, read from socket s."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        assert chunk, data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:])}
    while len(body) < int(headers["content-length"]):
        chunk = s.recv(65536)
        assert chunk, body
        body += chunk
    return int(lines[0].split()[1]), headers, body


def wait_for(fn, timeout, what, interval=0.02):
    """Polls fn until it returns something truthy (returned); fails naming `what` and the last value."""
    deadline = time.time() + timeout
    last = None
    while True:
        last = fn()
        if last:
            return last
        if time.time() > deadline:
            raise AssertionError("timed out after %.1fs waiting for %s (last value %r)" % (timeout, what, last))
        time.sleep(interval)


def fresh_heartbeats(c, worker, n=2, timeout=30):
    """Waits until worker has sent n more heartbeats than now: its numbers read afterwards were taken
    after everything that happened before this call."""
    start = c.metric("prism:worker_heartbeats_total", worker=worker)
    assert start is not None, "prism:worker_heartbeats_total is missing for %s" % worker
    wait_for(lambda: c.metric("prism:worker_heartbeats_total", worker=worker) >= start + n, timeout,
             "%d fresh heartbeats from %s" % (n, worker))


def work_counters(c, worker="decode-0"):
    """What aborts stop, as the worker heartbeats it: {tokens, aborted, prompts_aborted, progress}."""
    return {"tokens": c.metric("prism:worker_tokens_generated_total", worker=worker) or 0,
            "aborted": c.metric("prism:worker_sequences_aborted_total", worker=worker) or 0,
            "prompts_aborted": c.metric("prism:worker_prompts_aborted_total", worker=worker) or 0,
            "progress": c.metric("prism:worker_progress_total", worker=worker) or 0}


def assert_abort_stopped_decode(c, before, budget_tokens, worker="decode-0", timeout=10):
    """An abort stopped the decode worker's sequence (not only its log line): its count of aborted
    sequences rose, and once it is idle the tokens it sampled since `before` (work_counters taken
    just before the abort) are far fewer than the request asked for (budget_tokens): a worker that
    logs the abort and keeps generating samples them all, which the waits of a test cannot tell."""
    wait_for(lambda: work_counters(c, worker)["aborted"] > before["aborted"], timeout,
             "the decode worker to end the aborted sequence (prism:worker_sequences_aborted_total)")
    wait_for(lambda: c.metric("prism:worker_running", worker=worker) == 0, timeout, "%s idle" % worker)
    fresh_heartbeats(c, worker)
    after = work_counters(c, worker)
    assert after["tokens"] - before["tokens"] < budget_tokens // 4, (
        "the decode worker went on after the abort: %d tokens sampled since, of %d asked" % (
            after["tokens"] - before["tokens"], budget_tokens))
    return after


def image_url(path):
    with open(path, "rb") as f:
        data = f.read()
    mime = "image/png" if path.endswith(".png") else "image/jpeg"
    return "data:%s;base64,%s" % (mime, base64.b64encode(data).decode())


def make_image(path, **opts):
    args = [binary("prism_imgtool"), "--out", path]
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            args.append(flag)
        else:
            args += [flag, str(v)]
    run_tool(args)
    return path


# prism:request_stage_seconds' stages, in order (router/router.h router_time_stage_t, docs/API.md)
STAGES = ["prepare", "fetch", "router_queue", "encoder_queue", "encoder_wait", "image_decode", "vit", "prefill_queue", "prefill",
          "dispatch", "kv_transfer", "decode_queue", "decode_first_step", "decode"]


def chat_body(text, images=(), **kw):
    content = [{"type": "image_url", "image_url": {"url": image_url(p)}} for p in images]
    content.append({"type": "text", "text": text})
    body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": content}]}
    body.update(kw)
    return body


class Skip(Exception):
    """Raised by a test that cannot run here (something it needs is absent): counted as skipped,
    never as passed. A test that may skip runs as its own ctest entry (see own_entry), so ctest
    shows Skipped (exit 77) rather than a suite's Passed."""


def own_entry(fn):
    """Marks a test that runs only when named on the command line: its own ctest entry, so that
    its Skip (exit 77) is what ctest reports for it."""
    fn.own_entry = True
    return fn


def known_bug(reason):
    """Marks a test that fails because of a known, open bug. It runs only when named on the command
    line (its own ctest entry): a failure prints SKIP with the reason and counts as skipped (exit 77
    when nothing else ran), a pass says the bug looks fixed and the marker should go."""
    def mark(fn):
        fn.known_bug = reason
        return fn
    return mark


def run_tests(tests):
    """Runs test functions in order; prints one line each and a closing 'N passed, N failed, N skipped'.
    Test names given on the command line select those tests (including known_bug ones; other
    arguments are left to the script); without names every test not marked known_bug runs. Exit status: 1 on a failure, 77 when everything
    that ran was skipped, else 0."""
    known = {t.__name__ for t in tests}
    names = [a for a in sys.argv[1:] if a in known]  # other arguments belong to the script
    if names:
        tests = [t for t in tests if t.__name__ in names]
    else:
        tests = [t for t in tests if not getattr(t, "known_bug", None) and not getattr(t, "own_entry", False)]
    passed = failed = skipped = 0
    for t in tests:
        t0 = time.time()
        bug = getattr(t, "known_bug", None)
        try:
            t()
            passed += 1
            print("PASS %-45s %.2fs%s" % (t.__name__, time.time() - t0,
                                          "  (known bug looks fixed: remove @known_bug)" if bug else ""), flush=True)
        except Skip as e:
            skipped += 1
            print("SKIP %-45s %s" % (t.__name__, e), flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure and go on
            import traceback
            if bug:
                skipped += 1
                print("SKIP %-45s known bug: %s\n     (failure: %s)" % (t.__name__, bug, e), flush=True)
                continue
            failed += 1
            print("FAIL %-45s %s" % (t.__name__, e), flush=True)
            traceback.print_exc()
    print("%d passed, %d failed, %d skipped" % (passed, failed, skipped))
    if failed:
        return 1
    return 77 if skipped and not passed else 0


# ---- distinct requests with their own references (concurrency tests must tell answers apart) ----

DISTINCT = [  # (shape, colour, background, width, height, question)
    ("circle", "red", "white", 640, 480, "What is in the image?"),
    ("square", "green", "black", 300, 200, "Describe the image."),
    ("triangle", "blue", "gray", 200, 300, "What do you see?"),
    ("circle", "yellow", "black", 256, 256, "What is shown in this picture?"),
    ("square", "purple", "white", 500, 400, "What is in the image?"),
    ("triangle", "orange", "white", 333, 217, "Describe this picture."),
    ("square", "blue", "gray", 128, 128, "What can you see in the image?"),
    ("triangle", "red", "black", 420, 300, "Tell me what is in this image."),
]


def reference(images, text, max_tokens):
    """What tools/prism_generate (the same model code in one process) answers: {prompt_tokens,
    token_ids, text}."""
    args = [binary("prism_generate"), "--model-path", MODEL, "--user", text, "--max-tokens", str(max_tokens)]
    if images:
        args += ["--image", ",".join(images)]
    return json.loads(run_tool(args, timeout=600).stdout)


def distinct_requests(tmp, max_tokens=16, text_only=("Hello there",)):
    """[(chat body, reference)] for different pictures and questions (plus text-only prompts); the
    references are checked to differ, so an answer delivered to the wrong request cannot pass."""
    out = []
    for i, (shape, color, bg, w, h, q) in enumerate(DISTINCT):
        path = make_image(os.path.join(tmp, "distinct%d.%s" % (i, "png" if i % 2 else "jpg")), width=w, height=h,
                          shape=shape, color=color, background=bg)
        out.append((chat_body(q, [path], max_tokens=max_tokens, temperature=0), reference([path], q, max_tokens)))
    for t in text_only:
        out.append((chat_body(t, max_tokens=max_tokens, temperature=0), reference([], t, max_tokens)))
    texts = [ref["text"] for _, ref in out]
    assert len(set(texts)) >= len(texts) - 1, ("references too alike to tell answers apart", texts)
    return out


def check_answer(status, r, ref, where=""):
    """A non-streaming chat answer equals its own reference (text, prompt and completion tokens)."""
    assert status == 200, (where, status, r)
    got = r["choices"][0]["message"]["content"]
    assert got == ref["text"], "%s: answer %r, its reference %r" % (where, got, ref["text"])
    assert r["usage"]["prompt_tokens"] == ref["prompt_tokens"], (where, r["usage"], ref["prompt_tokens"])
    assert r["usage"]["completion_tokens"] == len(ref["token_ids"]), (where, r["usage"], len(ref["token_ids"]))
