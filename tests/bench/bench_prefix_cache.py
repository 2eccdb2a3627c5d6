#!/usr/bin/env python3
"""Prefix cache (issue 29): the prefill's block-level prefix cache against --no-prefix-cache, one
fresh cluster per mode, the same requests.

1. Shared system prompt: --concurrent requests at once (32) that share a long system prompt
   (--system-tokens, ~1,500 by default: what the bundled model's 2,048-token context leaves room
   for) and ask different questions. Reports the prompt tokens the prefill computed
   (prism:prefill_tokens_computed_total), vLLM's prefix-cache counters, the wall time of the burst
   (throughput) and the median TTFT.
2. Multi-turn chat: --turns turns (5) about one photo-like --image-size JPEG (2048), the first
   turn carrying ~--first-turn-tokens of text (1,000); each turn re-sends the photo and the whole
   history, as chat clients do. Reports each turn's TTFT (streamed, first content chunk), and how
   often the encoder ran for the chat's image (its embedding-cache misses: images encoded) and
   how often the router skipped it (prism:encoder_skips_total: the prefill's prefix held it).
   With --prefills 2 the chat also shows cache-aware routing (every turn on the worker holding it).

  python3 tests/bench/bench_prefix_cache.py --build-dir build [--concurrent 32] [--system-tokens 1500]
                                            [--max-tokens 8] [--rounds 3] [--prefills 1] [--out DIR]
  (--rounds 0: the chat only)
"""
import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import cluster as cl  # noqa: E402

MODES = (("cache", []), ("--no-prefix-cache", ["--no-prefix-cache"]))


def words(n, seed):
    """About n tokens of varied English-like text for the bundled tokenizer."""
    vocab = ["the", "picture", "shows", "a", "small", "red", "circle", "near", "blue", "square", "and", "one",
             "green", "triangle", "on", "white", "background", "answer", "briefly", "always", "describe", "colour"]
    return " ".join(vocab[(i * 7 + seed) % len(vocab)] for i in range(n))


def ttft_stream(c, body):
    """Seconds from sending a streamed request to its first content chunk, and the answer's text."""
    body = dict(body, stream=True)
    t0 = time.perf_counter()
    first, text = None, ""
    s = c.open_stream("/v1/chat/completions", body, timeout=600)
    while True:
        ev = s.next_event()
        if ev is None or ev == "[DONE]":
            break
        if not ev.get("choices"):
            continue
        delta = ev["choices"][0].get("delta", {}).get("content")
        if delta:
            if first is None:
                first = time.perf_counter() - t0
            text += delta
    s.conn.close()
    return first if first is not None else time.perf_counter() - t0, text


def counters(c):
    return {k: c.metric(m) or 0 for k, m in (("queries", "vllm:prefix_cache_queries_total"),
                                            ("hits", "vllm:prefix_cache_hits_total"),
                                            ("computed", "prism:prefill_tokens_computed_total"),
                                            ("prompt", "vllm:prompt_tokens_total"))}


def settled(c, prompt_tokens):
    """The counters once the prefill's heartbeats have counted every prompt the router counted."""
    cl.wait_for(lambda: counters(c)["computed"] + counters(c)["hits"] >= prompt_tokens, 60,
                "the prefill's heartbeats to count the burst")
    return counters(c)


def text_of_tokens(c, n, seed):
    """About n tokens of text (as the router's tokenizer counts them)."""
    k = n
    for _ in range(4):
        got = c.post_json("/tokenize", {"prompt": words(k, seed), "add_special_tokens": False})[1]["count"]
        k = max(1, int(k * n / got))
    return words(k, seed)


def shared_prompt(c, args, seed):
    system = text_of_tokens(c, args.system_tokens, 0)
    bodies = [{"model": "prism-tiny-llava", "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
               "messages": [{"role": "system", "content": system},
                            {"role": "user", "content": "Question %d of round %d: %s?" % (i, seed, words(8, i + seed))}]}
              for i in range(args.concurrent)]
    before = counters(c)
    ttfts = [None] * len(bodies)

    def one(i):
        ttfts[i], _ = ttft_stream(c, bodies[i])
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(bodies)) as ex:
        list(ex.map(one, range(len(bodies))))
    wall = time.perf_counter() - t0
    prompt = counters(c)["prompt"]
    after = settled(c, prompt)
    d = {k: after[k] - before[k] for k in after}
    return {"wall_s": wall, "req_per_s": len(bodies) / wall, "ttft_median_s": statistics.median(ttfts),
            "prompt_tokens": d["prompt"], "computed": d["computed"], "queries": d["queries"], "hits": d["hits"]}


def encoder_counts(c):
    """(images the encoders encoded, found in their embedding cache, the router sent to none)."""
    return (c.metric("prism:worker_embedding_cache_misses_total", tier="encoder") or 0,
            c.metric("prism:worker_embedding_cache_hits_total", tier="encoder") or 0,
            c.metric("prism:encoder_skips_total") or 0)


def chat(c, args, image):
    history = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": cl.image_url(image)}},
                                            {"type": "text", "text": text_of_tokens(c, args.first_turn_tokens, 3) +
                                             ". What is in the image?"}]}]
    out = []
    before = encoder_counts(c)
    for turn in range(args.turns):
        body = {"model": "prism-tiny-llava", "max_tokens": args.chat_max_tokens, "temperature": 0,
                "messages": history}
        t, text = ttft_stream(c, body)
        out.append(t)
        history = history + [{"role": "assistant", "content": text},
                             {"role": "user", "content": "Turn %d: and %s?" % (turn + 2, words(6, turn))}]
    # the encoders' heartbeats (every second) carry their counts
    cl.wait_for(lambda: sum(encoder_counts(c)) >= sum(before) + args.turns, 30,
                "the encoder's heartbeat to count the chat's image")
    return out, [a - b for a, b in zip(encoder_counts(c), before)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build-dir", default=os.path.join(cl.ROOT, "build"))
    ap.add_argument("--concurrent", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="bursts per mode (each with new questions)")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--first-turn-tokens", type=int, default=1000)
    ap.add_argument("--chat-max-tokens", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=2048)
    ap.add_argument("--prefills", type=int, default=1, help="prefill workers (2: the chat is routed by its prefix)")
    ap.add_argument("--worker-args", default="", help="extra flags for every worker (e.g. '--device cuda')")
    ap.add_argument("--out", help="directory for the figures as JSON")
    args = ap.parse_args()
    cl.BUILD = os.path.abspath(args.build_dir)
    tmp = tempfile.mkdtemp(prefix="prism-prefix-")
    image = cl.make_image(os.path.join(tmp, "photo.jpg"), width=args.image_size, height=args.image_size, photo=True,
                          seed=29)
    warm = cl.make_image(os.path.join(tmp, "warm.jpg"), width=args.image_size, height=args.image_size, photo=True,
                         seed=30)
    res = {}
    for mode, flags in MODES:
        extra = args.worker_args.split()
        with cl.Cluster(prefills=args.prefills, common_worker_args=extra, worker_args={"prefill_worker": flags}) as c:
            c.wait_ready()
            # warm up: one image request (another picture: nothing of it is cached for the chat)
            ttft_stream(c, {"model": "prism-tiny-llava", "max_tokens": 1,
                            "messages": [{"role": "user", "content": [
                                {"type": "image_url", "image_url": {"url": cl.image_url(warm)}},
                                {"type": "text", "text": "warm up"}]}]})
            settled(c, counters(c)["prompt"])
            cl.wait_for(lambda: sum(encoder_counts(c)) >= 1, 30, "the encoder's heartbeat to count the warm-up image")
            turns, (enc_runs, enc_hits, enc_skips) = chat(c, args, image)
            settled(c, counters(c)["prompt"])
            rounds = [shared_prompt(c, args, r) for r in range(args.rounds)]
        res[mode] = {"rounds": rounds, "chat_ttft_s": turns, "chat_encoder_runs": enc_runs,
                     "chat_encoder_cache_hits": enc_hits, "chat_encoder_skips": enc_skips}
        for i, r in enumerate(rounds):
            print("%-18s burst %d: %d requests in %.2fs (%.1f req/s), TTFT median %.0f ms; prompt tokens %d, "
                  "computed %d, prefix-cache hits %d of %d looked up"
                  % (mode, i, args.concurrent, r["wall_s"], r["req_per_s"], 1e3 * r["ttft_median_s"], r["prompt_tokens"],
                     r["computed"], r["hits"], r["queries"]), flush=True)
        print("%-18s chat TTFT by turn: %s ms; the image: encoded %d, from the encoder's cache %d, sent to no "
              "encoder %d" % (mode, ", ".join("%.0f" % (1e3 * t) for t in turns), enc_runs, enc_hits, enc_skips),
              flush=True)
    on, off = res["cache"], res["--no-prefix-cache"]
    res["summary"] = {"chat_ttft_ratio_turns_2_on": [b / a for a, b in zip(on["chat_ttft_s"][1:], off["chat_ttft_s"][1:])]}
    print("chat TTFT turns 2-%d, off / on: %s" % (args.turns, ", ".join("%.1fx" % x for x in
                                                                       res["summary"]["chat_ttft_ratio_turns_2_on"])))
    if args.rounds:
        bursts(res, on, off)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "prefix_cache.json"), "w") as f:
            json.dump(res, f, indent=1)


def bursts(res, on, off):
    comp_on = sum(r["computed"] for r in on["rounds"])
    comp_off = sum(r["computed"] for r in off["rounds"])
    thr_on = statistics.median(r["req_per_s"] for r in on["rounds"])
    thr_off = statistics.median(r["req_per_s"] for r in off["rounds"])
    res["summary"].update({"computed_fall": 1 - comp_on / comp_off, "throughput_ratio": thr_on / thr_off})
    print("prefill tokens computed: %d with the cache, %d without: %.1f%% fewer" % (comp_on, comp_off,
                                                                                   100 * res["summary"]["computed_fall"]))
    print("throughput (median burst): %.2f vs %.2f req/s: %.2fx" % (thr_on, thr_off, res["summary"]["throughput_ratio"]))


if __name__ == "__main__":
    main()
