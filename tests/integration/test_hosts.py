"""Prism across hosts: network namespaces stand in for machines.

Needs root and `ip netns` (iproute2); skips (77) cleanly without them. Every namespace, veth and
/etc/netns entry made here has this run's own name and is removed at the end.

test_router_name_means_every_router: one host whose DNS name `prism-routers` (an /etc/hosts file,
as `ip netns exec` mounts /etc/netns/NS/hosts) resolves to the addresses of two routers; workers
given `--router tcp://prism-routers:PORT` register with both; a third router added to the name gets
the workers within seconds, and a router removed from it is disconnected (and drops them).

test_three_hosts_and_a_cut_link: a router host, an encoder host and a prefill+decode host joined by
veth links to a bridge. Workers bind every interface (--host 0.0.0.0) and advertise their host's
address (--advertise-host); the encoder finds the router by name. A full image request crosses all
of them. Cutting the encoder host's link is noticed (the router drops the encoder after
--worker-timeout; the image request it held waits in the router's queue for an encoder); healing
it brings the encoder back and the held request is answered. Then with a
second encoder on the prefill host: a request held by the cut encoder is retried on the other one
and answered, and new requests are served by the other one.

Every internal link is authenticated (CURVE, one key directory made by prism_keygen shared by the
hosts, as a Secret or a config-management push would be): a worker on the encoder host holding
another cluster's keys never registers, and the router counts the refused handshakes.
"""
import ctypes
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(__file__))
from cluster import (MODEL, SANITIZER_MARKS, binary, chat_body, make_image, make_keys, reference, run_tests,  # noqa: E402
                     wait_for)

LIBC = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
TAG = "p%d" % (os.getpid() % 100000)   # this run's names: several runs may share the machine
WORKER_TIMEOUT = 2.0


def skip(why):
    print("SKIP: " + why)
    sys.exit(77)


def sh(*args, check=True):
    p = subprocess.run(list(args), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(args), p.stderr.strip()))
    return p


def netns_usable():
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip"):
        return "no `ip` (iproute2)"
    probe = TAG + "-probe"
    if sh("ip", "netns", "add", probe, check=False).returncode != 0:
        return "`ip netns add` is not permitted here"
    sh("ip", "netns", "del", probe, check=False)
    return None


@contextmanager
def in_netns(ns):
    """Runs the block with this thread in namespace ns: sockets made inside stay there."""
    me = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    fd = os.open("/var/run/netns/" + ns, os.O_RDONLY)
    try:
        if LIBC.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns " + ns)
        yield
    finally:
        LIBC.setns(me, CLONE_NEWNET)
        os.close(fd)
        os.close(me)


class Hosts:
    """Namespaces joined through a bridge, plus the processes started in them."""

    def __init__(self):
        self.namespaces, self.procs, self.etc = [], {}, []
        self.log_dir = tempfile.mkdtemp(prefix="prism-hosts-")
        self.keys = make_keys(os.path.join(self.log_dir, "curve-keys"))
        self.bridge_ns = None

    def add_ns(self, name, hosts_lines=()):
        ns = "%s-%s" % (TAG, name)
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        if hosts_lines:
            d = "/etc/netns/" + ns
            os.makedirs(d, exist_ok=True)
            self.etc.append(d)
            self.write_hosts(ns, hosts_lines)
        return ns

    def write_hosts(self, ns, lines):
        """Rewrites the namespace's hosts file in place: processes started earlier see it (the
        file is bind-mounted into them, so its inode must stay)."""
        path = "/etc/netns/%s/hosts" % ns
        mode = "r+" if os.path.exists(path) else "w"
        with open(path, mode) as f:
            f.seek(0)
            f.write("127.0.0.1 localhost\n" + "".join(l + "\n" for l in lines))
            f.truncate()

    def bridge(self):
        self.bridge_ns = self.add_ns("br")
        sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")

    def join(self, ns, i, addr):
        """veth from ns (eth0, addr/24) to the bridge (port p<i>)."""
        tmp = "%sv%d" % (TAG, i)
        sh("ip", "link", "add", tmp, "netns", ns, "type", "veth", "peer", "name", "p%d" % i, "netns", self.bridge_ns)
        sh("ip", "-n", ns, "link", "set", tmp, "name", "eth0")
        sh("ip", "-n", ns, "addr", "add", addr + "/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", self.bridge_ns, "link", "set", "p%d" % i, "master", "br0")
        sh("ip", "-n", self.bridge_ns, "link", "set", "p%d" % i, "up")

    def link(self, i, up):
        sh("ip", "-n", self.bridge_ns, "link", "set", "p%d" % i, "up" if up else "down")

    def start(self, name, ns, kind, args, keys=None):
        """keys: a CURVE key directory other than the cluster's (an intruder's)."""
        log = open(os.path.join(self.log_dir, name + ".log"), "ab")
        self.procs[name] = subprocess.Popen(["ip", "netns", "exec", ns, binary(kind), "--curve-keys",
                                             keys or self.keys, *args], stdout=log, stderr=subprocess.STDOUT)

    def stop(self, name):
        p = self.procs.pop(name)
        p.terminate()
        p.wait(30)

    def log(self, name):
        with open(os.path.join(self.log_dir, name + ".log"), "rb") as f:
            return f.read().decode("utf-8", "replace")

    def check_alive(self):
        for n, p in self.procs.items():
            if p.poll() is not None:
                raise AssertionError("%s exited (rc %s):\n%s" % (n, p.returncode, self.log(n)[-3000:]))

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in self.namespaces:
            sh("ip", "netns", "del", ns, check=False)
        for d in self.etc:
            shutil.rmtree(d, ignore_errors=True)
        bad = [n for n in self.procs if any(m in self.log(n) for m in SANITIZER_MARKS)]
        assert not bad, "sanitizer report in %s (logs in %s)" % (bad, self.log_dir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def request(ns, host, port, method, path, body=None, timeout=60):
    with in_netns(ns):
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            data = r.read()
            try:
                data = json.loads(data)
            except ValueError:
                pass
            return r.status, dict(r.getheaders()), data
        finally:
            conn.close()


def metric(ns, host, port, name):
    st, _, text = request(ns, host, port, "GET", "/metrics")
    assert st == 200, st
    for line in text.decode().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no metric " + name)


def ready(ns, host, port):
    try:
        st, _, d = request(ns, host, port, "GET", "/ready", timeout=5)
    except OSError:
        return None
    return d if isinstance(d, dict) else None


WORKER = ["--model-path", MODEL, "--heartbeat-interval", "0.3"]
ROUTER = ["--model-path", MODEL, "--worker-timeout", str(WORKER_TIMEOUT), "--request-timeout", "120"]


def test_router_name_means_every_router():
    why = netns_usable()
    if why:
        skip(why)
    with Hosts() as h:
        ns = h.add_ns("dns", ["127.0.0.1 prism-routers", "127.0.0.2 prism-routers"])
        for i in (1, 2, 3):
            h.start("router-%d" % i, ns, "router", ROUTER + ["--host", "127.0.0.%d" % i, "--port", "8000",
                                                             "--control-endpoint", "tcp://127.0.0.%d:8100" % i])
        name = ["--router", "tcp://prism-routers:8100", "--router-resolve-interval", "0.3"]
        for kind in ("encoder", "prefill", "decode"):
            h.start(kind, ns, kind + "_worker", WORKER + name + ["--worker-id", kind])

        def counts(i):
            d = ready(ns, "127.0.0.%d" % i, 8000)
            return d and (d["encoders"], d["prefills"], d["decodes"])
        for i in (1, 2):
            wait_for(lambda: counts(i) == (1, 1, 1), 120, "router %d gets every worker" % i, interval=0.1)
            h.check_alive()
        assert counts(3) == (0, 0, 0), "router 3 is not in the name yet: %r" % (counts(3),)

        # a router joins the name: every worker connects to it within a few resolve intervals
        t0 = time.time()
        h.write_hosts(ns, ["127.0.0.1 prism-routers", "127.0.0.2 prism-routers", "127.0.0.3 prism-routers"])
        wait_for(lambda: counts(3) == (1, 1, 1), 20, "router 3 gets every worker", interval=0.05)
        joined = time.time() - t0
        for kind in ("encoder", "prefill", "decode"):
            assert "router tcp://127.0.0.3:8100 joined the router name" in h.log(kind), h.log(kind)[-2000:]

        # a router leaves the name: the workers disconnect from it, it drops them, the others serve
        t0 = time.time()
        h.write_hosts(ns, ["127.0.0.2 prism-routers", "127.0.0.3 prism-routers"])
        wait_for(lambda: all("tcp://127.0.0.1:8100 (" in h.log(k) and "left the router name" in h.log(k)
                             for k in ("encoder", "prefill", "decode")), 20, "workers leave router 1")
        left = time.time() - t0
        wait_for(lambda: counts(1) == (0, 0, 0), 20, "router 1 drops the workers", interval=0.1)
        img = make_image(os.path.join(h.log_dir, "a.jpg"), width=200, height=150, shape="circle", color="red",
                         background="white")
        for i in (2, 3):
            st, _, r = request(ns, "127.0.0.%d" % i, 8000, "POST", "/v1/chat/completions",
                               chat_body("What is in the image?", [img], max_tokens=6, temperature=0))
            assert st == 200 and r["choices"][0]["message"]["content"], (i, st, r)
        h.check_alive()
        print("router joined the name -> workers registered in %.2fs; left -> disconnected in %.2fs" % (joined, left))


def test_three_hosts_and_a_cut_link():
    why = netns_usable()
    if why:
        skip(why)
    tmp = tempfile.mkdtemp(prefix="prism-hosts-img-")
    img = make_image(os.path.join(tmp, "a.jpg"), width=320, height=240, shape="square", color="green",
                     background="black")
    q = "What is in the image?"
    ref = reference([img], q, 8)
    body = chat_body(q, [img], max_tokens=8, temperature=0)
    with Hosts() as h:
        h.bridge()
        rt = h.add_ns("router")
        enc = h.add_ns("enc", ["10.77.0.1 prism-router"])     # the encoder host finds the router by name
        pd = h.add_ns("pd")
        for i, (ns, addr) in enumerate(((rt, "10.77.0.1"), (enc, "10.77.0.2"), (pd, "10.77.0.3"))):
            h.join(ns, i, addr)
        h.start("router", rt, "router", ROUTER + ["--host", "0.0.0.0", "--port", "8000",
                                                  "--control-endpoint", "tcp://0.0.0.0:8100"])
        h.start("encoder", enc, "encoder_worker", WORKER + ["--router", "tcp://prism-router:8100",
                                                            "--worker-id", "enc-host-encoder",
                                                            "--embedding-cache-bytes", "0"])
        # bind every interface, advertise the host's address (as behind NAT or in a container)
        h.start("prefill", pd, "prefill_worker", WORKER + ["--router", "tcp://10.77.0.1:8100", "--worker-id", "prefill",
                                                           "--host", "0.0.0.0", "--advertise-host", "10.77.0.3",
                                                           "--data-port", "9100"])
        h.start("decode", pd, "decode_worker", WORKER + ["--router", "tcp://10.77.0.1:8100", "--worker-id", "decode",
                                                         "--host", "10.77.0.3"])
        R = (rt, "10.77.0.1", 8000)

        def counts():
            d = ready(*R)
            return d and (d["encoders"], d["prefills"], d["decodes"])
        wait_for(lambda: counts() == (1, 1, 1), 120, "every worker registered across hosts", interval=0.1)
        h.check_alive()
        assert "data endpoint tcp://0.0.0.0:9100 advertised as tcp://10.77.0.3:9100" in h.log("prefill")

        st, _, r = request(*R, "POST", "/v1/chat/completions", body)
        assert st == 200, (st, r)
        assert r["choices"][0]["message"]["content"] == ref["text"], (r, ref)

        # the links that cross hosts are authenticated: an encoder holding another cluster's keys,
        # on the encoder host, is refused at the handshake and never registers
        refused0 = metric(*R, "prism:router_peer_auth_failures_total")
        other = make_keys(os.path.join(h.log_dir, "other-cluster-keys"))
        h.start("intruder", enc, "encoder_worker", WORKER + ["--router", "tcp://prism-router:8100",
                                                             "--worker-id", "intruder"], keys=other)
        wait_for(lambda: metric(*R, "prism:router_peer_auth_failures_total") > refused0, 60,
                 "the router refuses the other cluster's encoder", interval=0.1)
        assert counts() == (1, 1, 1), counts()
        h.check_alive()
        h.stop("intruder")

        # cut the encoder host's link with an image request on the encoder
        held = {}
        t = threading.Thread(target=lambda: held.update(r=request(*R, "POST", "/v1/chat/completions", body,
                                                                  timeout=120)))
        h.link(1, False)
        t0 = time.time()
        t.start()
        wait_for(lambda: counts() == (0, 1, 1), WORKER_TIMEOUT + 10, "the encoder dropped", interval=0.05)
        noticed = time.time() - t0
        # (a text request sent now waits behind the image request: integration_scale_known_
        # test_text_request_not_blocked_by_a_missing_encoder)
        assert "r" not in held, ("the image request waits for an encoder", held)

        # heal it: the encoder registers again, and the request held through the cut is answered
        h.link(1, True)
        t0 = time.time()
        wait_for(lambda: counts() == (1, 1, 1), 30, "the encoder back", interval=0.05)
        back = time.time() - t0
        t.join(120)
        st, _, r = held["r"]
        assert st == 200 and r["choices"][0]["message"]["content"] == ref["text"], (st, r)
        st, _, r = request(*R, "POST", "/v1/chat/completions", body)
        assert st == 200 and r["choices"][0]["message"]["content"] == ref["text"], (st, r)

        # a second encoder on the prefill host: cut the first one's link again with a request on it
        h.start("encoder-2", pd, "encoder_worker", WORKER + ["--router", "tcp://10.77.0.1:8100",
                                                             "--worker-id", "pd-host-encoder",
                                                             "--embedding-cache-bytes", "0"])
        wait_for(lambda: counts() == (2, 1, 1), 60, "the second encoder registered", interval=0.1)
        h.link(1, False)
        # Requests one at a time: equally loaded encoders take turns, so within two requests one
        # lands on the cut encoder; the router retries it on the other one when it drops the first.
        retried0 = metric(*R, "prism:requests_retried_total")
        for i in range(3):
            st, hdr, r = request(*R, "POST", "/v1/chat/completions", body)
            assert st == 200 and r["choices"][0]["message"]["content"] == ref["text"], (st, r)
            if metric(*R, "prism:requests_retried_total") > retried0:
                break
        else:
            raise AssertionError("no request reached the cut encoder")
        wait_for(lambda: counts() == (1, 1, 1), 10, "the cut encoder dropped")
        for _ in range(3):
            st, _, r = request(*R, "POST", "/v1/chat/completions", body)
            assert st == 200, ("the other encoder serves", st, r)
        h.link(1, True)
        wait_for(lambda: counts() == (2, 1, 1), 30, "the encoder back again", interval=0.05)
        h.check_alive()
        print("cut noticed (encoder dropped) after %.2fs; healed link -> encoder back in %.2fs, the held request "
              "answered" % (noticed, back))


if __name__ == "__main__":
    sys.exit(run_tests([test_router_name_means_every_router, test_three_hosts_and_a_cut_link]))
