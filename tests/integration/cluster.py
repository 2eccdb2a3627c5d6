"""Test harness: starts a real Prism cluster (router + workers) on loopback and talks HTTP to it.

Only the Python standard library is used, so CI needs nothing beyond python3.
"""
import base64
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.environ.get("PRISM_SOURCE_DIR") or os.path.abspath(os.path.join(os.path.dirname(__file__), "../.."))
BUILD = os.environ.get("PRISM_BINARY_DIR") or os.path.join(ROOT, "build")
MODEL = os.path.join(ROOT, "models", "prism-tiny-llava")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name):
    sub = {"router": "router", "encoder_worker": "encoder_worker", "prefill_worker": "prefill_worker",
           "decode_worker": "decode_worker", "prism_imgtool": "tools", "prism_generate": "tools",
           "prism_keygen": "tools", "prism_peer_probe": "tests/integration"}[name]
    return os.path.join(BUILD, sub, name)


def make_keys(directory):
    """A cluster's CURVE key directory (prism_keygen): one keypair per role."""
    subprocess.run([binary("prism_keygen"), "--out", directory], check=True, stdout=subprocess.DEVNULL)
    return directory


class Cluster:
    """curve=True (the default, as in deploy/launch.sh): internal links authenticated with a fresh key
    directory (self.keys); curve=False runs every process with --insecure-no-curve."""

    def __init__(self, encoders=1, prefills=1, decodes=1, model=MODEL, router_args=(), worker_args=None,
                 log_dir=None, curve=True):
        self.port = free_port()
        self.ctl = "tcp://127.0.0.1:%d" % free_port()
        self.model = model
        self.procs = {}
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="prism-it-")
        self.keys = make_keys(os.path.join(self.log_dir, "curve-keys")) if curve else None
        sec = ["--curve-keys", self.keys] if curve else ["--insecure-no-curve"]
        self.sec = sec
        worker_args = worker_args or {}
        self._start("router", "router", ["--model-path", model, "--port", str(self.port),
                                         "--control-endpoint", self.ctl, *sec, *router_args])
        for kind, n in (("encoder_worker", encoders), ("prefill_worker", prefills), ("decode_worker", decodes)):
            for i in range(n):
                name = "%s-%d" % (kind.split("_")[0], i)
                self._start(name, kind, ["--model-path", model, "--router", self.ctl, "--worker-id", name, *sec,
                                         *worker_args.get(kind, ())])
        self.t_start = time.time()

    def start_worker(self, name, kind, args=()):
        """Starts one more worker (e.g. a replacement) with the cluster's keys."""
        self._start(name, kind, ["--model-path", self.model, "--router", self.ctl, "--worker-id", name, *self.sec,
                                 *args])

    def _start(self, name, kind, args):
        log = open(os.path.join(self.log_dir, name + ".log"), "wb")
        self.procs[name] = subprocess.Popen([binary(kind), *args], stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout=60):
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError("%s exited during start-up (rc %s):\n%s" % (name, p.returncode, self.log(name)))
            try:
                status, _, _ = self.request("GET", "/ready")
                if status == 200:
                    return time.time() - self.t_start
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("cluster not ready after %ss" % timeout)

    def log(self, name):
        with open(os.path.join(self.log_dir, name + ".log"), "rb") as f:
            return f.read().decode("utf-8", "replace")[-4000:]

    def alive(self):
        return {n: p.poll() is None for n, p in self.procs.items()}

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    # ---- HTTP ----
    def request(self, method, path, body=None, headers=None, timeout=120):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
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

    def stream(self, path, body, timeout=120):
        """POSTs with stream=true; returns (status, [parsed events], saw_done)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
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
    subprocess.run(args, check=True)
    return path


def chat_body(text, images=(), **kw):
    content = [{"type": "image_url", "image_url": {"url": image_url(p)}} for p in images]
    content.append({"type": "text", "text": text})
    body = {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": content}]}
    body.update(kw)
    return body


def run_tests(tests):
    """Runs test functions in order; prints one line each and a closing 'N passed, N failed'."""
    passed = failed = 0
    for t in tests:
        t0 = time.time()
        try:
            t()
            passed += 1
            print("PASS %-45s %.2fs" % (t.__name__, time.time() - t0), flush=True)
        except Exception as e:  # noqa: BLE001 - report every failure and go on
            failed += 1
            import traceback
            print("FAIL %-45s %s" % (t.__name__, e), flush=True)
            traceback.print_exc()
    print("%d passed, %d failed" % (passed, failed))
    return 1 if failed else 0
