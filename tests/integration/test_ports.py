#!/usr/bin/env python3
"""The test harness's port picker (cluster.free_port_range), offline, in about a second.

Every port a test hands to a server comes from it: outside the kernel's ephemeral range, so no
outgoing connection (ZeroMQ reconnects, nginx upstream connections, curl) can take it between the
pick and the server's bind; never one that is taken; never twice in one process; never one that
another test process holds. And no test picks ports another way (binding port 0 is the ephemeral
range again).
"""
import os
import re
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import cluster  # noqa: E402
from cluster import ROOT, ephemeral_port_range, free_port, free_port_range, run_tests  # noqa: E402


def test_ports_come_from_outside_the_ephemeral_range():
    low, high = ephemeral_port_range()
    seen = set()
    for n in (1, 1, 2, 3, 5, 9) * 40:
        base = free_port_range(n)
        ports = set(range(base, base + n))
        assert all(cluster.PORT_FLOOR <= p <= 65535 and not low <= p <= high for p in ports), \
            (base, n, low, high)
        assert not ports & seen, ("handed out twice", sorted(ports & seen))
        seen |= ports
    p = free_port()
    assert not low <= p <= high and p not in seen, p


def test_a_taken_port_is_never_picked():
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen(1)
        taken = s.getsockname()[1]
        assert not cluster._bindable(taken)
    # once closed (its listener gone) a server could bind it again
    assert cluster._bindable(taken)


def test_another_test_process_holds_its_ports():
    """A port locked by another process (as its free_port_range does) is not reserved here."""
    port = free_port()
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys; sys.path.insert(0, %r); import cluster\n"
        "base = cluster.free_port_range(1); print(base, flush=True); sys.stdin.read()") % os.path.dirname(__file__)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        theirs = int(child.stdout.readline())
        assert theirs != port
        assert not cluster._reserve(theirs), "a port another test process holds was reserved here"
        assert cluster._reserve(port)  # ours stays ours
    finally:
        child.stdin.close()
        child.wait(10)
    assert cluster._reserve(theirs), "released when the other process exited"


def test_no_test_picks_ports_another_way():
    """Binding port 0 to learn a free port hands out an ephemeral one: only cluster.py picks ports."""
    bind0 = re.compile(r"\.bind\(\(\s*[^,()]*,\s*0\s*\)\)")
    found = []
    for sub in ("tests/integration", "tests/bench", "tests/mutants"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, sub)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(dirpath, f)
                    text = open(path, encoding="utf-8").read()
                    found += ["%s:%d" % (os.path.relpath(path, ROOT), text[:m.start()].count("\n") + 1)
                              for m in bind0.finditer(text)]
    assert not found, "ports picked by binding port 0: %s" % found


if __name__ == "__main__":
    sys.exit(run_tests([test_ports_come_from_outside_the_ephemeral_range, test_a_taken_port_is_never_picked,
                        test_another_test_process_holds_its_ports, test_no_test_picks_ports_another_way]))
