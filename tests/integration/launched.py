"""Test harness for the launcher: a cluster started by deploy/launch.sh under prism_supervisor.

Like cluster.Cluster (whose HTTP helpers it reuses), but the processes belong to the launcher: the
test finds them through the run directory's NAME.pid files and their output in the log directory.
Only the Python standard library is used.
"""
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

from cluster import BUILD, MODEL, ROOT, Cluster, free_port_range

LAUNCH = os.path.join(ROOT, "deploy", "launch.sh")
SUPERVISOR = os.path.join(BUILD, "deploy", "prism_supervisor")
TMP_DIRS = []  # removed by finish() when every test passed


def finish(rc, *dirs):
    """Removes this run's temporary directories (logs, images) unless a test failed or
    PRISM_KEEP_LOGS is set; returns rc."""
    if rc == 0 and not os.environ.get("PRISM_KEEP_LOGS"):
        for d in TMP_DIRS + list(dirs):
            shutil.rmtree(d, ignore_errors=True)
    else:
        print("logs kept in: %s" % " ".join(TMP_DIRS + list(dirs)))
    return rc


def at_port(port):
    """A view with Cluster's HTTP helpers aimed at another port (one router behind the balancer)."""
    v = object.__new__(Cluster)
    v.port = port
    return v


def wait_for(what, fn, timeout, interval=0.05):
    """Polls fn() until it returns a true value (returned); raises naming `what` at the deadline."""
    deadline = time.time() + timeout
    while True:
        v = fn()
        if v:
            return v
        if time.time() > deadline:
            raise AssertionError("timed out after %.0fs waiting for %s" % (timeout, what))
        time.sleep(interval)


def pid_alive(pid):
    """False once every thread of process pid has exited (a zombie is dead for our purposes). Not
    only its main thread: a killed process's main thread is often a zombie first while its other
    threads still exit, and the last one out frees its memory and only then closes its files (a
    router's sockets stayed open up to 118 ms after /proc/PID/stat said Z, in 30 kills on a busy
    2-core machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return False
    for tid in tids:
        try:
            with open("/proc/%d/task/%s/stat" % (pid, tid)) as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except OSError:
            pass
    return False


def processes_mentioning(needle):
    """pids of live processes whose command line contains needle (a run directory, a port)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open("/proc/%s/cmdline" % d, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
        except OSError:
            continue
        if needle in cmd and pid_alive(int(d)):
            found.append((int(d), cmd))
    return found


class Launched(Cluster):
    def __init__(self, routers=1, encoders=1, prefills=1, decodes=1, lb="nginx", args=(), env=None):
        self.n_routers = routers
        base = free_port_range(2 * routers + 1)
        self.port = base
        self.router_ports = [base] if routers == 1 else [base + 1 + i for i in range(routers)]
        self.control_base = base + routers + 1 if routers > 1 else base + 1
        self.tmp = tempfile.mkdtemp(prefix="prism-launch-")
        TMP_DIRS.append(self.tmp)
        self.run_dir = os.path.join(self.tmp, "run")
        self.log_dir = os.path.join(self.tmp, "logs")
        self.launcher_log = os.path.join(self.tmp, "launch.log")
        self.seen_pids = set()
        cmd = ["bash", LAUNCH, "--build-dir", BUILD, "--model-path", MODEL, "--port", str(self.port),
               "--control-port", str(self.control_base), "--routers", str(routers), "--lb", lb,
               "--encoders", str(encoders), "--prefills", str(prefills), "--decodes", str(decodes),
               "--run-dir", self.run_dir, "--log-dir", self.log_dir, *args]
        if routers > 1:
            cmd += ["--router-port", str(self.router_ports[0])]
        self.names = (["router-%d" % (i + 1) for i in range(routers)] +
                      ["encoder-%d" % (i + 1) for i in range(encoders)] +
                      ["prefill-%d" % (i + 1) for i in range(prefills)] +
                      ["decode-%d" % (i + 1) for i in range(decodes)] +
                      (["nginx"] if routers > 1 and lb == "nginx" else []))
        self._out = open(self.launcher_log, "wb")
        # Own session: signals from the test reach the launcher alone, as a user's kill would.
        self.launcher = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True,
                                         env=dict(os.environ, **env) if env else None)
        self.t_start = time.time()

    # ---- state ----
    def launcher_output(self):
        with open(self.launcher_log, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def log(self, name):
        try:
            with open(os.path.join(self.log_dir, name + ".log"), "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def pid(self, name):
        """The pid in RUN_DIR/NAME.pid if that process is alive, else None."""
        try:
            with open(os.path.join(self.run_dir, name + ".pid")) as f:
                pid = int(f.read().strip() or 0)
        except (OSError, ValueError):
            return None
        if pid and pid_alive(pid):
            self.seen_pids.add(pid)
            return pid
        return None

    def pids(self):
        return {n: self.pid(n) for n in self.names}

    def wait_ready(self, timeout=120):
        def ready():
            if self.launcher.poll() is not None:
                raise RuntimeError("launch.sh exited (rc %s):\n%s" % (self.launcher.returncode,
                                                                       self.launcher_output()[-4000:]))
            return "cluster ready" in self.launcher_output()
        wait_for("launch.sh to report the cluster ready", ready, timeout)
        self.pids()
        return time.time() - self.t_start

    def wait_restarted(self, name, old_pid, timeout=60):
        """Waits until NAME runs again under a new pid; returns it."""
        return wait_for("%s to come back under a new pid" % name,
                        lambda: (lambda p: p if p and p != old_pid else None)(self.pid(name)), timeout)

    def registrations(self, name):
        """How many times worker NAME has logged a registration with a router (all runs, appended)."""
        return len(re.findall(r"registered with router", self.log(name)))

    def stop(self, sig=signal.SIGINT, timeout=30, group=False):
        """Signals the launcher (group: its whole process group, as a terminal's Ctrl-C does) and
        waits for it; returns its exit code."""
        if self.launcher.poll() is None:
            if group:
                os.killpg(self.launcher.pid, sig)
            else:
                self.launcher.send_signal(sig)
            try:
                self.launcher.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.launcher.pid, signal.SIGKILL)
                self.launcher.wait()
                raise AssertionError("launch.sh did not stop within %ss of signal %d" % (timeout, sig))
        self._out.close()
        return self.launcher.returncode

    def leftovers(self):
        """Processes of this run still alive: any pid ever seen, anything naming its run directory
        or its control ports."""
        left = {p for p in self.seen_pids if pid_alive(p)}
        left |= {p for p, _ in processes_mentioning(self.run_dir)}
        for i in range(self.n_routers):
            left |= {p for p, _ in processes_mentioning("tcp://127.0.0.1:%d" % (self.control_base + i))}
        return left

    def __exit__(self, *exc):
        try:
            self.stop()
        finally:
            for p in self.leftovers():
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
