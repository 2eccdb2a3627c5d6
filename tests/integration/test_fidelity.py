"""Fidelity of the whole cluster against Hugging Face transformers: for every golden case in
tests/data/e2e/golden.json (made by tools/gen_e2e_goldens.py from model.generate), greedy answers
through router -> encoder -> prefill -> decode must be token-identical, and the logprobs in
OpenAI's format (chat: logprobs + top_logprobs; completions: logprobs=N) must match HF's float32
log-softmax within 1e-3. Checked non-streaming and streaming. The prompt ids the router builds are
checked separately through /tokenize, so a failure says which stage differs. Prompts longer than
4 x CHUNK tokens (three images, a ~490-token text: positions well beyond 151) run a second time on a
cluster whose prefill worker takes CHUNK tokens per step. The first cluster's workers store their
weights as fp32 (--weight-dtype f32); every case also runs (non-streaming) on a cluster left to
--weight-dtype auto, which keeps the bundled checkpoint's bf16 matrices as bf16 (the same weights,
so the same goldens hold), as does the chunked cluster.

Run: python3 tests/integration/test_fidelity.py   (PRISM_BINARY_DIR=build dir)
     FIDELITY_CASES=name1,name2 limits the cases; PRISM_E2E_GOLDEN_DIR=dir reads goldens made with
     tools/gen_e2e_goldens.py --out dir (--model-dir for another checkpoint).
"""
import base64
import copy
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from cluster import ROOT, Cluster, binary, fresh_heartbeats, run_tests  # noqa: E402

DATA = os.environ.get("PRISM_E2E_GOLDEN_DIR") or os.path.join(ROOT, "tests", "data", "e2e")
TOL = 1e-3          # |logprob - HF| bound (issue: "within 1e-3")
TIE = 1e-4          # HF top-k entries closer than this may legitimately swap places

with open(os.path.join(DATA, "golden.json"), encoding="utf-8") as f:
    GOLD = json.load(f)
CASES = GOLD["cases"]
if os.environ.get("FIDELITY_CASES"):
    want = set(os.environ["FIDELITY_CASES"].split(","))
    CASES = [c for c in CASES if c["name"] in want]
MAX_TOKENS = GOLD["max_tokens"]
TOP = GOLD["top_logprobs"]


def data_url(name):
    with open(os.path.join(DATA, name), "rb") as f:
        data = f.read()
    mime = "image/png" if name.endswith(".png") else "image/jpeg"
    return "data:%s;base64,%s" % (mime, base64.b64encode(data).decode())


def request_body(case, stream):
    body = copy.deepcopy(case["request"])
    for m in body.get("messages", []):
        if isinstance(m["content"], list):
            for p in m["content"]:
                if p["type"] == "image_url":
                    p["image_url"]["url"] = data_url(p["image_url"]["url"])
    body.update(model=SERVED, temperature=0, max_tokens=MAX_TOKENS)
    if case["endpoint"] == "/v1/chat/completions":
        body.update(logprobs=True, top_logprobs=TOP)
    else:
        body.update(logprobs=TOP)
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


# ---------------------------------------------------------------- normalised results

def chat_steps(entries):
    """OpenAI chat logprobs.content -> [(bytes, logprob, [(bytes, logprob)])]."""
    return [(bytes(e["bytes"]), e["logprob"], [(bytes(t["bytes"]), t["logprob"]) for t in e["top_logprobs"]])
            for e in entries]


def completion_steps(lp):
    """Legacy completions logprobs -> [(token string as utf-8, logprob, [(key utf-8, logprob)])]."""
    return [(tok.encode("utf-8"), v, [(k.encode("utf-8"), x) for k, x in top.items()])
            for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


def same_token(got, gold_bytes, chat):
    """Chat carries the token's raw bytes; completions only a (possibly lossy) string."""
    if chat:
        return got == bytes(gold_bytes)
    return got == text_key(gold_bytes).encode("utf-8")


def text_key(b):
    """The legacy completions dict key of a token with raw bytes b (invalid UTF-8 replaced)."""
    return bytes(b).decode("utf-8", "replace")


def first_divergence(case, steps, chat):
    for i, (g, (tb, _, _)) in enumerate(zip(case["steps"], steps)):
        if not same_token(tb, g["bytes"], chat):
            return i
    return min(len(case["steps"]), len(steps))


def check_steps(case, steps, chat, where):
    """Compares per-token logprobs with HF; returns the largest |difference| seen."""
    gold = case["steps"]
    div = first_divergence(case, steps, chat)
    if div < len(gold) or len(steps) != len(gold):
        g = gold[div] if div < len(gold) else None
        gap = (g["top"][0][1] - g["top"][1][1]) if g else float("nan")
        got = steps[div] if div < len(steps) else None
        # the HF token's logprob as the cluster reports it there (when it is in the cluster's top-k)
        there = [x for b, x in got[2] if same_token(b, g["bytes"], chat)] if got and g else []
        raise AssertionError("%s: generated tokens diverge from HF at step %d (%d tokens, HF %d): got %r (%.5f), "
                             "HF %r (%.5f; cluster gives it %s; HF top-2 gap %.5f); max |dlogprob| before: %.2e"
                             % (where, div, len(steps), len(gold), got[0] if got else None, got[1] if got else 0,
                                bytes(g["bytes"]) if g else None, g["logprob"] if g else 0,
                                "%.5f" % there[0] if there else "n/a", gap,
                                max([abs(s[1] - x["logprob"]) for s, x in zip(steps[:div], gold)] or [0])))
    worst = 0.0
    for i, (g, (tb, lp, top)) in enumerate(zip(gold, steps)):
        d = abs(lp - g["logprob"])
        worst = max(worst, d)
        assert d <= TOL, "%s: step %d token %r logprob %.6f, HF %.6f (|d| %.2e > %g)" % (
            where, i, tb, lp, g["logprob"], d, TOL)
        gtop = g["top"]
        if chat:
            assert len(top) == len(gtop), "%s: step %d has %d top_logprobs, want %d" % (where, i, len(top), len(gtop))
        else:
            # the legacy format is a dict keyed by token text: tokens with equal text collapse
            keys = []
            for _, _, b in gtop:
                if text_key(b) not in keys:
                    keys.append(text_key(b))
            assert len(top) == len(keys), "%s: step %d has %d top_logprobs keys, want %d" % (
                where, i, len(top), len(keys))
        vals = sorted((x for _, x in top), reverse=True)
        gvals = sorted((x for _, x, _ in gtop), reverse=True)[:len(vals)] if chat else None
        if chat:
            for k, (v, gv) in enumerate(zip(vals, gvals)):
                worst = max(worst, abs(v - gv))
                assert abs(v - gv) <= TOL, "%s: step %d top_logprobs[%d] %.6f, HF %.6f" % (where, i, k, v, gv)
        # identity of well-separated entries (ties may come in either order)
        for k, (gid, gv, gb) in enumerate(gtop):
            near = [x for j, (_, x, _) in enumerate(gtop) if j != k and abs(x - gv) <= TIE]
            if abs(g["next"] - gv) <= TIE:
                near.append(g["next"])  # tied with the first token beyond the top-k
            if near:
                continue
            if not chat and [text_key(b2) for _, _, b2 in gtop].count(text_key(gb)) > 1:
                continue  # tokens with equal text share one key of the legacy dict
            match = [x for b, x in top if same_token(b, gb, chat)]
            assert match, "%s: step %d: HF's top token %r (%.6f, id %d) missing from top_logprobs %r" % (
                where, i, bytes(gb), gv, gid, top)
            assert any(abs(x - gv) <= TOL for x in match), "%s: step %d: token %r logprob %r, HF %.6f" % (
                where, i, bytes(gb), match, gv)
            worst = max(worst, min(abs(x - gv) for x in match))
    return worst


def check_common(case, text, finish, usage, where):
    assert usage["prompt_tokens"] == len(case["prompt_ids"]), "%s: prompt_tokens %d, HF %d" % (
        where, usage["prompt_tokens"], len(case["prompt_ids"]))
    assert usage["completion_tokens"] == len(case["tokens"]), "%s: completion_tokens %d, HF %d" % (
        where, usage["completion_tokens"], len(case["tokens"]))
    assert text == case["text"], "%s: text differs from HF:\n  got %r\n  HF  %r" % (where, text, case["text"])
    assert finish == case["finish_reason"], "%s: finish_reason %s, HF %s" % (where, finish, case["finish_reason"])


# ---------------------------------------------------------------- checks per case

C = None
SERVED = None       # the router's model id (the golden's request names the bundled model)
REPORT = {}


def check_prompt(case):
    """The router's prompt ids (via /tokenize, placeholders expanded like the router does) == HF's."""
    with open(os.path.join(C.model, "config.json")) as f:
        cfg = json.load(f)
    image_id, L = cfg.get("image_token_index", cfg.get("image_token_id")), cfg["image_seq_length"]
    if case["endpoint"] == "/v1/chat/completions":
        msgs = copy.deepcopy(case["request"]["messages"])
        for m in msgs:
            if isinstance(m["content"], list):
                m["content"] = [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
        body = {"model": SERVED, "messages": msgs, "add_generation_prompt": True}
    else:
        body = {"model": SERVED, "prompt": case["request"]["prompt"]}
    status, r = C.post_json("/tokenize", body)
    assert status == 200, (status, r)
    ids = []
    for t in r["tokens"]:
        ids += [t] * L if t == image_id else [t]
    if ids != case["prompt_ids"]:
        k = next((i for i, (a, b) in enumerate(zip(ids, case["prompt_ids"])) if a != b), min(len(ids), len(case["prompt_ids"])))
        raise AssertionError("prompt ids differ from HF's processor at index %d (router %d ids, HF %d):\n  router %r\n"
                             "  HF     %r" % (k, len(ids), len(case["prompt_ids"]), ids[max(0, k - 3):k + 8],
                                              case["prompt_ids"][max(0, k - 3):k + 8]))


def check_non_stream(case):
    chat = case["endpoint"] == "/v1/chat/completions"
    status, r = C.post_json(case["endpoint"], request_body(case, False))
    assert status == 200, (status, r)
    ch = r["choices"][0]
    text = ch["message"]["content"] if chat else ch["text"]
    steps = chat_steps(ch["logprobs"]["content"]) if chat else completion_steps(ch["logprobs"])
    where = case["name"] + " (non-stream)"
    try:
        worst = check_steps(case, steps, chat, where)
    finally:
        REPORT.setdefault(case["name"], {})["text"] = text
    check_common(case, text, ch["finish_reason"], r["usage"], where)
    REPORT[case["name"]]["max_dlogprob"] = worst


def check_stream(case):
    chat = case["endpoint"] == "/v1/chat/completions"
    status, events, done = C.stream(case["endpoint"], request_body(case, True))
    assert status == 200 and done, (status, events[-1:] if events else events)
    text, finish, entries, usage = "", None, [], None
    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    for e in events:
        if e.get("usage"):
            usage = e["usage"]
        for ch in e.get("choices") or []:
            if chat:
                text += ch["delta"].get("content") or ""
                entries += ((ch.get("logprobs") or {}).get("content") or [])
            else:
                text += ch.get("text") or ""
                for k in lp:
                    lp[k] += ((ch.get("logprobs") or {}).get(k) or [])
            finish = ch.get("finish_reason") or finish
    assert usage, "no usage chunk"
    steps = chat_steps(entries) if chat else completion_steps(lp)
    where = case["name"] + " (stream)"
    check_steps(case, steps, chat, where)
    check_common(case, text, finish, usage, where)


def batch_counters():
    """(forwards, prompts they carried, most prompts in one forward) of the prefill worker, as its
    latest heartbeat says."""
    return tuple(C.metric(m, worker="prefill-0") or 0 for m in (
        "prism:worker_prefill_forwards_total", "prism:worker_prefill_forward_prompts_total",
        "prism:worker_prefill_batch_peak"))


def check_batched(cases, where):
    """Every case at once (batched prefill: their prompts share forwards, a long one's chunks beside
    short ones, text beside images): each answer still HF's, and forwards carried several prompts."""
    import concurrent.futures
    fresh_heartbeats(C, "prefill-0")
    before = batch_counters()
    errors = []

    def one(case):
        try:
            check_non_stream(case)
        except AssertionError as e:
            errors.append(str(e))
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as ex:
        list(ex.map(one, cases))
    assert not errors, "%s:\n%s" % (where, "\n".join(errors))
    fresh_heartbeats(C, "prefill-0")
    after = batch_counters()
    fwd, prompts = after[0] - before[0], after[1] - before[1]
    print("  %s: %d forwards carried %d prompts (%.2f a forward), at most %d in one" % (
        where, fwd, prompts, prompts / max(fwd, 1), after[2]), flush=True)
    assert after[2] > 1 and prompts > fwd, ("no forward carried two prompts", before, after)


def make_test(fn, case, suffix):
    def t():
        fn(case)
    t.__name__ = "%s_%s" % (case["name"], suffix)
    return t


# Prompts longer than this many tokens run again with --chunked-prefill-size CHUNK: prefill in
# several chunks, image spans crossing chunk boundaries, against the same HF goldens.
CHUNK = 32


def main():
    global C, SERVED
    C = Cluster(model=os.path.join(ROOT, GOLD["model_dir"]), router_args=(),
                common_worker_args=["--weight-dtype", "f32"])
    try:
        ready = C.wait_ready()
        for w in ("encoder-0", "prefill-0", "decode-0"):
            C.wait_log(w, "weights stored as f32")
        SERVED = json.loads(C.request("GET", "/v1/models")[2])["data"][0]["id"]
        print("cluster ready in %.2fs; %d golden cases from %s (HF %s, %s)" % (
            ready, len(CASES), GOLD["generator"], GOLD["transformers"], GOLD["image_processor"]), flush=True)
        tests = []
        for case in CASES:
            tests += [make_test(check_prompt, case, "prompt_ids"), make_test(check_non_stream, case, "greedy"),
                      make_test(check_stream, case, "stream")]

        def test_all_cases_at_once_batched():
            check_batched(CASES, "all cases at once")
        tests.append(test_all_cases_at_once_batched)
        rc = run_tests(tests)
        for name, r in REPORT.items():
            if "max_dlogprob" in r:
                print("  %-28s max |logprob - HF| %.2e" % (name, r["max_dlogprob"]))
        if rc:
            print("cluster logs: %s" % C.log_dir)
    finally:
        C.stop()
    # Every worker left to --weight-dtype auto, which keeps the bundled checkpoint's bf16 matrices
    # as bf16: the weights are HF's own and the answers must still match HF's fp32 goldens (tokens,
    # logprobs within TOL).
    C = Cluster(model=os.path.join(ROOT, GOLD["model_dir"]), router_args=())
    try:
        C.wait_ready()
        for w in ("encoder-0", "prefill-0", "decode-0"):
            C.wait_log(w, "weights stored as bf16 (the checkpoint's own dtype)")
        print("--weight-dtype auto: bf16 on every worker", flush=True)
        # a dtype no worker computes with is refused at start-up, before any model loads
        for kind in ("encoder_worker", "prefill_worker", "decode_worker"):
            p = subprocess.run([binary(kind), "--weight-dtype", "f16", "--insecure-no-curve"], capture_output=True,
                               text=True, timeout=30)
            assert p.returncode == 2 and "--weight-dtype must be auto, f32 or bf16" in p.stderr + p.stdout, (kind, p)
        rc = run_tests([make_test(check_non_stream, c, "greedy_bf16_weights") for c in CASES]) or rc
        if rc:
            print("cluster logs: %s" % C.log_dir)
    finally:
        C.stop()
    long_cases = [c for c in CASES if len(c["prompt_ids"]) > 4 * CHUNK]
    if not long_cases:
        return rc
    C = Cluster(model=os.path.join(ROOT, GOLD["model_dir"]), router_args=(),
                worker_args={"prefill_worker": ["--chunked-prefill-size", str(CHUNK)]})
    try:
        C.wait_ready()
        print("--chunked-prefill-size %d: %s" % (CHUNK, ", ".join("%s (%d tokens)" % (c["name"], len(c["prompt_ids"]))
                                                                for c in long_cases)), flush=True)
        def test_all_cases_at_once_chunked():
            # the long prompts in chunks of CHUNK tokens, the short ones riding beside their chunks
            check_batched(CASES, "all cases at once, --chunked-prefill-size %d" % CHUNK)
        rc2 = run_tests([make_test(check_non_stream, c, "greedy_chunk%d" % CHUNK) for c in long_cases] +
                        [test_all_cases_at_once_chunked])
        if rc2:
            print("cluster logs: %s" % C.log_dir)
    finally:
        C.stop()
    return rc or rc2


if __name__ == "__main__":
    sys.exit(main())
