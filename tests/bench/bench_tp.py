#!/usr/bin/env python3
"""Decode step time against tensor-parallel size on CPU.

For each T, starts a local cluster (router, encoder, prefill, one decode group of T ranks over
shared memory), sends --concurrency text requests of --tokens tokens each (ignore_eos, greedy)
--rounds times, stops the cluster and reads the decode leader's closing line: mean step forward
time (step plan sent, forward, collectives included) and the collectives' share of it. Prints one
JSON line per T.

  python3 tests/bench/bench_tp.py --build-dir build --tp 1,2,4
  python3 tests/bench/bench_tp.py --build-dir build --tp 1,2,4 --random-size 0.4b   # ~0.4B random weights

--random-size 0.4b writes a temporary model directory: the bundled model's tokenizer, template and
vision tower with a Llama text model of hidden 1024, 24 layers, 16 heads, 2 KV heads (replicated at
T = 4), MLP 4096, vocab 32000 (~0.43B parameters), and runs every worker with --random-weights.
Only the standard library is needed.
"""
import argparse
import concurrent.futures
import json
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import cluster as cl  # noqa: E402


def random_model(tmp):
    d = os.path.join(tmp, "model-0.4b")
    os.makedirs(d)
    for f in os.listdir(cl.MODEL):
        if f != "model.safetensors" and f != "config.json":
            shutil.copy(os.path.join(cl.MODEL, f), d)
    with open(os.path.join(cl.MODEL, "config.json")) as f:
        c = json.load(f)
    c["text_config"].update(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=2,
                            head_dim=64, intermediate_size=4096, vocab_size=32000)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(c, f)
    return d


def run(size, model, args, extra):
    wa = {"decode_worker": extra, "prefill_worker": extra, "encoder_worker": extra}
    with cl.Cluster(decodes=0, model=model, worker_args=wa) as c:
        leader = "tcp://127.0.0.1:%d" % cl.free_port()
        tp = ["--tp-size", str(size), "--tp-leader", leader]
        c.start_worker("decode-0", "decode_worker", extra=tp + ["--tp-rank", "0"])
        for r in range(1, size):
            c._start("decode-0.r%d" % r, "decode_worker",
                     ["--model-path", model, "--worker-id", "decode-0.r%d" % r, *c.sec, *extra, *tp, "--tp-rank", str(r)])
        c.expected["decodes"] = 1
        c.wait_ready(timeout=600)
        body = dict(cl.chat_body("Tell me a story", max_tokens=args.tokens, temperature=0, ignore_eos=True),
                    model=os.path.basename(model.rstrip("/")))

        def one(_):
            status, r = c.post_json("/v1/chat/completions", body, timeout=3600)
            assert status == 200, (status, r)
            return r["usage"]["completion_tokens"]

        for _ in range(args.rounds):
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as ex:
                assert all(n == args.tokens for n in ex.map(one, range(args.concurrency)))
    log = c.log("decode-0", tail=0)
    m = re.search(r"(\d+) steps, (\d+) tokens; step forward ([\d.]+) ms mean, collectives ([\d.]+)% of it "
                  r"\((\d+) ops, tp (\d+) over (\w+)\)", log)
    assert m, log[-2000:]
    return {"tp": size, "steps": int(m.group(1)), "tokens": int(m.group(2)), "step_ms": float(m.group(3)),
            "collective_pct": float(m.group(4)), "ops": int(m.group(5)), "transport": m.group(7),
            "concurrency": args.concurrency}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build-dir", default=cl.BUILD)
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="CPU backend threads per rank")
    ap.add_argument("--random-size", choices=["0.4b"], default=None)
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    tmp = tempfile.mkdtemp(prefix="prism-bench-tp-")
    model, extra = cl.MODEL, ["--threads", str(args.threads)]
    if args.random_size:
        model = random_model(tmp)
        extra += ["--random-weights"]
    for t in (int(x) for x in args.tp.split(",")):
        res = run(t, model, args, extra)
        res["model"] = "random-0.4b" if args.random_size else "prism-tiny-llava"
        print(json.dumps(res), flush=True)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
