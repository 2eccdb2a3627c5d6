"""The router's status page (GET /) and its JSON (GET /status), in a real browser.

A live cluster (two encoders, one prefill, one decode, behind an API key) serves a few requests,
one of them refused; headless Chromium (Debian's `chromium`) loads the page, which must ask for
the key without it and, given the key, show every registered worker of every tier with the
numbers /status reports. The rendered DOM (after the page's JavaScript ran) is parsed and checked;
a screenshot is saved in the test output folder ($PRISM_TEST_OUTPUT_DIR, default
BUILD/test-output/status_page). Skips (77) without chromium (deploy/install-deps.sh --test).
"""
import html.parser
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from cluster import BUILD, STAGES, Cluster, chat_body, make_image, run_tests, wait_for  # noqa: E402

KEY = "status-page-key-0123"
AUTH = {"Authorization": "Bearer " + KEY}
OUT = os.environ.get("PRISM_TEST_OUTPUT_DIR") or os.path.join(BUILD, "test-output", "status_page")


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


def browse(url, what, out_file=None):
    """Runs headless Chromium on url; what = 'dom' (returns the DOM after scripts ran) or
    'screenshot' (writes out_file). The virtual time budget lets the page's fetches and timers run
    (virtual time stops while a fetch is on the wire, so the router's answers are real)."""
    profile = tempfile.mkdtemp(prefix="prism-chromium-")
    args = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
            "--disable-dev-shm-usage", "--user-data-dir=" + profile, "--window-size=1400,1000",
            "--virtual-time-budget=6000", "--run-all-compositor-stages-before-draw"]
    args += ["--dump-dom"] if what == "dom" else ["--screenshot=" + out_file]
    try:
        p = subprocess.run(args + [url], capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    assert p.returncode == 0, (p.returncode, p.stderr[-2000:])
    return p.stdout


class Dom(html.parser.HTMLParser):
    """Just enough of the DOM: every element with its attributes, its text, and its ancestors'
    data-* attributes, so a cell can be found as (worker, field)."""

    VOID = {"meta", "input", "br", "img", "link", "hr"}

    def __init__(self, text):
        super().__init__()
        self.stack, self.elems = [], []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        e = {"tag": tag, "attrs": dict(attrs), "text": "", "ctx": {}}
        for p in self.stack:
            e["ctx"].update({k: v for k, v in p["attrs"].items() if k.startswith("data-")})
        self.elems.append(e)
        if tag not in self.VOID:
            self.stack.append(e)

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        for e in self.stack:
            e["text"] += data

    def find(self, **want):
        """Elements whose own attributes (or, for data-*, an ancestor's) match every key=value."""
        out = []
        for e in self.elems:
            have = dict(e["ctx"])
            have.update(e["attrs"])
            have["tag"] = e["tag"]
            if all(have.get(k.replace("_", "-")) == v for k, v in want.items()):
                out.append(e)
        return out

    def by_id(self, i):
        hits = [e for e in self.elems if e["attrs"].get("id") == i]
        return hits[0] if hits else None


def fmt_bytes(n):
    """The page's fmtBytes, to compare the memory plan it shows with /status's."""
    if not n > 0:
        return "0 B"
    units, i = ["B", "KiB", "MiB", "GiB", "TiB"], 0
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    if not i:
        return "%d B" % n
    digits = 2 if n < 10 else 1 if n < 100 else 0
    return "%.*f %s" % (digits, n, units[i])


def test_status_page_shows_the_live_cluster():
    if not chromium():
        print("SKIP: chromium is not installed (deploy/install-deps.sh --test)")
        sys.exit(77)
    os.makedirs(OUT, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="prism-status-")
    img = make_image(os.path.join(tmp, "a.jpg"), width=320, height=240, shape="circle", color="red", background="white")
    with Cluster(encoders=2, router_args=["--api-key", KEY], common_worker_args=["--heartbeat-interval", "0.2"]) as c:
        c.wait_ready()
        base = "http://127.0.0.1:%d/" % c.port

        # the JSON: behind the key, like the API
        st, _, _ = c.request("GET", "/status")
        assert st == 401, st
        # work: the same image twice (the second is an embedding-cache hit on the encoder that
        # saw it: affinity), a text request, and one refusal (too many images)
        for body in (chat_body("What is in the image?", [img], max_tokens=4, temperature=0),
                     chat_body("What is in the image?", [img], max_tokens=4, temperature=0),
                     chat_body("Hello", max_tokens=4, temperature=0)):
            st, r = c.post_json("/v1/chat/completions", body, headers=AUTH)
            assert st == 200, (st, r)
        st, r = c.post_json("/v1/chat/completions", chat_body("x", [img] * 9, max_tokens=2), headers=AUTH)
        assert st == 400, (st, r)

        def status():
            st, _, data = c.request("GET", "/status", headers=AUTH)
            assert st == 200, st
            import json
            return json.loads(data)

        # wait for heartbeats that carry the cache hit
        s = wait_for(lambda: (lambda s: sum(w.get("cache", {}).get("hits", 0) for w in s["workers"]) == 1 and s)(status()),
                     20, "the cache hit in a heartbeat")
        ids = {w["tier"]: sorted(x["id"] for x in s["workers"] if x["tier"] == w["tier"]) for w in s["workers"]}
        assert ids == {"encoder": ["encoder-0", "encoder-1"], "prefill": ["prefill-0"], "decode": ["decode-0"]}, ids
        assert s["finished"]["stop"] + s["finished"]["length"] == 3, s["finished"]
        assert s["refusals"]["too_many_images"] == 1 and s["finished"]["refused"] >= 1, s["refusals"]
        assert s["ttft"]["count"] == 3, s["ttft"]
        # where the time went: every stage, in order, counting the three requests, adding up to e2e
        assert [h["stage"] for h in s["stages"]] == STAGES and all(h["count"] == 3 for h in s["stages"]), s["stages"]
        assert abs(sum(h["sum"] for h in s["stages"]) - s["e2e"]["sum"]) <= 0.02 * s["e2e"]["sum"], s["stages"]
        for w in s["workers"]:
            assert w["memory"]["planned"] > 0 and w["memory"]["used"] > 0, w
            assert w["heartbeats"] > 0 and w["capacity"] > 0, w

        # the page itself is open (it holds no data), self-contained, under a strict policy
        st, h, page = c.request("GET", "/")
        assert st == 200 and h["Content-Type"].startswith("text/html"), (st, h)
        assert "default-src 'none'" in h["Content-Security-Policy"], h
        text = page.decode()
        for ext in ("http://", "https://", "src=", "<link"):
            assert ext not in text, "the page must load nothing from elsewhere (%r found)" % ext

        # without the key, the page asks for it and shows no worker
        dom = Dom(browse(base, "dom"))
        form = dom.by_id("keyform")
        assert form is not None and "hidden" not in form["attrs"], "the key form is not shown"
        assert "API key" in form["text"], form["text"]
        assert not dom.find(data_worker="encoder-0"), "workers shown without the key"

        # with the key (given once in the address), every worker of every tier with its numbers
        dom = Dom(browse(base + "#key=" + KEY, "dom"))
        assert "hidden" in dom.by_id("keyform")["attrs"], "the key form is still shown with the key"
        assert dom.by_id("state")["text"] == "ready", dom.by_id("state")["text"]
        assert s["router_id"] in dom.by_id("router")["text"]
        s = status()  # numbers as they are now (heartbeats moved on while the browser ran)
        for w in s["workers"]:
            rows = dom.find(data_worker=w["id"], tag="tr")
            assert len(rows) == 1, ("worker %s shown %d times" % (w["id"], len(rows)))
            assert rows[0]["attrs"]["data-tier"] == w["tier"], rows[0]["attrs"]
            table = [e for e in dom.find(tag="table", data_tier=w["tier"])]
            assert table and w["id"] in table[0]["text"], "%s is not in the %s table" % (w["id"], w["tier"])

            def cell(field):
                hits = dom.find(data_worker=w["id"], data_field=field, tag="td")
                assert len(hits) == 1, (w["id"], field, len(hits))
                return hits[0]
            mem = cell("memory")
            assert int(mem["attrs"]["data-planned"]) == w["memory"]["planned"], (mem["attrs"], w["memory"])
            assert "of plan " + fmt_bytes(w["memory"]["planned"]) in mem["text"], mem["text"]
            assert int(mem["attrs"]["data-used"]) > 0, mem["attrs"]
            assert cell("running")["text"].strip() == "0" and cell("waiting")["text"].strip() == "0"
            assert cell("inflight")["text"].strip() == "0 / %d" % w["capacity"], cell("inflight")["text"]
            assert w["id"] in cell("id")["text"]
            if w["tier"] == "encoder":
                hits, total = w["cache"]["hits"], w["cache"]["hits"] + w["cache"]["misses"]
                expect = "50%" if (hits, total) == (1, 2) else "0%" if total else "–"
                assert cell("cache_hit_rate")["text"].startswith(expect), (w["id"], w["cache"], cell("cache_hit_rate")["text"])
            if w["tier"] == "decode":
                assert cell("kv_free")["text"].startswith("%d / %d" % (w["kv_free_blocks"], w["kv_blocks"]))
                assert "%d recomputed" % w["preemptions"] in cell("kv_free")["text"], cell("kv_free")["text"]
                assert "%d swapped" % w["swaps"] in cell("kv_free")["text"], cell("kv_free")["text"]
            if w["tier"] == "prefill":
                assert cell("pool_free")["text"].strip() == str(w["pool_free"])
                p = w["prefix_cache"]   # prompt tokens found in its prefix cache, of those looked up
                assert p["queries"] > 0 and "%" in cell("prefix_hit_rate")["text"], (p, cell("prefix_hit_rate"))
                assert "%d of %d tokens" % (p["hits"], p["queries"]) in cell("prefix_hit_rate")["text"]
            assert "%d in all" % w["completed"] in cell("completed_per_s")["text"], cell("completed_per_s")["text"]
        # one encoder saw the image twice (affinity): 50% hit rate somewhere
        assert any(e["text"].startswith("50%") for e in dom.find(data_field="cache_hit_rate")), "no 50% cache hit rate"
        # cluster numbers: TTFT from the router's histogram, the refusal by its reason
        ttft = dom.find(data_field="ttft_p50")[0]["text"]
        assert ttft.endswith(" ms") or ttft.endswith(" s"), ttft
        # the breakdown: a row per stage with its numbers, and a bar segment per stage, together non-empty
        for name in STAGES:
            row = dom.find(tag="tr", data_stage=name)
            assert len(row) == 1 and name in row[0]["text"], (name, row)
            mean = dom.find(tag="td", data_stage=name, data_field="mean")[0]["text"]
            assert mean.endswith(" ms") or mean.endswith(" s"), (name, mean)
        widths = [float(re.search(r"width:([0-9.]+)%", e["attrs"]["style"]).group(1))
                  for e in dom.elems if e["tag"] == "i" and "data-stage" in e["attrs"]]
        assert len(widths) == len(STAGES) and abs(sum(widths) - 100) < 0.5 and max(widths) > 0, widths
        refusal = dom.find(data_reason="too_many_images", data_field="total")
        assert refusal and refusal[0]["text"] == "1", refusal
        assert dom.find(data_field="failed")[0]["text"] == "0"

        # a worker that leaves leaves the page
        c.kill("encoder-1")
        wait_for(lambda: all(w["id"] != "encoder-1" for w in status()["workers"]), 30, "encoder-1 dropped")
        dom = Dom(browse(base + "#key=" + KEY, "dom"))
        assert not dom.find(data_worker="encoder-1") and dom.find(data_worker="encoder-0", tag="tr")

        # a wrong key is refused and the page says so
        dom = Dom(browse(base + "#key=wrong", "dom"))
        assert "refused" in dom.by_id("keymsg")["text"], dom.by_id("keymsg")["text"]

        shot = os.path.join(OUT, "status.png")
        c.start_worker("encoder-1", "encoder_worker")
        wait_for(lambda: len(status()["workers"]) == 4, 60, "encoder-1 back")
        browse(base + "#key=" + KEY, "screenshot", shot)
        assert os.path.getsize(shot) > 10000, os.path.getsize(shot)
        with open(shot, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        print("screenshot: %s" % shot)


if __name__ == "__main__":
    sys.exit(run_tests([test_status_page_shows_the_live_cluster]))
