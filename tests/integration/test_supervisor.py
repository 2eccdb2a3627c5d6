"""The launcher is a supervisor (issue 9): a dead process comes back, the rest keep serving, and a
stop leaves nothing behind.

First prism_supervisor alone on small shell processes (backoff doubling, its cap and its reset,
SIGTERM then SIGKILL after the grace period, fail-fast on a configuration error, stopping when its
parent dies); then deploy/launch.sh on the bundled model: SIGKILL each role, it comes back under a
new pid, /ready is 200 and a request succeeds; Ctrl-C to the launcher leaves no process.

Run: python3 tests/integration/test_supervisor.py   (PRISM_BINARY_DIR=build dir)
"""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import BUILD, MODEL, chat_body, make_image, run_tests  # noqa: E402
from launched import LAUNCH, SUPERVISOR, Launched, finish, pid_alive, processes_mentioning, wait_for  # noqa: E402

TMP = tempfile.mkdtemp(prefix="prism-sup-")
JPG = make_image(os.path.join(TMP, "red_circle.jpg"), width=320, height=240, shape="circle", color="red")


class Sup:
    """prism_supervisor on a spec of shell processes, its output in a file."""

    def __init__(self, procs, *flags, parent_shell=False, prepare=None):
        self.dir = tempfile.mkdtemp(prefix="sup-", dir=TMP)
        if prepare:
            prepare(self.dir)
        self.spec = os.path.join(self.dir, "spec")
        with open(self.spec, "w") as f:
            f.write("# test spec\n\n")
            for name, argv in procs.items():
                f.write("\t".join([name, *argv]) + "\n")
        self.out_path = os.path.join(self.dir, "supervisor.log")
        self.out = open(self.out_path, "wb")
        cmd = [SUPERVISOR, "--spec", self.spec, "--run-dir", self.dir, "--log-dir", self.dir, *flags]
        if parent_shell:
            # A parent that can die without taking us down with it: sh runs the supervisor in the
            # background and waits.
            self.shell = subprocess.Popen(["sh", "-c", '"$@" & echo $! >"%s/sup.pid"; wait' % self.dir, "sh", *cmd],
                                          stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)
            self.pid = int(wait_for("the supervisor's pid", lambda: self._read("sup.pid"), 10))
            self.proc = None
        else:
            self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True)
            self.pid = self.proc.pid

    def _read(self, name):
        try:
            with open(os.path.join(self.dir, name)) as f:
                return f.read().strip()
        except OSError:
            return ""

    def text(self):
        with open(self.out_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def child(self, name):
        s = self._read(name + ".pid")
        return int(s) if s else None

    def child_log(self, name):
        return self._read(name + ".log")

    def delays(self, name):
        return [float(d) for d in re.findall(r" %s: start again in ([0-9.]+)s" % re.escape(name), self.text())]

    def wait_exit(self, timeout):
        if self.proc:
            return self.proc.wait(timeout)
        wait_for("the supervisor to exit", lambda: not pid_alive(self.pid), timeout)
        return None

    def kill(self):
        for p in [self.pid] + [self.child(n) for n in ("a", "b", "flap", "steady", "stubborn", "polite", "ok", "bad")]:
            if p and pid_alive(p):
                os.kill(p, signal.SIGKILL)


def test_backoff_doubles_is_capped_and_resets_after_a_healthy_run():
    s = Sup({"flap": ["sh", "-c", "exit 1"],
             "steady": ["sh", "-c", "sleep 0.6; exit 0"]},
            "--backoff-initial", "0.1", "--backoff-max", "0.4", "--healthy-after", "0.5")
    try:
        wait_for("6 restarts of flap and 2 of steady",
                 lambda: len(s.delays("flap")) >= 6 and len(s.delays("steady")) >= 2, 30)
        flap = s.delays("flap")[:6]
        assert flap == [0.1, 0.2, 0.4, 0.4, 0.4, 0.4], flap  # doubles, capped at --backoff-max
        steady = s.delays("steady")[:2]
        assert steady == [0.1, 0.1], steady                   # a healthy run resets the count
        assert "(1 in a row)" in s.text()
        # The delay is really waited: the log's timestamps between an exit and the next start.
        stamps = []
        for line in s.text().splitlines():
            m = re.match(r"(\d\d):(\d\d):(\d\d\.\d+) .* flap: (started|start again)", line)
            if m:
                stamps.append((int(m.group(1)) * 3600 + int(m.group(2)) * 60 + float(m.group(3)), m.group(4)))
        gaps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:]) if a[1] == "start again" and b[1] == "started"]
        assert len(gaps) >= 4 and all(g >= d - 0.005 for g, d in zip(gaps, flap)), (gaps, flap)
        os.kill(s.pid, signal.SIGTERM)
        assert s.wait_exit(10) == 0
        assert not s.child("flap") and not s.child("steady"), "pid files left behind"
    finally:
        s.kill()


def test_stop_sends_sigterm_then_sigkill_after_the_grace_period():
    stubborn = ("import signal, subprocess, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: print('got SIGTERM', flush=True))\n"
                "kid = subprocess.Popen(['sleep', '1000'])\n"
                "print('up', kid.pid, flush=True)\n"
                "while True: time.sleep(0.05)\n")
    script = os.path.join(TMP, "stubborn.py")  # spec arguments are one line each
    with open(script, "w") as f:
        f.write(stubborn)
    s = Sup({"stubborn": [sys.executable, script], "polite": ["sleep", "1000"]}, "--grace", "1")
    try:
        up = wait_for("the stubborn process to start its own child",
                      lambda: re.search(r"up (\d+)", s.child_log("stubborn")), 15)
        grandchild = int(up.group(1))
        pids = [s.child("stubborn"), s.child("polite"), grandchild]
        assert all(pids) and all(pid_alive(p) for p in pids), pids
        t0 = time.time()
        os.kill(s.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        assert s.wait_exit(15) == 0
        took = time.time() - t0
        assert 0.9 <= took < 5, "stop took %.2fs with --grace 1" % took
        assert "got SIGTERM" in s.child_log("stubborn"), "SIGTERM was not sent first"
        assert "SIGKILL" in s.text()
        left = [p for p in pids if pid_alive(p)]
        assert not left, "still alive after the stop (a helper the process forked included): %s" % left
    finally:
        s.kill()


def test_a_first_run_that_fails_is_a_configuration_error_and_stops_everything():
    s = Sup({"ok": ["sleep", "1000"], "bad": ["sh", "-c", "echo 'bad: unknown flag' >&2; exit 2"]},
            "--fail-fast", "--healthy-after", "5")
    try:
        assert s.wait_exit(15) == 1
        assert "bad failed at start-up" in s.text(), s.text()
        assert "unknown flag" in s.child_log("bad")
        assert not re.search(r"bad: start again", s.text())
        ok = re.search(r"ok: started \(pid (\d+)", s.text())
        assert ok and not pid_alive(int(ok.group(1)))
    finally:
        s.kill()


def test_the_supervisor_stops_everything_when_its_parent_dies():
    s = Sup({"a": ["sleep", "1000"]}, "--exit-with-parent", parent_shell=True)
    try:
        child = wait_for("the child's pid file", lambda: s.child("a"), 10)
        os.killpg(s.shell.pid, signal.SIGKILL)  # the launcher killed outright (kill -9, OOM killer)
        s.shell.wait()
        s.wait_exit(15)
        wait_for("the child to be stopped", lambda: not pid_alive(child), 15)
    finally:
        s.kill()


# ---------------------------------------------------------------- deploy/launch.sh on the model

def ok_request(c):
    status, r = c.post_json("/v1/chat/completions",
                            chat_body("What is in the image?", [JPG], max_tokens=8, temperature=0), timeout=60)
    assert status == 200, (status, r)
    assert r["usage"]["completion_tokens"] >= 1
    return r


def test_sigkill_each_role_it_comes_back_and_serves_then_ctrl_c_leaves_nothing():
    c = Launched()
    try:
        print("  launch.sh ready in %.2fs" % c.wait_ready(), flush=True)
        ok_request(c)
        for name in ("router-1", "encoder-1", "prefill-1", "decode-1"):
            before = c.pids()
            assert all(before.values()), before
            regs = c.registrations(name)
            t0 = time.time()
            os.kill(before[name], signal.SIGKILL)
            new = c.wait_restarted(name, before[name], timeout=30)
            if name.startswith("router"):
                # The new router knows no worker until each one registers again by itself.
                wait_for("/ready 200 from the restarted router", lambda: _ready(c), 30)
            else:
                wait_for("%s to register again" % name, lambda: c.registrations(name) > regs, 30)
                assert c.request("GET", "/ready")[0] == 200
            ok_request(c)
            took = time.time() - t0
            after = c.pids()
            others = {n: (before[n], after[n]) for n in c.names if n != name and before[n] != after[n]}
            assert not others, "killing %s changed other processes: %s" % (name, others)
            print("  %-10s SIGKILL -> new pid %d -> serving again in %.2fs" % (name, new, took), flush=True)
            assert took < 20, "%s took %.1fs to serve again" % (name, took)
        t0 = time.time()
        rc = c.stop(signal.SIGINT)
        print("  Ctrl-C -> launcher exited %d in %.2fs" % (rc, time.time() - t0), flush=True)
        assert rc == 0, c.launcher_output()[-3000:]
        left = c.leftovers()
        assert not left, "processes left after Ctrl-C: %s" % left
        assert not os.path.exists(os.path.join(c.run_dir, "router-1.pid"))
    finally:
        c.__exit__()


def _ready(c):
    try:
        return c.request("GET", "/ready", timeout=5)[0] == 200
    except OSError:  # not listening yet
        return False


def test_a_bad_flag_fails_at_start_up_with_the_reason_and_leaves_nothing():
    c = Launched(args=["--decode-arg", "--no-such-flag"])
    try:
        rc = c.launcher.wait(60)
        out = c.launcher_output()
        assert rc != 0, out
        assert "decode-1 failed at start-up" in out, out[-3000:]
        assert "unknown flag '--no-such-flag'" in c.log("decode-1")
        assert not c.leftovers(), c.leftovers()
    finally:
        c.__exit__()


def test_writes_go_through_no_planted_link_and_the_run_dir_must_be_ours():
    """Issue 26 finding 9: in a shared run directory another user aimed the supervisor's (root's)
    writes at any file through links named like its pid and log files. The supervisor writes pid
    files with O_EXCL | O_NOFOLLOW, logs with O_NOFOLLOW into files of its own, and refuses a run or
    log directory others may write (finding 7)."""
    victims = {n: os.path.join(TMP, "victim-" + n) for n in ("pid", "log")}
    for v in victims.values():
        with open(v, "w") as f:
            f.write("precious\n")

    def plant(d):
        os.symlink(victims["pid"], os.path.join(d, "ok.pid.tmp"))
        os.symlink(victims["log"], os.path.join(d, "ok.log"))

    s = Sup({"ok": ["sh", "-c", "echo hello; sleep 30"]}, prepare=plant)
    try:
        wait_for("ok's pid file", lambda: s.child("ok"), 10)
        time.sleep(0.3)
        for name, v in victims.items():
            assert open(v).read() == "precious\n", (name, open(v).read())
        assert os.path.islink(os.path.join(s.dir, "ok.log"))      # left alone: no log written through it
        os.kill(s.pid, signal.SIGTERM)
        assert s.wait_exit(10) == 0
    finally:
        s.kill()
    # a run directory others may write is refused before anything starts
    shared = Sup({"ok": ["sh", "-c", "sleep 30"]}, prepare=lambda d: os.chmod(d, 0o777))
    try:
        assert shared.wait_exit(10) == 2
        assert "writable by other users" in shared.text(), shared.text()
        assert not shared.child("ok")
    finally:
        shared.kill()


def test_launch_adopts_no_run_dir_another_user_may_change():
    """Issue 26 finding 7: launch.sh --run-dir DIR on a DIR another local user made first ran the
    cluster on that user's keys. Now it makes the directory itself (private, failing if it exists
    by then) or adopts only one of its own that no one else may write; before anything starts."""
    cases = [("world-writable", 0o777, None)]
    if os.geteuid() == 0:
        cases.append(("another user's", 0o700, 65534))
    for what, mode, owner in cases:
        d = tempfile.mkdtemp(prefix="run-", dir=TMP)
        os.chmod(d, mode)
        if owner is not None:
            os.chown(d, owner, owner)
        r = subprocess.run(["bash", LAUNCH, "--build-dir", BUILD, "--model-path", MODEL, "--run-dir", d,
                            "--port", "1"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "not a private directory" in r.stderr, (what, r.returncode, r.stderr[-2000:])
        assert not os.path.exists(os.path.join(d, "curve-keys")), what


def test_launch_gives_the_routers_the_api_key_in_a_file():
    """Issue 26 finding 10: the API key was accepted only in argv, which every local user reads in
    /proc/PID/cmdline. launch.sh takes it from PRISM_API_KEY (or --api-key-file) and hands the
    routers a private file: no process's command line holds the key, no worker's environment
    either, and the API wants it. --router-arg --api-key is refused.
    The same cluster runs launch.sh --compute-dtype bf16 (issue 33): every worker computes its
    matmuls in bf16, the prefill and decode workers send their KV in bf16 (--kv-transfer-dtype auto)
    and a chat request with an image is served end to end."""
    key = "k" * 8 + os.urandom(12).hex()
    c = Launched(env={"PRISM_API_KEY": key}, args=["--compute-dtype", "bf16"])
    try:
        c.wait_ready()
        assert c.request("GET", "/v1/models")[0] == 401
        assert c.request("GET", "/v1/models", headers={"Authorization": "Bearer " + key})[0] == 200
        status, r = c.post_json("/v1/chat/completions", chat_body("What is in the image?", [JPG], max_tokens=8,
                                                                  temperature=0),
                                headers={"Authorization": "Bearer " + key}, timeout=60)
        assert status == 200 and r["usage"]["completion_tokens"] >= 1, (status, r)
        for name in ("encoder-1", "prefill-1", "decode-1"):
            assert "matmuls compute in bf16" in c.log(name), c.log(name)[-2000:]
            assert ("go out in bf16 (--kv-transfer-dtype)" in c.log(name)) == (name != "encoder-1"), name
            # bf16 arithmetic multiplies bf16 weights: an explicit --weight-dtype f32 contradicts it
            kind = name[:-2]
            p = subprocess.run([os.path.join(BUILD, kind + "_worker", kind + "_worker"), "--compute-dtype", "bf16",
                                "--weight-dtype", "f32", "--insecure-no-curve"], capture_output=True, text=True,
                               timeout=30)
            assert p.returncode == 2 and "contradicts --weight-dtype f32" in p.stderr + p.stdout, (kind, p)
        assert not processes_mentioning(key), processes_mentioning(key)
        for name, pid in c.pids().items():
            with open("/proc/%d/environ" % pid, "rb") as f:
                assert key.encode() not in f.read(), name
        kf = os.path.join(c.run_dir, "api-key")
        assert os.stat(kf).st_mode & 0o077 == 0 and open(kf).read().strip() == key
        assert "--api-key-file" in " ".join(cmd for _, cmd in processes_mentioning(c.run_dir))
    finally:
        c.stop()
        c.__exit__()
    r = subprocess.run(["bash", LAUNCH, "--build-dir", BUILD, "--model-path", MODEL, "--port", "1",
                        "--router-arg", "--api-key=" + key], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--api-key-file" in r.stderr, (r.returncode, r.stderr[-2000:])


if __name__ == "__main__":
    sys.exit(finish(run_tests([
        test_backoff_doubles_is_capped_and_resets_after_a_healthy_run,
        test_stop_sends_sigterm_then_sigkill_after_the_grace_period,
        test_a_first_run_that_fails_is_a_configuration_error_and_stops_everything,
        test_the_supervisor_stops_everything_when_its_parent_dies,
        test_sigkill_each_role_it_comes_back_and_serves_then_ctrl_c_leaves_nothing,
        test_a_bad_flag_fails_at_start_up_with_the_reason_and_leaves_nothing,
        test_writes_go_through_no_planted_link_and_the_run_dir_must_be_ours,
        test_launch_adopts_no_run_dir_another_user_may_change,
        test_launch_gives_the_routers_the_api_key_in_a_file,
    ]), TMP))
