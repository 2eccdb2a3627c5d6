"""Scaling a tier live, and how the router spreads work.

test_ties_spread_light_load: with two idle workers per tier, a light load (one request at a time)
goes to both workers of every tier, not all to the first (ties between equally loaded workers
take turns).

test_scale_each_tier_live: under a steady load (client threads sending image requests), a second
and a third encoder, prefill and decode worker started by hand receive work within seconds; then
one worker of each tier is stopped with SIGTERM while it holds requests: it drains (the routers
stop sending it work, it finishes what it holds, it exits 0 once every router has released it) and
not one request fails.

test_sigterm_drains_without_losing_a_request: an encoder holding a request gets SIGTERM under load:
no request fails, the worker exits 0 after the routers released it, well before --drain-timeout.

test_second_sigterm_exits_at_once: a draining worker whose request cannot finish (it waits for a
stopped encoder) keeps running; a second SIGTERM exits at once; the router retries the request on
a prefill started afterwards and it is answered.
"""
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import Cluster, chat_body, make_image, run_tests, wait_for  # noqa: E402

WORKER_TIMEOUT = 10.0   # a drained worker is released at once; a long ASan prefill must not look dead
SHAPES = [(s, c, b) for s in ("circle", "square", "triangle") for c in ("red", "green", "blue", "yellow")
          for b in ("white", "black")]


def images(tmp, n):
    """n different small images (no two alike: the router's cache affinity plays no part)."""
    return [make_image(os.path.join(tmp, "img%d.jpg" % i), width=96 + 8 * (i // len(SHAPES)), height=96,
                       shape=SHAPES[i % len(SHAPES)][0], color=SHAPES[i % len(SHAPES)][1],
                       background=SHAPES[i % len(SHAPES)][2]) for i in range(n)]


def status(c):
    st, _, data = c.request("GET", "/status")
    assert st == 200, st
    return json.loads(data)


def completed(c):
    return {w["id"]: w["completed"] for w in status(c)["workers"]}


class Load:
    """Client threads sending image requests back to back until stopped; every answer recorded
    as (t_sent, t_done, status, error message or None)."""

    def __init__(self, c, imgs, clients=3):
        self.c, self.imgs, self.results, self.stop_flag = c, imgs, [], False
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run, args=(k,), daemon=True) for k in range(clients)]
        for t in self.threads:
            t.start()

    def run(self, k):
        i = k
        while not self.stop_flag:
            body = chat_body("What is in the image?", [self.imgs[i % len(self.imgs)]], max_tokens=4, temperature=0)
            i += len(self.threads)
            t0 = time.time()
            try:
                st, r = self.c.post_json("/v1/chat/completions", body, timeout=120)
                err = None if st == 200 else (r.get("error", {}).get("message") if isinstance(r, dict) else str(r))
                if st == 200:
                    assert r["choices"][0]["message"]["content"], r
            except Exception as e:  # noqa: BLE001 - a dropped connection is a failure we count
                st, err = -1, repr(e)
            with self.lock:
                self.results.append((t0, time.time(), st, err))

    def since(self, t):
        with self.lock:
            return [x for x in self.results if x[0] >= t]

    def finish(self):
        self.stop_flag = True
        for t in self.threads:
            t.join(180)


def test_ties_spread_light_load():
    tmp = tempfile.mkdtemp(prefix="prism-scale-")
    imgs = images(tmp, 6)
    with Cluster(encoders=2, prefills=2, decodes=2) as c:
        c.wait_ready()
        for img in imgs:  # one at a time: every worker idle at each pick
            st, r = c.post_json("/v1/chat/completions", chat_body("What is in the image?", [img], max_tokens=2))
            assert st == 200, (st, r)
        done = completed(c)
        for tier in ("encoder", "prefill", "decode"):
            got = {k: v for k, v in done.items() if k.startswith(tier)}
            assert len(got) == 2 and all(v >= 1 for v in got.values()), ("%s: every request on one worker" % tier, done)
        enc = sorted(v for k, v in done.items() if k.startswith("encoder"))
        assert enc == [3, 3], ("idle encoders take turns", done)


def scale_cluster():
    return Cluster(encoders=1, prefills=1, decodes=1,
                   router_args=["--worker-timeout", str(WORKER_TIMEOUT)],
                   common_worker_args=["--heartbeat-interval", "0.2"],
                   worker_args={"encoder_worker": ["--embedding-cache-bytes", "0"]})


def sigterm(c, name):
    p = c.procs.pop(name)
    p.send_signal(signal.SIGTERM)
    p.wait(60)
    return p.returncode


def test_scale_each_tier_live():
    tmp = tempfile.mkdtemp(prefix="prism-scale-")
    imgs = images(tmp, 120)   # a request never repeats an image while the test runs
    report = []
    with scale_cluster() as c:
        c.wait_ready()
        load = Load(c, imgs)
        try:
            wait_for(lambda: len(load.since(0)) >= 3, 60, "the load running")
            kinds = {"encoder": "encoder_worker", "prefill": "prefill_worker", "decode": "decode_worker"}
            for tier, kind in kinds.items():
                t0 = time.time()
                for k in (1, 2):
                    c.start_worker("%s-%d" % (tier, k), kind)
                news = ["%s-1" % tier, "%s-2" % tier]
                got = wait_for(lambda: (lambda d: all(d.get(n, 0) >= 1 for n in news) and d)(completed(c)), 60,
                               "new %s workers receive work" % tier, interval=0.05)
                report.append("%s: 2nd and 3rd worker took work %.2fs after start (completed %s)"
                              % (tier, time.time() - t0, {n: got[n] for n in news}))
            for tier in kinds:
                victim = "%s-2" % tier
                wait_for(lambda: next(w for w in status(c)["workers"] if w["id"] == victim)["inflight"] > 0, 60,
                         "%s holding a request" % victim, interval=0.01)
                t_kill = time.time()
                rc = sigterm(c, victim)
                t_exit = time.time()
                assert rc == 0, ("a worker stopped by SIGTERM exits 0", rc)
                log = c.log(victim, tail=0)
                assert "draining" in log and "drained in" in log, log[-2000:]
                wait_for(lambda: len(load.since(t_exit)) >= 3, 60, "requests served after the exit")
                failed = [x for x in load.results if x[2] != 200]
                assert not failed, ("requests lost to a SIGTERM of a %s worker" % tier, failed)
                report.append("%s: SIGTERM with requests on it -> drained and exited after %.2fs, none failed"
                              % (tier, t_exit - t_kill))
        finally:
            load.finish()
        bad = [x for x in load.results if x[2] not in (200, 503)]
        assert not bad, ("only clean answers", bad)
        ok = [x for x in load.results if x[2] == 200]
        assert len(ok) >= 10, len(ok)
        for line in report:
            print("  " + line)


def test_sigterm_drains_without_losing_a_request():
    tmp = tempfile.mkdtemp(prefix="prism-scale-")
    imgs = images(tmp, 8)
    with scale_cluster() as c:
        c.start_worker("encoder-1", "encoder_worker")
        c.expected["encoders"] = 2
        c.wait_ready()
        load = Load(c, imgs, clients=4)
        try:
            wait_for(lambda: any(w["id"] == "encoder-1" and w["inflight"] > 0 for w in status(c)["workers"]), 60,
                     "encoder-1 holding a request", interval=0.01)
            t_kill = time.time()
            sigterm(c, "encoder-1")
            wait_for(lambda: all(w["id"] != "encoder-1" for w in status(c)["workers"]), WORKER_TIMEOUT + 10,
                     "encoder-1 gone", interval=0.05)
            wait_for(lambda: len(load.since(t_kill)) >= 4, 60, "more load")
        finally:
            load.finish()
        failed = [x for x in load.results if x[2] != 200]
        assert not failed, ("requests lost to a SIGTERM", failed)
        assert "drained in" in c.log("encoder-1", tail=0), c.log("encoder-1")


def test_second_sigterm_exits_at_once():
    """A drain waits for what the routers hold: a prefill whose request waits for embeddings from a
    stopped encoder (SIGSTOP) keeps running after SIGTERM; a second SIGTERM ends it at once; the
    request (no token yet) is retried on a new prefill when the router drops the old one."""
    tmp = tempfile.mkdtemp(prefix="prism-scale-")
    img = images(tmp, 1)[0]
    with Cluster(encoders=1, prefills=1, decodes=1, router_args=["--worker-timeout", "8"],
                 common_worker_args=["--heartbeat-interval", "0.2"]) as c:
        c.wait_ready()
        enc = c.procs["encoder-0"]
        enc.send_signal(signal.SIGSTOP)
        out = {}
        t = threading.Thread(target=lambda: out.update(r=c.post_json(
            "/v1/chat/completions", chat_body("What is in the image?", [img], max_tokens=4), timeout=120)))
        t.start()
        try:
            wait_for(lambda: next(w for w in status(c)["workers"] if w["id"] == "prefill-0")["inflight"] > 0, 30,
                     "the prefill holding the request", interval=0.01)
            p = c.procs.pop("prefill-0")
            p.send_signal(signal.SIGTERM)
            wait_for(lambda: "draining" in c.log("prefill-0", tail=0), 30, "the prefill draining")
            try:
                p.wait(2)
                raise AssertionError("the prefill exited with a request held on it:\n" + c.log("prefill-0"))
            except subprocess.TimeoutExpired:
                pass
            assert next(w for w in status(c)["workers"] if w["id"] == "prefill-0")["draining"]
            st, _, m = c.request("GET", "/metrics")
            assert st == 200 and 'prism:worker_draining{tier="prefill",worker="prefill-0"} 1' in m.decode(), st
            t0 = time.time()
            p.send_signal(signal.SIGTERM)
            p.wait(10)
            print("  second SIGTERM -> exit in %.2fs" % (time.time() - t0))
        finally:
            enc.send_signal(signal.SIGCONT)
        c.start_worker("prefill-1", "prefill_worker")
        t.join(130)
        st, r = out["r"]
        assert st == 200 and r["choices"][0]["message"]["content"], ("retried on the new prefill", st, r)


def test_text_request_not_blocked_by_a_missing_encoder():
    tmp = tempfile.mkdtemp(prefix="prism-scale-")
    img = images(tmp, 1)[0]
    with Cluster(encoders=1, prefills=1, decodes=1, router_args=["--worker-timeout", "1"],
                 common_worker_args=["--heartbeat-interval", "0.2"]) as c:
        c.wait_ready()
        enc = c.procs["encoder-0"]
        enc.send_signal(signal.SIGSTOP)   # a hung encoder: dropped after --worker-timeout
        try:
            out = {}
            t = threading.Thread(target=lambda: out.update(r=c.post_json(
                "/v1/chat/completions", chat_body("What is in the image?", [img], max_tokens=4), timeout=120)))
            t.start()
            wait_for(lambda: all(w["tier"] != "encoder" for w in status(c)["workers"]), 30, "the encoder dropped")
            st, r = c.post_json("/v1/chat/completions", chat_body("Hello", max_tokens=4), timeout=20)
            assert st == 200, ("a text request needs no encoder", st, r)
        finally:
            enc.send_signal(signal.SIGCONT)
            t.join(130)


if __name__ == "__main__":
    sys.exit(run_tests([test_ties_spread_light_load, test_scale_each_tier_live,
                        test_sigterm_drains_without_losing_a_request, test_second_sigterm_exits_at_once,
                        test_text_request_not_blocked_by_a_missing_encoder]))
