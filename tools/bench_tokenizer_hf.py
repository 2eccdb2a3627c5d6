#!/usr/bin/env python3
"""Single-thread HF `tokenizers` encode throughput on the same corpus as prism_bench_tokenizer.

Usage: python3 tools/bench_tokenizer_hf.py <tokenizer.json> <corpus.jsonl|text> [seconds]
Reports MB/s for encode one by one (a Python call per string), encode_batch over the corpus
(RAYON_NUM_THREADS=1, so one thread), one call on the newline-joined corpus, and decode.
"""
import json
import os
import sys
import time

os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Tokenizer  # noqa: E402


def load(path):
    with open(path, encoding="utf-8") as f:
        data = f.read()
    if data.startswith('"'):
        return [json.loads(line) for line in data.split("\n") if line]
    return data.splitlines(keepends=True)


def timed(fn, secs):
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        el = time.perf_counter() - t0
        if el >= secs:
            return reps, el


def main():
    tok_path, corpus_path = sys.argv[1], sys.argv[2]
    secs = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
    t0 = time.perf_counter()
    tok = Tokenizer.from_file(tok_path)
    t_load = time.perf_counter() - t0
    corpus = load(corpus_path)
    nbytes = sum(len(s.encode("utf-8")) for s in corpus)
    ntok = sum(len(tok.encode(s, add_special_tokens=False).ids) for s in corpus)

    def one():
        for s in corpus:
            tok.encode(s, add_special_tokens=False)

    def batch():
        tok.encode_batch(corpus, add_special_tokens=False)

    joined = "\n".join(corpus) + "\n"
    ids = tok.encode(joined, add_special_tokens=False).ids

    def whole():
        tok.encode(joined, add_special_tokens=False)

    def dec():
        tok.decode(ids, skip_special_tokens=False)

    print("tokenizer %s (load %.3f s)" % (tok_path, t_load))
    print("corpus    %s: %d strings, %.3f MB, %d tokens" % (corpus_path, len(corpus), nbytes / 1e6, ntok))
    r, el = timed(one, secs)
    print("HF encode one-by-one : %8.2f MB/s  %10.0f tokens/s" % (nbytes * r / el / 1e6, ntok * r / el))
    r, el = timed(batch, secs)
    print("HF encode_batch (1T) : %8.2f MB/s  %10.0f tokens/s" % (nbytes * r / el / 1e6, ntok * r / el))
    r, el = timed(whole, secs)
    print("HF encode one call   : %8.2f MB/s  %10.0f tokens/s" % (len(joined.encode()) * r / el / 1e6, len(ids) * r / el))
    r, el = timed(dec, secs / 2)
    out = len(tok.decode(ids, skip_special_tokens=False).encode())
    print("HF decode            : %8.2f MB/s  %10.0f tokens/s" % (out * r / el / 1e6, len(ids) * r / el))


if __name__ == "__main__":
    main()
