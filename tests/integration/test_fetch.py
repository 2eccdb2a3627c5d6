"""Image URLs fetched by the router's fetcher (router/fetch.h) from real servers on real addresses.

Needs root, `ip netns` (iproute2), nginx and openssl; skips (77) cleanly without them. Every
namespace, veth and /etc/netns entry made here has this run's own name and is removed at the end.

Two network namespaces joined by a veth pair. The client namespace runs prism_fetch_probe (the
fetcher alone, on its own libuv loop, printing one JSON line per answer) and an nginx on its
loopback (127.0.0.1 and ::1, port 8080). The server namespace holds the addresses the rules judge:

    198.51.100.2, 2001:db8::2   TEST-NET / documentation: not private by the rules, so "public"
    10.9.0.2                    private
    100.64.0.2                  shared (carrier-grade NAT)
    169.254.169.254             cloud metadata
    fd00::2                     unique-local

and serves files from nginx over http (80) and https with HTTP/2 (443; a CA and server certificate
made here with openssl, given to the probe with --media-ca-file), plus a small Python server (81)
that misbehaves: stalls, an endless body, a Content-Length lie. Names come from the client's
/etc/netns hosts file (`ip netns exec` mounts it as /etc/hosts): public.test, private.test,
metadata.test, cgnat.test, loop.test, loop6.test, ula.test, public6.test, mixed.test (a private and
a public address).

Refusals are checked on the servers' side too: a refused address never sees a request (nginx
access logs).
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib

sys.path.insert(0, os.path.dirname(__file__))
from cluster import BUILD, SANITIZER_MARKS, run_tests  # noqa: E402

TAG = "pf%d" % (os.getpid() % 100000)
CNS, SNS = TAG + "-c", TAG + "-s"
PROBE = os.path.join(BUILD, "tests", "integration", "prism_fetch_probe")
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)

HOSTS = """127.0.0.1 localhost
::1 localhost
198.51.100.2 public.test
198.51.100.2 other.test
2001:db8::2 public6.test
10.9.0.2 private.test
100.64.0.2 cgnat.test
169.254.169.254 metadata.test
127.0.0.1 loop.test
::1 loop6.test
fd00::2 ula.test
10.9.0.2 mixed.test
198.51.100.2 mixed.test
"""

BAD_SERVER = r'''
import socket, sys, threading, time
def handle(c):
    try:
        req = b""
        while b"\r\n\r\n" not in req:
            d = c.recv(4096)
            if not d:
                return
            req += d
        path = req.split(b" ")[1].decode()
        if path.startswith("/stall"):
            time.sleep(120)
        elif path.startswith("/endless"):
            c.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Type: image/jpeg\r\n\r\n")
            chunk = b"\xff" * 65536
            while True:
                c.sendall(chunk)
        elif path.startswith("/lie"):
            c.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 100000\r\n\r\n" + b"y" * 1000)
        elif path.startswith("/drip"):
            c.sendall(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 100000\r\n\r\n")
            while True:
                c.sendall(b"z")
                time.sleep(0.2)
    except OSError:
        pass
    finally:
        c.close()
s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("::", 81))
s.listen(64)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    threading.Thread(target=handle, args=(c,), daemon=True).start()
'''


def skip(why):
    print("SKIP: " + why)
    sys.exit(77)


def sh(*args, check=True):
    p = subprocess.run(list(args), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError("%s: %s" % (" ".join(args), p.stderr.strip()))
    return p


def usable():
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip"):
        return "no `ip` (iproute2)"
    if not NGINX:
        return "nginx is not installed (deploy/install-deps.sh --test)"
    if not shutil.which("openssl"):
        return "openssl is not installed (deploy/install-deps.sh --test)"
    if not os.path.exists(PROBE):
        return "prism_fetch_probe is not built (%s)" % PROBE
    probe = TAG + "-probe"
    if sh("ip", "netns", "add", probe, check=False).returncode != 0:
        return "`ip netns add` is not permitted here"
    sh("ip", "netns", "del", probe, check=False)
    return None


NGINX_CONF = """
user root;
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 512; }}
http {{
    log_format fetch '$server_port $request_uri $status $body_bytes_sent';
    access_log {dir}/access.log fetch;
    client_body_temp_path {dir}/tmp/body;
    proxy_temp_path {dir}/tmp/proxy;
    fastcgi_temp_path {dir}/tmp/fastcgi;
    uwsgi_temp_path {dir}/tmp/uwsgi;
    scgi_temp_path {dir}/tmp/scgi;
    types {{ image/jpeg jpg; application/octet-stream bin; }}
    server {{
        {listen}
        root {www};
        location = /r1 {{ return 302 /img.jpg; }}
        location = /r2 {{ return 301 /r1; }}
        location = /r3 {{ return 307 r2; }}
        location = /r4 {{ return 308 /r3; }}
        location = /loop {{ return 302 /loop; }}
        location = /to-private {{ return 302 http://private.test/img.jpg; }}
        location = /to-meta {{ return 302 http://169.254.169.254/img.jpg; }}
        location = /to-loopback {{ return 302 http://127.0.0.1:8080/img.jpg; }}
        location = /to-file {{ return 302 file:///etc/passwd; }}
        location = /to-https {{ return 302 https://public.test/img.jpg; }}
        location = /nostore.jpg {{ add_header Cache-Control no-store; }}
        location /slow/ {{ limit_rate 20k; }}
    }}
}}
"""


class Net:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="prism-fetch-")
        self.www = os.path.join(self.dir, "www")
        self.procs = {}
        self.made_ns = []
        self.etc = "/etc/netns/" + CNS

    # -- set-up --
    def files(self):
        os.makedirs(os.path.join(self.www, "slow"))
        rnd = os.urandom
        self.content = {
            "img.jpg": rnd(200_000),
            "large.jpg": rnd(8 << 20),
            "nostore.jpg": rnd(50_000),
            "slow/s.bin": rnd(400_000),   # 20 s at 20 KB/s: refused as too slow long before
            "slow/ok.bin": rnd(30_000),
        }
        for i in range(8):
            self.content["slow/p%d.bin" % i] = rnd(20_000)
        for name, data in self.content.items():
            with open(os.path.join(self.www, name), "wb") as f:
                f.write(data)
        with open(os.path.join(self.www, "big.bin"), "wb") as f:
            f.truncate(30 << 20)   # larger than the default 20 MiB limit (sparse)
        # file:// material: an allowed directory with an image, a link out and a link in
        self.media = os.path.join(self.dir, "media")
        os.makedirs(self.media)
        with open(os.path.join(self.media, "local.jpg"), "wb") as f:
            f.write(self.content["img.jpg"])
        os.symlink("/etc/passwd", os.path.join(self.media, "out.jpg"))
        os.symlink("local.jpg", os.path.join(self.media, "in.jpg"))

    def certs(self):
        d = self.dir
        run = lambda *a: sh("openssl", *a)  # noqa: E731
        run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
            "-subj", "/CN=prism test CA", "-keyout", d + "/ca.key", "-out", d + "/ca.crt")
        run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-subj", "/CN=public.test", "-keyout", d + "/server.key", "-out", d + "/server.csr")
        with open(d + "/san.ext", "w") as f:
            f.write("subjectAltName=DNS:public.test,DNS:private.test,DNS:mixed.test,DNS:public6.test,"
                    "IP:198.51.100.2,IP:10.9.0.2\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n")
        run("x509", "-req", "-in", d + "/server.csr", "-CA", d + "/ca.crt", "-CAkey", d + "/ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", d + "/san.ext", "-out", d + "/server.crt")

    def network(self):
        for ns in (CNS, SNS):
            sh("ip", "netns", "add", ns)
            self.made_ns.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "link", "add", TAG + "a", "netns", CNS, "type", "veth", "peer", "name", TAG + "b", "netns", SNS)
        sh("ip", "-n", CNS, "link", "set", TAG + "a", "name", "eth0")
        sh("ip", "-n", SNS, "link", "set", TAG + "b", "name", "eth0")
        sh("ip", "-n", CNS, "addr", "add", "198.51.100.1/24", "dev", "eth0")
        sh("ip", "-n", CNS, "addr", "add", "2001:db8::1/64", "dev", "eth0", "nodad")
        for a in ("198.51.100.2/24", "10.9.0.2/24", "100.64.0.2/24", "169.254.169.254/32"):
            sh("ip", "-n", SNS, "addr", "add", a, "dev", "eth0")
        for a in ("2001:db8::2/64", "fd00::2/64"):
            sh("ip", "-n", SNS, "addr", "add", a, "dev", "eth0", "nodad")
        for ns in (CNS, SNS):
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
        for r in ("10.9.0.0/24", "100.64.0.0/24", "169.254.169.254/32"):
            sh("ip", "-n", CNS, "route", "add", r, "dev", "eth0")
        sh("ip", "-n", CNS, "-6", "route", "add", "fd00::/64", "dev", "eth0")
        os.makedirs(self.etc, exist_ok=True)
        with open(self.etc + "/hosts", "w") as f:
            f.write(HOSTS)

    def nginx(self, name, ns, listen):
        d = os.path.join(self.dir, name)
        os.makedirs(os.path.join(d, "tmp"))
        conf = os.path.join(d, "nginx.conf")
        with open(conf, "w") as f:
            f.write(NGINX_CONF.format(dir=d, www=self.www, listen=listen))
        log = open(os.path.join(d, "stdout.log"), "wb")
        self.procs[name] = subprocess.Popen(["ip", "netns", "exec", ns, NGINX, "-c", conf, "-p", d],
                                            stdout=log, stderr=subprocess.STDOUT)

    def bad_server(self):
        p = subprocess.Popen(["ip", "netns", "exec", SNS, sys.executable, "-c", BAD_SERVER],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert p.stdout.readline().strip() == b"ready"
        self.procs["bad"] = p

    def wait_listening(self, ns, port, host):
        end = time.time() + 10
        while time.time() < end:
            p = sh("ip", "netns", "exec", ns, sys.executable, "-c",
                   "import socket; socket.create_connection((%r, %d), 1).close()" % (host, port), check=False)
            if p.returncode == 0:
                return
            time.sleep(0.1)
        raise AssertionError("nothing listens on %s:%d in %s" % (host, port, ns))

    def up(self):
        self.files()
        self.certs()
        self.network()
        ssl = "ssl_certificate {d}/server.crt; ssl_certificate_key {d}/server.key;".format(d=self.dir)
        self.nginx("server", SNS, "listen 80; listen [::]:80; listen 443 ssl http2; listen [::]:443 ssl http2; " + ssl)
        self.nginx("loopback", CNS, "listen 127.0.0.1:8080; listen [::1]:8080;")
        self.bad_server()
        self.wait_listening(SNS, 80, "198.51.100.2")
        self.wait_listening(SNS, 443, "198.51.100.2")
        self.wait_listening(CNS, 8080, "127.0.0.1")
        self.wait_listening(CNS, 8080, "::1")

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for ns in self.made_ns:
            sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.etc, ignore_errors=True)
        if not os.environ.get("PRISM_KEEP_LOGS"):
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- use --
    def access(self, name="server"):
        """Lines 'port uri status bytes' nginx logged so far."""
        try:
            with open(os.path.join(self.dir, name, "access.log")) as f:
                return [l.split() for l in f.read().splitlines()]
        except FileNotFoundError:
            return []

    def probe(self, urls, *flags, ca=True, timeout=120):
        args = ["ip", "netns", "exec", CNS, PROBE]
        if ca:
            args += ["--media-ca-file", os.path.join(self.dir, "ca.crt")]
        args += list(flags) + ["--"] + list(urls)
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0 or any(m in p.stderr for m in SANITIZER_MARKS):
            raise AssertionError("probe failed (rc %d):\n%s" % (p.returncode, p.stderr[-4000:]))
        lines = [json.loads(l) for l in p.stdout.splitlines() if l.strip()]
        metrics = [l["metrics"] for l in lines if "metrics" in l][0]
        return [l for l in lines if "url" in l], metrics


NET = None


def one(url, *flags, **kw):
    res, m = NET.probe([url], *flags, **kw)
    assert len(res) == 1, res
    return res[0], m


def crc(name):
    return zlib.crc32(NET.content[name]) & 0xffffffff


def expect(url, reason, *flags, **kw):
    r, _ = one(url, *flags, **kw)
    assert r["reason"] == reason, "%s: %s (%s), expected %s" % (url, r["reason"], r["message"], reason)
    return r


# ---------------------------------------------------------------- tests

def test_public_http_and_https_by_default():
    """TEST-NET and documentation addresses are public by the rules: fetched with no flag. https is
    verified against the CA given by flag and speaks HTTP/2; http is HTTP/1.1."""
    for url, version in (("http://public.test/img.jpg", 1), ("https://public.test/img.jpg", 2),
                         ("https://198.51.100.2/img.jpg", 2), ("http://[2001:db8::2]/img.jpg", 1),
                         ("http://public6.test/img.jpg", 1)):
        r = expect(url, "ok")
        assert r["crc32"] == crc("img.jpg") and r["bytes"] == len(NET.content["img.jpg"]), r
        assert r["http_version"] == version, r


def test_tls_is_verified():
    expect("https://public.test/img.jpg", "tls", ca=False)           # our CA is not the system's
    expect("https://other.test/img.jpg", "tls")                       # a name the certificate lacks
    # the system store stays trusted beside the extra file: nothing to reach offline, but the
    # option must not have replaced it (libcurl's CA directory is kept)
    r = expect("https://public.test/img.jpg", "ok")
    assert r["crc32"] == crc("img.jpg")


def test_private_addresses_refused_by_default():
    before_s, before_l = len(NET.access("server")), len(NET.access("loopback"))
    cases = [
        ("http://private.test/img.jpg", "private"),
        ("http://10.9.0.2/img.jpg", "private"),
        ("https://private.test/img.jpg", "private"),
        ("http://cgnat.test/img.jpg", "shared"),
        ("http://metadata.test/latest/meta-data/", "metadata"),
        ("http://169.254.169.254/latest/meta-data/", "metadata"),
        ("http://[::ffff:169.254.169.254]/latest/meta-data/", "metadata"),
        ("http://loop.test:8080/img.jpg", "loopback"),
        ("http://127.0.0.1:8080/img.jpg", "loopback"),
        ("http://localhost:8080/img.jpg", "loopback"),
        ("http://[::1]:8080/img.jpg", "loopback"),
        ("http://loop6.test:8080/img.jpg", "loopback"),
        ("http://2130706433:8080/img.jpg", "loopback"),
        ("http://ula.test/img.jpg", "unique_local"),
        ("http://[fd00::2]/img.jpg", "unique_local"),
        ("http://0.0.0.0:8080/img.jpg", "unspecified"),
    ]
    res, m = NET.probe([u for u, _ in cases])
    got = {r["url"]: r for r in res}
    for url, reason in cases:
        assert got[url]["reason"] == reason, "%s: %s, expected %s" % (url, got[url]["reason"], reason)
        assert got[url]["bytes"] == 0
        assert "refused" in got[url]["message"]
    assert m["downloads_ok"] == 0
    # no server ever saw a request: the refusal came before the connection
    assert len(NET.access("server")) == before_s and len(NET.access("loopback")) == before_l


def test_allowed_by_flag():
    nets = "10.9.0.0/24,100.64.0.0/10,169.254.169.254/32,127.0.0.1/32,::1/128,fd00::/64"
    urls = ["http://private.test/img.jpg", "https://private.test/img.jpg", "http://cgnat.test/img.jpg",
            "http://metadata.test/img.jpg", "http://loop.test:8080/img.jpg", "http://[::1]:8080/img.jpg",
            "http://[fd00::2]/img.jpg"]
    res, _ = NET.probe(urls, "--allowed-media-networks", nets)
    for r in res:
        assert r["reason"] == "ok" and r["crc32"] == crc("img.jpg"), r
    # one network allowed is not another
    expect("http://127.0.0.1:8080/img.jpg", "ok", "--allowed-media-networks", "127.0.0.1")
    expect("http://[::1]:8080/img.jpg", "loopback", "--allowed-media-networks", "127.0.0.1")
    expect("http://metadata.test/img.jpg", "metadata", "--allowed-media-networks", "10.9.0.0/24")


def test_each_address_of_a_name_is_checked():
    """mixed.test has a private and a public address: the private one is refused as it is tried,
    the public one serves."""
    before = len(NET.access("server"))
    r = expect("http://mixed.test/img.jpg", "ok")
    assert r["crc32"] == crc("img.jpg")
    lines = NET.access("server")[before:]
    assert len(lines) == 1, lines


def test_domain_allowlist():
    flags = ("--allowed-media-domains", "public.test")
    expect("https://public.test/img.jpg", "ok", *flags)
    expect("https://198.51.100.2/img.jpg", "domain", *flags)
    expect("http://public6.test/img.jpg", "domain", *flags)
    # a redirect to another host is checked against the list as well
    expect("https://public.test/to-private", "domain", *flags)


def test_redirects():
    r = expect("http://public.test/r3", "ok")
    assert r["redirects"] == 3 and r["crc32"] == crc("img.jpg"), r
    expect("http://public.test/r4", "redirects")                  # a fourth redirect: over the limit (3)
    r = expect("http://public.test/r4", "ok", "--media-fetch-max-redirects", "4")
    assert r["redirects"] == 4
    expect("http://public.test/loop", "redirects")
    expect("https://public.test/r1", "ok")
    r = expect("http://public.test/to-https", "ok")
    assert r["http_version"] == 2, r
    # every hop is checked like the first URL: where it leads, and the address it connects to
    before = len(NET.access("loopback"))
    expect("http://public.test/to-private", "private")
    expect("http://public.test/to-meta", "metadata")
    expect("http://public.test/to-loopback", "loopback")
    expect("http://public.test/to-file", "scheme")
    assert len(NET.access("loopback")) == before


def test_http_errors():
    r = expect("http://public.test/missing.jpg", "http_status")
    assert r["http_status"] == 404 and r["bytes"] == 0
    expect("http://no-such-name.test/img.jpg", "dns")
    expect("http://public.test:8081/img.jpg", "connect")


def test_size_limits():
    # Content-Length beyond the limit: refused from the headers, no body byte kept
    before = len(NET.access("server"))
    r, m = one("http://public.test/big.bin")
    assert r["reason"] == "too_large_declared", r
    assert m["bytes"] == 0
    line = NET.access("server")[before]
    assert line[1] == "/big.bin" and int(line[3]) < (30 << 20), line
    # an endless body is cut off at the limit
    r, m = one("http://public.test:81/endless", "--max-image-bytes", "1M")
    assert r["reason"] == "too_large", r
    assert m["bytes"] <= 1 << 20
    # a Content-Length lie (100000 declared, 1000 sent)
    expect("http://public.test:81/lie", "truncated")
    # just under and at the limit pass
    expect("http://public.test/img.jpg", "ok", "--max-image-bytes", str(len(NET.content["img.jpg"])))
    expect("http://public.test/img.jpg", "too_large_declared", "--max-image-bytes",
           str(len(NET.content["img.jpg"]) - 1))


def test_stalls_and_slow_servers():
    t0 = time.time()
    expect("http://public.test:81/stall", "timeout", "--media-fetch-timeout", "2")
    assert time.time() - t0 < 10
    # 20 KB/s (nginx limit_rate) under a 50 KB/s minimum over 1 s; 5 B/s likewise
    flags = ("--media-fetch-min-rate", "50000", "--media-fetch-min-rate-window", "1")
    expect("http://public.test/slow/s.bin", "too_slow", *flags)
    expect("http://public.test:81/drip", "too_slow", *flags)
    r = expect("http://public.test/slow/ok.bin", "ok")     # 20 KB/s passes the default minimum (8 KiB/s over 10 s)
    assert r["crc32"] == crc("slow/ok.bin")


def test_one_download_for_concurrent_requests_and_the_cache():
    """16 requests at once for one 8 MiB image over HTTP/2 download it once; a second round is served
    from the URL cache; a no-store image is downloaded again."""
    before = len(NET.access("server"))
    res, m = NET.probe(["https://public.test/large.jpg", "https://public.test/nostore.jpg"],
                       "--repeat", "16", "--rounds", "2")
    assert len(res) == 64
    for r in res:
        name = r["url"].rsplit("/", 1)[1]
        assert r["reason"] == "ok" and r["crc32"] == crc(name), r
    lines = [l[1] for l in NET.access("server")[before:]]
    assert lines.count("/large.jpg") == 1, lines
    assert lines.count("/nostore.jpg") == 2, lines
    # round 1: 15 + 15 joined; round 2: 16 cache hits, and the no-store image downloaded again (15 joined)
    assert m["downloads"] == 3 and m["joined"] == 45 and m["cache_hits"] == 16, m


def test_backpressure_over_real_connections():
    """Each request pauses at its first bytes for 400 ms; the downloads finish whole, HTTP/2 and
    HTTP/1.1, with a minimum rate that a paused download must not trip."""
    for url in ("https://public.test/large.jpg", "http://public.test/large.jpg"):
        res, m = NET.probe([url], "--pause-ms", "400", "--media-cache-bytes", "0", "--media-fetch-min-rate", "100000",
                           "--media-fetch-min-rate-window", "1")
        assert res[0]["reason"] == "ok" and res[0]["crc32"] == crc("large.jpg"), res
        assert m["pauses"] >= 1, m


def test_downloads_in_flight_bounded():
    urls = ["http://public.test/slow/p%d.bin" % i for i in range(8)]
    res, m = NET.probe(urls, "--media-fetch-max-inflight", "2")
    assert all(r["reason"] == "ok" for r in res), res
    assert m["peak_inflight"] == 2, m
    res, m = NET.probe(urls, "--media-fetch-max-inflight", "2", "--media-fetch-max-queued", "3")
    reasons = sorted(r["reason"] for r in res)
    assert reasons.count("busy") == 3 and reasons.count("ok") == 5, reasons


def test_file_urls():
    d = NET.media
    expect("file://%s/local.jpg" % d, "file_disabled")
    flags = ("--allowed-local-media-path", d)
    r = expect("file://%s/local.jpg" % d, "ok", *flags)
    assert r["crc32"] == crc("img.jpg")
    expect("file://%s/out.jpg" % d, "file_symlink", *flags)
    expect("file://%s/in.jpg" % d, "file_symlink", *flags)
    expect("file:///etc/passwd", "file_outside", *flags)
    expect("file://%s/../www/img.jpg" % d, "file_outside", *flags)
    expect("file://%s/%%2e%%2e/www/img.jpg" % d, "file_outside", *flags)
    expect("file://%s/none.jpg" % d, "file_not_found", *flags)


def main():
    global NET
    why = usable()
    if why:
        skip(why)
    NET = Net()
    try:
        NET.up()
        return run_tests([test_public_http_and_https_by_default, test_tls_is_verified,
                          test_private_addresses_refused_by_default, test_allowed_by_flag,
                          test_each_address_of_a_name_is_checked, test_domain_allowlist, test_redirects,
                          test_http_errors, test_size_limits, test_stalls_and_slow_servers,
                          test_one_download_for_concurrent_requests_and_the_cache,
                          test_backpressure_over_real_connections, test_downloads_in_flight_bounded, test_file_urls])
    finally:
        NET.close()


if __name__ == "__main__":
    sys.exit(main())
