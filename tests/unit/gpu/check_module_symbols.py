"""The shared modules a process dlopens (the CUDA backend, the NCCL communicator) carry no copy of
prism_core and bind to the process's (core.h, PRISM_API): checked on the built files, no GPU needed.

  - the executable exports only PRISM_API functions (every library is built with hidden visibility);
  - a module defines no core function (no copy that would shadow, or be shadowed by, the process's)
    and exports only its own PRISM_API entry points;
  - every prism_ symbol a module takes from outside is exported by the executable (or by the CUDA
    module, for the NCCL one);
  - the executable really loads the CUDA module: asked for --device cuda on a machine without a GPU,
    it reaches the module's "no CUDA device" answer, not a load failure.

Run: check_module_symbols.py COMMON_DIR MODEL_DIR EXE MODULE [MODULE ...]
"""
import os
import re
import subprocess
import sys


def api_names(common_dir):
    """{name: header} of every function declared PRISM_API under common/."""
    out = {}
    for root, _, files in os.walk(common_dir):
        for f in files:
            if f.endswith(".h"):
                path = os.path.join(root, f)
                text = open(path, encoding="utf-8").read()
                for m in re.finditer(r"^PRISM_API\b[^;(]*?\b(prism_\w+)\s*\(", text, re.M):
                    out[m.group(1)] = os.path.relpath(path, common_dir)
    return out


def nm(path, defined, dynamic=True):
    """prism_ names in the dynamic symbol table (dynamic) or in every symbol table, local ones too."""
    flag = "--defined-only" if defined else "--undefined-only"
    text = subprocess.run(["nm"] + (["-D"] if dynamic else []) + [flag, path], capture_output=True, text=True,
                          check=True).stdout
    names = set()
    for line in text.splitlines():
        name = line.split()[-1].split("@")[0]
        if name.startswith("prism_"):
            names.add(name)
    return names


def main():
    common_dir, model_dir, exe, modules = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    api = api_names(common_dir)
    core = {n for n, h in api.items() if h.startswith("core" + os.sep)}
    fails = []
    exported = nm(exe, True)
    if exported - core:
        fails.append("%s exports more than core's PRISM_API: %s" % (exe, sorted(exported - core)))
    provided = set(exported)
    for mod in modules:   # the CUDA module first: the NCCL one links it
        defined, needed = nm(mod, True), nm(mod, False)
        copied = nm(mod, True, dynamic=False) & core   # hidden copies too (not in the dynamic table)
        if copied:
            fails.append("%s carries a copy of prism_core: %s" % (mod, sorted(copied)))
        if defined - set(api):
            fails.append("%s exports what no header declares PRISM_API: %s" % (mod, sorted(defined - set(api))))
        if needed - provided:
            fails.append("%s needs what no process exports (mark it PRISM_API in core.h): %s" %
                         (mod, sorted(needed - provided)))
        print("%s: exports %d entry points, takes %d functions from outside it (%s)" %
              (os.path.basename(mod), len(defined), len(needed), ", ".join(sorted(needed))))
        provided |= defined
    print("%s exports %d functions: %s" % (os.path.basename(exe), len(exported), ", ".join(sorted(exported))))
    # The process loads the module for real (dlopen, RTLD_NOW: every symbol bound or the load fails):
    # without a GPU the module answers "no CUDA device"; with one it creates the backend ("cuda: <name>,
    # N SMs") and the worker goes on to wait for a router that is not there.
    p = subprocess.Popen([exe, "--device", "cuda", "--model-path", model_dir, "--insecure-no-curve", "--router",
                          "tcp://127.0.0.1:9", "--worker-id", "symbols-check"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        log, _ = p.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        log, _ = p.communicate()
    reached = "no CUDA device is available" in log or re.search(r"cuda: .*\d+ SMs", log)
    if "cannot be loaded" in log or not reached:
        fails.append("%s --device cuda did not reach the CUDA module:\n%s" % (exe, log[-2000:]))
    for f in fails:
        print("FAIL", f)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
