#!/usr/bin/env python3
"""Link check: our code allocates only through the counting allocator (prism_malloc & co.), so the
allocation counter a worker heartbeats (prism:worker_heap_allocations_total, flat while serving)
sees every allocation our code makes on the request path: a libc malloc / strdup / free in worker
code is refused here, at build time, where a test that counts only prism_malloc could not see it.

Arguments: the static libraries and object files to check (CMake passes every library of ours and
the processes' own objects). Each undefined reference to a libc allocator is a failure unless the
object is in ALLOWED below, with the reason it may. Third-party libraries (ZeroMQ, libjpeg-turbo,
protobuf-c, jansson) allocate as they do: not ours to count.
"""
import os
import subprocess
import sys

ALLOC = {"malloc", "calloc", "realloc", "reallocarray", "free", "strdup", "strndup", "posix_memalign",
         "aligned_alloc", "memalign", "valloc", "pvalloc", "asprintf", "vasprintf", "getline", "getdelim",
         "open_memstream", "__strdup"}

# object -> the symbols it may use, and why
ALLOWED = {
    "core.c.o": (ALLOC, "the counting allocator itself"),
    "net.c.o": ({"malloc", "free"}, "protobuf-c unpacks envelopes on the C heap (net.c: short-lived, bounded, "
                                    "outside the planned pools)"),
    "gram_json.c.o": ({"free"}, "jansson's text freed with the allocator jansson was given, libc's when none"),
    "toolcall_grammar.c.o": ({"free"}, "the same fallback (json_text_free)"),
}


def undefined(path):
    """{object: {symbols}} of what path (an archive or an object) leaves undefined."""
    out = subprocess.run(["nm", "-A", "-u", path], capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) < 3 or parts[-2] != "U":
            continue
        name = parts[-1].split("@")[0]
        obj = parts[0].rstrip(":").split(":")[-1] if ".a:" in parts[0] else os.path.basename(parts[0].rstrip(":"))
        found.setdefault(obj, set()).add(name)
    return found


def main(paths):
    bad, checked = [], 0
    for path in paths:
        for obj, syms in undefined(path).items():
            checked += 1
            allowed = ALLOWED.get(obj, (set(), ""))[0]
            hit = sorted((syms & ALLOC) - allowed)
            if hit:
                bad.append("%s (%s): %s" % (obj, os.path.basename(path), ", ".join(hit)))
    if bad:
        print("libc allocation calls outside the counting allocator (use prism_malloc & co.):")
        for b in bad:
            print("  " + b)
        return 1
    print("%d objects checked: every allocation goes through prism_malloc (%d allowed exceptions)" % (checked, len(ALLOWED)))
    return 0


if __name__ == "__main__":
    # CMake hands a target's objects as one ';'-separated argument
    sys.exit(main([p for a in sys.argv[1:] for p in a.split(";") if p]))
