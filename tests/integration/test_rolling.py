#!/usr/bin/env python3
"""A rolling restart of every process under load loses no request (issue 9).

The cluster as deployed: deploy/launch.sh (its supervisor restarts what exits), two routers behind
nginx, one worker per tier (the hardest case: a worker's tier is empty while it restarts). Clients
send image requests back to back; every process is stopped in turn with SIGTERM (a worker drains, a
router finishes its open streams) and the next one waits until it serves again (for a router, also
nginx's fail_timeout: nginx counts it as failed that long). Every request must be answered 200.

Skips (exit 77) when nginx is not installed (deploy/install-deps.sh --test installs it).
Run: python3 tests/integration/test_rolling.py   (PRISM_BINARY_DIR=build dir)
"""
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from cluster import chat_body, make_image, run_tests  # noqa: E402
from launched import Launched, finish  # noqa: E402
from bench_faults import Load, rolling  # noqa: E402  (the benchmark's load and rolling restart)

TMP = tempfile.mkdtemp(prefix="prism-rolling-")


def test_rolling_restart_of_every_process_loses_nothing():
    bodies = [chat_body("Describe the picture.", [make_image(os.path.join(TMP, "r%d.jpg" % i), width=320,
                                                             height=240, photo=True, seed=i)],
                        max_tokens=24, temperature=0, ignore_eos=True) for i in range(4)]
    with Launched(routers=2, encoders=1, prefills=1, decodes=1, lb="nginx",
                  args=["--router-arg", "--worker-timeout=2", "--worker-arg", "--heartbeat-interval=0.2"]) as c:
        c.wait_ready()
        load = Load(c, bodies, 3)
        try:
            row = rolling(c, load, ["encoder-1", "prefill-1", "decode-1", "router-1", "router-2"], 1.0)
        finally:
            done = load.finish()
        print("  rolling restart: %d of %d requests answered 200 during it (%d in the whole run), %.1f s"
              % (row["ok"], row["affected"], len(done), row["back_after_s"]), flush=True)
        assert row["affected"] >= 10, ("too few requests during the restart to say anything", row)
        assert row["ok"] == row["affected"], row
        bad = [(round(e - s, 2), st) for s, e, st in done if st != 200]
        assert not bad, bad


if __name__ == "__main__":
    if not (shutil.which("nginx") or os.path.exists("/usr/sbin/nginx")):
        print("SKIP: nginx is not installed (deploy/install-deps.sh --test)")
        sys.exit(77)
    sys.exit(finish(run_tests([test_rolling_restart_of_every_process_loses_nothing]), TMP))
