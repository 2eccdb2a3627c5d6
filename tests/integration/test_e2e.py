"""End-to-end tests of the disaggregated request path on CPU: router -> encoder -> prefill -> decode.

Run: python3 tests/integration/test_e2e.py   (PRISM_BINARY_DIR=build dir)
"""
import concurrent.futures
import base64
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import (Cluster, binary, chat_body, check_answer, distinct_requests, fresh_heartbeats, image_url,  # noqa: E402
                     make_image, read_response, reference, run_tests, tool_env, wait_for, work_counters, MODEL,
                     STAGES)

TMP = tempfile.mkdtemp(prefix="prism-e2e-")
JPG = make_image(os.path.join(TMP, "red_circle.jpg"), width=640, height=480, shape="circle", color="red")
PNG = make_image(os.path.join(TMP, "blue_square.png"), width=300, height=200, shape="square", color="blue",
                 background="gray")
PROG = make_image(os.path.join(TMP, "photo_prog.jpg"), width=1024, height=768, photo=True, progressive=True)
BOMB = make_image(os.path.join(TMP, "bomb.png"), bomb=65000)

# --timing-header: the time split of each answer (operators' header); JSON logs at debug: the trace test
# follows one request through every process's lines
LOGS = ["--log-format", "json", "--log-level", "debug"]
C = Cluster(router_args=["--timing-header", *LOGS], common_worker_args=LOGS)
READY_S = C.wait_ready()
print("cluster ready in %.2fs" % READY_S, flush=True)


def ok_request(body, path="/v1/chat/completions"):
    status, r = C.post_json(path, body)
    assert status == 200, (status, r)
    return r


def check_usage(r):
    u = r["usage"]
    assert u["prompt_tokens"] > 0 and u["completion_tokens"] >= 1, u
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u


def test_health_ready_models():
    assert C.request("GET", "/health")[0] == 200
    assert C.request("GET", "/ready")[0] == 200
    status, _, data = C.request("GET", "/v1/models")
    models = json.loads(data)
    assert status == 200 and models["data"][0]["id"] == "prism-tiny-llava", models
    assert models["data"][0]["max_model_len"] > 0


def test_version_and_help():
    status, _, data = C.request("GET", "/version")
    assert status == 200 and json.loads(data)["version"], data
    # every binary documents its flags
    for name in ("router", "encoder_worker", "prefill_worker", "decode_worker", "prism_generate", "prism_imgtool",
                 "prism_wire"):
        p = subprocess.run([binary(name), "--help"], capture_output=True, text=True, timeout=30, env=tool_env())
        assert p.returncode == 0 and "Usage" in p.stdout + p.stderr and "--" in p.stdout + p.stderr, (name, p)


def test_stop_token_ids_and_max_completion_tokens():
    body = chat_body("What is in the image?", [JPG], max_tokens=12, temperature=0, ignore_eos=True, logprobs=True,
                     return_tokens_as_token_ids=True)
    full = ok_request(body)
    ids = [int(e["token"].split(":")[1]) for e in full["choices"][0]["logprobs"]["content"]]
    assert len(ids) == 12, ids
    stop_id = ids[3]
    k = ids.index(stop_id)  # first occurrence
    r = ok_request(dict(body, stop_token_ids=[stop_id]))
    got = [int(e["token"].split(":")[1]) for e in r["choices"][0]["logprobs"]["content"]]
    assert got == ids[:k + 1], (got, ids, stop_id)  # the stop token is generated (and counted) ...
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == k + 1, r["usage"]
    plain = ok_request(chat_body("What is in the image?", [JPG], max_tokens=12, temperature=0, ignore_eos=True,
                                 stop_token_ids=[stop_id]))
    status, d = C.post_json("/detokenize", {"tokens": ids[:k]})
    assert plain["choices"][0]["message"]["content"] == d["prompt"], (plain, d)  # ... but not in the text
    # max_completion_tokens is OpenAI's newer name for max_tokens
    r = ok_request(chat_body("What is in the image?", [JPG], max_completion_tokens=3, temperature=0, ignore_eos=True))
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length", r


def test_embedding_cache_hit():
    """The same image again: the encoder answers from its embedding cache (no decode, no ViT), and
    the answer is the same."""
    body = chat_body("What is in the image?", [PROG], max_tokens=8, temperature=0)
    timings = []
    texts = []
    for _ in range(2):
        status, headers, data = C.request("POST", "/v1/chat/completions", body)
        assert status == 200, (status, data[:200])
        timings.append(dict(kv.split("=") for kv in {k.lower(): v for k, v in headers.items()}["x-prism-timing"].split()))
        texts.append(json.loads(data)["choices"][0]["message"]["content"])
    assert timings[1]["cache_hits"] == "1" and float(timings[1]["image_decode_ms"]) == 0, timings
    assert texts[0] == texts[1], texts


def test_chat_jpeg():
    r = ok_request(chat_body("What is in the image?", [JPG], max_tokens=12, temperature=0))
    assert r["object"] == "chat.completion" and r["id"].startswith("chatcmpl-")
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    assert r["choices"][0]["finish_reason"] in ("stop", "length")
    check_usage(r)
    # 64 image tokens per image in the bundled model: the prompt must count them.
    assert r["usage"]["prompt_tokens"] > 64


def test_chat_png_and_progressive_jpeg():
    for img in (PNG, PROG):
        r = ok_request(chat_body("Describe the image.", [img], max_tokens=8, temperature=0))
        check_usage(r)


def test_text_only_and_completions():
    r = ok_request({"model": "prism-tiny-llava", "messages": [{"role": "user", "content": "Hello there"}],
                    "max_tokens": 8})
    check_usage(r)
    r = ok_request({"model": "prism-tiny-llava", "prompt": "A red circle", "max_tokens": 5, "temperature": 0},
                   path="/v1/completions")
    assert r["object"] == "text_completion" and isinstance(r["choices"][0]["text"], str)
    check_usage(r)
    assert r["usage"]["completion_tokens"] <= 5


def test_max_tokens_length_finish():
    r = ok_request(chat_body("What do you see?", [JPG], max_tokens=3, temperature=0, ignore_eos=True))
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "length", r


def test_stream_equals_non_stream():
    body = chat_body("What is in the image?", [JPG], max_tokens=24, temperature=0)
    full = ok_request(body)
    status, events, done = C.stream("/v1/chat/completions",
                                    dict(body, stream=True, stream_options={"include_usage": True}))
    assert status == 200 and done, (status, events)
    first = events[0]["choices"][0]["delta"]
    assert first.get("role") == "assistant", first
    ids = {e["id"] for e in events}
    assert len(ids) == 1, ids
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == full["choices"][0]["message"]["content"], (text, full)
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"] and e["choices"][0]["finish_reason"]]
    assert finishes == [full["choices"][0]["finish_reason"]], finishes
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"] == full["usage"], (usage, full["usage"])


def test_disaggregated_equals_single_process():
    ref = reference([JPG], "What is in the image?", 32)
    r = ok_request(chat_body("What is in the image?", [JPG], max_tokens=32, temperature=0))
    assert r["usage"]["prompt_tokens"] == ref["prompt_tokens"], (r["usage"], ref["prompt_tokens"])
    assert r["usage"]["completion_tokens"] == len(ref["token_ids"]), (r["usage"], ref)
    assert r["choices"][0]["message"]["content"] == ref["text"], (r["choices"][0]["message"]["content"], ref["text"])


def test_seeded_sampling_reproducible():
    """The client's seed reaches the sampler: one seed gives one answer, twice; other seeds give
    other answers; temperature 0 is greedy (no seed changes it) and a temperature changes it. A router that drops the seed, or sends a constant one, or ignores the temperature fails."""
    def text(**kw):
        body = chat_body("Describe the image.", [PNG], max_tokens=16, ignore_eos=True, **kw)
        return ok_request(body)["choices"][0]["message"]["content"]
    a = text(temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    b = text(temperature=0.9, top_p=0.9, top_k=50, seed=1234)
    assert a == b, (a, b)
    # the bundled model is sure of itself: at temperature 2 its tokens spread enough to show seeds
    seeded = {seed: text(temperature=2.0, seed=seed) for seed in (1, 2, 3, 4, 5)}
    assert len(set(seeded.values())) >= 3, ("other seeds, the same answers: the seed is not used", seeded)
    assert all(text(temperature=2.0, seed=seed) == t for seed, t in list(seeded.items())[:2]), seeded
    greedy = text(temperature=0, seed=1)
    assert greedy == text(temperature=0, seed=2), "temperature 0 depends on the seed"
    assert all(t != greedy for t in seeded.values()), ("temperature 2 answered as greedy", seeded, greedy)


def test_logprobs():
    r = ok_request(chat_body("What is in the image?", [JPG], max_tokens=4, temperature=0, logprobs=True,
                             top_logprobs=3, ignore_eos=True))
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == 4, content
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 3
        # greedy: the sampled token is the most likely one
        assert abs(entry["top_logprobs"][0]["logprob"] - entry["logprob"]) < 1e-5, entry


def test_stop_string():
    base = ok_request(chat_body("What is in the image?", [JPG], max_tokens=24, temperature=0, ignore_eos=True))
    text = base["choices"][0]["message"]["content"]
    if len(text) < 4:
        return  # nothing to cut
    stop = text[2:4]
    r = ok_request(chat_body("What is in the image?", [JPG], max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))
    got = r["choices"][0]["message"]["content"]
    assert got == text[:text.index(stop)], (got, text, stop)
    assert r["choices"][0]["finish_reason"] == "stop"


def test_concurrent_distinct_requests():
    """18 requests at once, 9 different pictures/questions: each answer equals its own reference
    (identical prompts would let answers swapped between requests pass)."""
    reqs = distinct_requests(TMP)

    def one(i):
        body, ref = reqs[i % len(reqs)]
        status, r = C.post_json("/v1/chat/completions", body)
        check_answer(status, r, ref, "request %d" % i)
        check_usage(r)

    with concurrent.futures.ThreadPoolExecutor(18) as ex:
        list(ex.map(one, range(2 * len(reqs))))


def expect_error(status_want, body=None, raw=None, path="/v1/chat/completions"):
    status, headers, data = C.request("POST", path, raw if raw is not None else body)
    assert status == status_want, (status, data[:300])
    err = json.loads(data)["error"]
    assert err["message"] and err["type"], err
    # the cluster keeps serving
    ok_request(chat_body("What is in the image?", [PNG], max_tokens=2))
    return err


def test_malformed_requests():
    expect_error(400, raw=b"{not json")
    expect_error(400, body={"model": "prism-tiny-llava"})
    expect_error(400, body=chat_body("hi", max_tokens=-5))
    bad_b64 = chat_body("hi")
    bad_b64["messages"][0]["content"].insert(0, {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,@@@@"}})
    expect_error(400, body=bad_b64)
    with open(JPG, "rb") as f:
        data = f.read()
    trunc = os.path.join(TMP, "trunc.jpg")
    with open(trunc, "wb") as f:
        f.write(data[: len(data) // 2])
    expect_error(400, body=chat_body("hi", [trunc]))
    corrupt = os.path.join(TMP, "corrupt.jpg")
    with open(corrupt, "wb") as f:
        f.write(data[:300] + bytes(range(256)) * 40 + data[-100:])
    st, _, _ = C.request("POST", "/v1/chat/completions", chat_body("hi", [corrupt]))
    assert st in (200, 400), st  # decodable garbage may still be an image; never a 5xx
    noimg = os.path.join(TMP, "noimg.jpg")
    with open(noimg, "wb") as f:
        f.write(b"this is not an image at all" * 10)
    expect_error(400, body=chat_body("hi", [noimg]))
    expect_error(404, body=dict(chat_body("hi"), model="no-such-model"))
    expect_error(400, body=chat_body("hi", [JPG] * 9))  # more than --limit-mm-per-prompt


def test_bomb_refused_from_header():
    err = expect_error(400, body=chat_body("hi", [BOMB]))
    assert "65000" in err["message"], err


def test_bomb_refused_on_its_first_bytes():
    """A client uploading a 65000x65000 PNG inside a 30 MB body gets its 400 after the first 64 KiB,
    while it is still sending: the router checks an image's header as it streams in, not once the
    whole body is in. Counted once, as the whole-body refusal is."""
    with open(BOMB, "rb") as f:
        head = f.read()
    b64 = base64.b64encode(head + os.urandom(22 * 1024 * 1024)).decode()
    body = json.dumps(chat_body("hi", max_tokens=2)).encode()
    body = body.replace(b'"content": [', b'"content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,'
                        + b64.encode() + b'"}}, ', 1)
    before = (C.metric("prism:requests_refused_total", reason="image_too_large"),
              C.metric("prism:requests_refused_total", reason="bad_request"))
    s = socket.create_connection(("127.0.0.1", C.port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body[:64 * 1024])
    status, _, data = read_response(s)
    s.close()
    assert status == 400, data[:200]
    err = json.loads(data)["error"]
    assert "Image 0 is 65000x65000 pixels" in err["message"], err
    assert (C.metric("prism:requests_refused_total", reason="image_too_large"),
            C.metric("prism:requests_refused_total", reason="bad_request")) == (before[0] + 1, before[1] + 1)
    ok_request(chat_body("What is in the image?", [PNG], max_tokens=2))


def test_metrics():
    status, _, data = C.request("GET", "/metrics")
    text = data.decode()
    assert status == 200
    for name in ("vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_count",
                 "vllm:generation_tokens_total", "prism:requests_refused_total", "prism:worker_memory_peak_bytes",
                 "prism:worker_heartbeats_total", "prism:worker_heap_allocations_total"):
        assert name in text, name
    # every refusal reason is exported (a dashboard can alert on any), and vLLM's preemption counter
    # exists and is 0: decode admission reserves KV for max_tokens, so nothing is ever preempted
    for reason in ("body_too_large", "body_bytes_inflight", "connections", "queue_full",
                   "queue_wait", "no_workers", "bad_request", "too_many_images", "image_too_large"):
        assert C.metric("prism:requests_refused_total", reason=reason) is not None, reason
    assert C.metric("vllm:num_preemptions_total") == 0


def stage_totals():
    """{stage: (sum, count)} of prism:request_stage_seconds, and the e2e histogram's (sum, count)."""
    m = C.metrics()
    got = {lb["stage"]: [0.0, 0.0] for n, lb, v in m if n == "prism:request_stage_seconds_count"}
    for n, lb, v in m:
        if n in ("prism:request_stage_seconds_sum", "prism:request_stage_seconds_count"):
            got[lb["stage"]][n.endswith("_count")] += v
    e2e = (C.metric("vllm:e2e_request_latency_seconds_sum"), C.metric("vllm:e2e_request_latency_seconds_count"))
    return got, e2e


def worker_stage_totals():
    """{(tier, stage): [sum, count]} of prism:worker_stage_seconds over the tier's workers."""
    got = {}
    for n, lb, v in C.metrics():
        if n in ("prism:worker_stage_seconds_sum", "prism:worker_stage_seconds_count"):
            assert lb["worker"], lb
            got.setdefault((lb["tier"], lb["stage"]), [0.0, 0.0])[n.endswith("_count")] += v
    return got


def test_stage_histograms_add_up():
    """prism:request_stage_seconds partitions each finished request's end-to-end time: over text and
    image requests (fresh images, streaming, n=2, a 1-token answer), the stages' sums add up to the e2e
    histogram's sum and every stage counts every request; x-prism-timing's stages_ms add up to its
    e2e_ms with the same names."""
    before, e2e0 = stage_totals()
    assert list(before) == STAGES, list(before)
    wbefore = worker_stage_totals()
    assert sorted(wbefore) == sorted([("encoder", "encoder_queue"), ("encoder", "image_decode"), ("encoder", "vit"),
                                      ("prefill", "prefill_queue"),
                                      ("prefill", "prefill"), ("decode", "decode_queue"),
                                      ("decode", "decode_first_step"), ("decode", "decode")]), sorted(wbefore)
    img = make_image(os.path.join(TMP, "stages.jpg"), width=800, height=600, shape="square", color="green")
    bodies = [chat_body("Say something.", [], max_tokens=6, temperature=0),
              chat_body("What is in the image?", [img], max_tokens=6, temperature=0, ignore_eos=True),
              chat_body("What is in the image?", [PNG], max_tokens=1),
              chat_body("Describe the image.", [JPG], max_tokens=4, n=2, temperature=0.7, seed=3)]
    for body in bodies:
        status, headers, data = C.request("POST", "/v1/chat/completions", body)
        assert status == 200, (status, data[:200])
        t = dict(kv.split("=") for kv in {k.lower(): v for k, v in headers.items()}["x-prism-timing"].split())
        st = dict((k, float(v)) for k, v in (x.split(":") for x in t["stages_ms"].split(",")))
        assert list(st) == STAGES and min(st.values()) >= 0, t
        assert abs(sum(st.values()) - float(t["e2e_ms"])) <= 0.01 * len(st) + 0.01, t
    status, _, done = C.stream("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 5, "stream": True})
    assert status == 200 and done, status
    n_req = len(bodies) + 1
    after, e2e1 = stage_totals()
    assert e2e1[1] - e2e0[1] == n_req, (e2e0, e2e1)
    for name in STAGES:
        assert after[name][1] - before[name][1] == n_req, (name, before[name], after[name])
    stage_sum = sum(after[k][0] - before[k][0] for k in STAGES)
    e2e_sum = e2e1[0] - e2e0[0]
    assert abs(stage_sum - e2e_sum) <= 0.02 * e2e_sum, (stage_sum, e2e_sum)
    # the work shows where it happened: prefill and decode ran for these requests
    assert after["prefill"][0] > before["prefill"][0] and after["decode"][0] > before["decode"][0], (before, after)
    # per worker (prism:worker_stage_seconds): each finished request once on its prefill and its decode
    # worker, with the very seconds of its request stages; the encoders timed each image they encoded
    wafter = worker_stage_totals()
    for (tier, name), (tot, cnt) in wafter.items():
        dsum, dcnt = tot - wbefore[(tier, name)][0], cnt - wbefore[(tier, name)][1]
        if tier == "encoder":
            assert 1 <= dcnt <= 3, (name, dcnt)   # three requests with an image (early jobs: theirs)
            continue
        assert dcnt == n_req, (tier, name, dcnt)
        want = after[name][0] - before[name][0]
        assert abs(dsum - want) <= 1e-6 + 1e-6 * want, (tier, name, dsum, want)


def test_upload_time_is_its_own_histogram():
    """A body that takes 0.6 s to come is timed by prism:request_upload_seconds (first byte to last) and
    x-prism-timing's upload_ms, and stays out of the end-to-end latency that the stages partition."""
    body = json.dumps(chat_body("Say something.", [], max_tokens=2, temperature=0)).encode()
    up0 = (C.metric("prism:request_upload_seconds_sum"), C.metric("prism:request_upload_seconds_count"))
    e2e0 = C.metric("vllm:e2e_request_latency_seconds_sum")
    s = socket.create_connection(("127.0.0.1", C.port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
    time.sleep(0.6)
    s.sendall(body[10:])
    status, headers, data = read_response(s)
    s.close()
    assert status == 200, data[:200]
    t = dict(kv.split("=") for kv in headers["x-prism-timing"].split())
    e2e_ms = float(t["e2e_ms"])
    assert float(t["upload_ms"]) >= 600 and e2e_ms < float(t["upload_ms"]), t
    up = C.metric("prism:request_upload_seconds_sum") - up0[0]
    assert C.metric("prism:request_upload_seconds_count") - up0[1] == 1
    assert abs(up - float(t["upload_ms"]) / 1e3) < 0.002, (up, t)
    assert abs(C.metric("vllm:e2e_request_latency_seconds_sum") - e2e0 - e2e_ms / 1e3) < 0.002, t


def json_log(name):
    """The JSON lines of one process's log, parsed (every line the logger wrote must parse)."""
    out = []
    for line in C.log(name, tail=0).splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_trace_context_in_every_process():
    """A W3C traceparent's trace id goes with the request to the encoder, prefill and decode: it is in
    lines about the request in all four logs (JSON, one object per line, each with the fields log
    pipelines key on) and in no line about another request; the answer carries x-request-id and a
    traceparent of the same trace. Without one, the router makes one."""
    trace = "%032x" % int.from_bytes(os.urandom(16), "big")
    img = make_image(os.path.join(TMP, "traced.jpg"), width=320, height=240, shape="circle", color="blue")
    body = chat_body("What is in the image?", [img], max_tokens=4, temperature=0, ignore_eos=True)
    status, headers, data = C.request("POST", "/v1/chat/completions", body,
                                      headers={"traceparent": "00-%s-00f067aa0ba902b7-01" % trace})
    assert status == 200, (status, data[:200])
    h = {k.lower(): v for k, v in headers.items()}
    assert h["x-request-id"] == json.loads(data)["id"], h
    assert re.fullmatch("00-%s-[0-9a-f]{16}-01" % trace, h["traceparent"]), h
    status, headers, _ = C.request("POST", "/v1/chat/completions", chat_body("Hi", [], max_tokens=2))
    made = {k.lower(): v for k, v in headers.items()}["traceparent"]
    assert status == 200 and re.fullmatch("00-[0-9a-f]{32}-[0-9a-f]{16}-01", made) and trace not in made, made
    time.sleep(0.3)   # the decode's last lines
    # its image may have gone to the encoder while its body uploaded (an early encode): that job carries
    # the same trace under its own id
    early = {str(int(m.group(1), 16)) for ln in json_log("router") if ln["trace_id"] == trace
             for m in [re.match(r"early encode ([0-9a-f]{16}):", ln["message"])] if m}
    for name, process in (("router", "router"), ("encoder-0", "encoder"), ("prefill-0", "prefill"),
                          ("decode-0", "decode")):
        lines = json_log(name)
        assert lines, name
        for ln in lines[-50:]:
            assert set(ln) >= {"time", "level", "process", "worker_id", "request_id", "trace_id", "message"}, ln
            assert ln["process"] == process and ln["worker_id"], ln
        mine = [ln for ln in lines if ln["trace_id"] == trace]
        assert mine, (name, lines[-5:])
        # its lines name one request (the router's id of it; its early job aside), never another's trace
        assert len({ln["request_id"] for ln in mine} - {None} - early) == 1, (name, mine)
        assert all(trace not in ln["message"] for ln in lines if ln["trace_id"] != trace), name
    # a client that leaves mid-stream (decode holds the request by then): the router's line about it, and
    # the decode's about the abort the router sent, carry the trace
    gone = "%032x" % int.from_bytes(os.urandom(16), "big")
    conn = http.client.HTTPConnection("127.0.0.1", C.port, timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Once", "max_tokens": 400, "ignore_eos": True,
                                                              "stream": True}),
                 headers={"Content-Type": "application/json", "traceparent": "00-%s-00f067aa0ba902b7-01" % gone})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("traceparent").startswith("00-" + gone), resp.getheaders()
    seen = b""
    while seen.count(b"data: ") < 4:   # tokens from decode
        chunk = resp.read1(4096)
        assert chunk, seen
        seen += chunk
    conn.close()
    wait_for(lambda: any(ln["trace_id"] == gone and "went away" in ln["message"] for ln in json_log("router")), 20,
             "the router's line about the client that left, with the trace")
    wait_for(lambda: any(ln["trace_id"] == gone and " aborted" in ln["message"] for ln in json_log("decode-0")),
             20, "the decode's line about the abort, with the trace")


def test_memory_plan_is_what_the_workers_allocate():
    """Each worker's memory plan is one table of regions (common/worker/start.h) that both totals the
    plan and carves the pools: registration's prism:worker_memory_planned_bytes is the sum of the
    regions the worker logged, and the regions held on the heap (pools and libraries, on the CPU
    backend) add up to the heap the counting allocator saw in use once start-up ended."""
    C.check_memory_plan()


def test_tokenize_detokenize():
    status, r = C.post_json("/tokenize", {"model": "prism-tiny-llava", "prompt": "A red circle on a white background."})
    assert status == 200 and r["count"] == len(r["tokens"]) > 1 and r["max_model_len"] > 0, r
    status, d = C.post_json("/detokenize", {"model": "prism-tiny-llava", "tokens": r["tokens"]})
    assert status == 200 and d["prompt"].endswith("A red circle on a white background."), d
    status, m = C.post_json("/tokenize", {"messages": [{"role": "user", "content": "Hello"}],
                                          "add_generation_prompt": True})
    assert status == 200 and m["count"] > 2, m
    status, e = C.post_json("/detokenize", {"tokens": [-1]})
    assert status == 400 and e["error"]["message"], e


def test_chat_template_override_and_unsupported():
    good = os.path.join(TMP, "plain.jinja")
    with open(good, "w") as f:
        f.write("{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant>{% endif %}")
    with Cluster(router_args=["--chat-template", good]) as c2:
        c2.wait_ready()
        status, r = c2.post_json("/tokenize", {"messages": [{"role": "user", "content": "Hello"}]})
        assert status == 200, r
        status, d = c2.post_json("/detokenize", {"tokens": r["tokens"]})
        assert "user> Hello" in d["prompt"] and d["prompt"].endswith("assistant>"), d
    bad = os.path.join(TMP, "bad.jinja")
    with open(bad, "w") as f:
        f.write("{% include 'other.jinja' %}{{ messages }}")
    p = subprocess.run([binary("router"), "--model-path", MODEL, "--port", "0", "--control-endpoint",
                        "tcp://127.0.0.1:0", "--insecure-no-curve", "--chat-template", bad], capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "include" in p.stderr, (p.returncode, p.stderr[-500:])


# ---- prefix cache (prefill: kv/prefix.h) ----

def prefix_counters(c):
    return (c.metric("vllm:prefix_cache_queries_total") or 0, c.metric("vllm:prefix_cache_hits_total") or 0,
            c.metric("prism:prefill_tokens_computed_total") or 0)


def counted_after(c, before, queries):
    """The prefix-cache counters once the prefill's heartbeats have counted `queries` more tokens
    looked up: (queries, hits, computed) added since `before`."""
    wait_for(lambda: prefix_counters(c)[0] >= before[0] + queries, 20, "the prefill's heartbeat to count the prompt")
    now = prefix_counters(c)
    return tuple(now[i] - before[i] for i in range(3))


def greedy_trace(r):
    """(token texts, logprobs) of a chat answer asked with logprobs: the sampled tokens' and their
    top alternatives' (more sensitive to the image than the sampled token's alone)."""
    content = r["choices"][0]["logprobs"]["content"]
    return ([e["token"] for e in content],
            [e["logprob"] for e in content] + [t["logprob"] for e in content for t in e.get("top_logprobs", [])])


def assert_same_answer(got, ref, where):
    gt, gl = greedy_trace(got)
    rt, rl = greedy_trace(ref)
    assert gt == rt, "%s: tokens %r, uncached %r" % (where, gt, rt)
    diff = max((abs(a - b) for a, b in zip(gl, rl)), default=0.0)
    assert diff <= 1e-4, "%s: logprobs differ by %g from the uncached run" % (where, diff)


SYSTEM = " ".join("Rule %d: answer briefly and truthfully about what the picture shows." % i for i in range(12))


def test_prefix_cache_hits_and_salt():
    """A prompt sent again reads every full block but its last from the cache (vLLM's counters, in
    tokens, on the router's /metrics) and answers exactly as before; a cache_salt keys its own
    cache (no hit across salts, hits within one); a bad cache_salt is a 400."""
    def body(q, **kw):
        b = chat_body(q, [PNG], max_tokens=6, temperature=0, logprobs=True, **kw)
        b["messages"].insert(0, {"role": "system", "content": SYSTEM})
        return b
    fresh_heartbeats(C, "prefill-0")   # the earlier tests' prompts counted before the first snapshot
    before = prefix_counters(C)
    cold = ok_request(body("What is it?", cache_salt="cold-%f" % time.time()))   # a fresh salt: a miss
    n = cold["usage"]["prompt_tokens"]
    assert n > 200, n
    q, h, comp = counted_after(C, before, n)
    assert (q, h, comp) == (n, 0, n), (q, h, comp, n)
    before = prefix_counters(C)
    warm0 = ok_request(body("What is it?"))
    counted_after(C, before, n)
    before = prefix_counters(C)
    warm = ok_request(body("What is it?"))
    q, h, comp = counted_after(C, before, n)
    assert q == n and h == (n - 1) // 16 * 16 and comp == n - h, (q, h, comp, n)
    assert_same_answer(warm, cold, "cached")
    assert_same_answer(warm0, cold, "first unsalted")
    # another question after the same system prompt and image: the shared blocks hit
    before = prefix_counters(C)
    ok_request(body("What colour is it?"))
    q, h, comp = counted_after(C, before, n)
    assert h >= n - 64 and comp == q - h, (q, h, n)
    # salts: none shared across, shared within
    before = prefix_counters(C)
    ok_request(body("What is it?", cache_salt="alice"))
    q, h, _ = counted_after(C, before, n)
    assert h == 0, h
    before = prefix_counters(C)
    a2 = ok_request(body("What is it?", cache_salt="alice"))
    q, h, _ = counted_after(C, before, n)
    assert h == (n - 1) // 16 * 16, (h, n)
    assert_same_answer(a2, cold, "salted, cached")
    for bad in ("x" * 257, "", 7, "a\u0000b"):
        status, r = C.post_json("/v1/chat/completions", body("What is it?", cache_salt=bad))
        assert status == 400 and r["error"]["param"] == "cache_salt", (bad, status, r)
    assert C.metric("prism:worker_prefix_cache_hits_total", worker="prefill-0") > 0


def png_bytes(w, h, pixels, level=6):
    """A truecolour PNG of pixels (bytes, w*h*3 RGB): written here so two files may differ by one pixel."""
    import struct
    import zlib
    raw = b"".join(b"\x00" + pixels[y * w * 3:(y + 1) * w * 3] for y in range(h))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xffffffff)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) +
            chunk(b"IDAT", zlib.compress(raw, level)) + chunk(b"IEND", b""))


def test_prefix_cache_never_aliases():
    """Near-identical images (one pixel different; the same picture as JPEG and PNG; the same
    picture at two sizes; the same pixels in two PNG encodings) and prompts that differ only after
    the image, in a seeded random order, twice over, through a prefill whose KV pool holds one
    context (--kv-blocks 16 of 16 tokens): every answer (greedy tokens and logprobs) equals the one
    a --no-prefix-cache cluster gives, so no request ever read another's KV, and the cache, evicting
    all the time, never served a stale block."""
    import random
    rnd = random.Random(29)
    w = h = 112
    pix = bytearray(rnd.getrandbits(8) for _ in range(w * h * 3))
    imgs = []
    for name, data in (("noise.png", png_bytes(w, h, bytes(pix))), ("noise_l1.png", png_bytes(w, h, bytes(pix), 1))):
        imgs.append(os.path.join(TMP, name))
        open(imgs[-1], "wb").write(data)
    pix[(h // 2 * w + w // 2) * 3] ^= 0xff   # one pixel, one channel
    imgs.append(os.path.join(TMP, "noise_px.png"))
    open(imgs[-1], "wb").write(png_bytes(w, h, bytes(pix)))
    for name, sw, sh in (("scene.jpg", 320, 240), ("scene.png", 320, 240), ("scene_big.png", 640, 480)):
        imgs.append(make_image(os.path.join(TMP, name), width=sw, height=sh, shape="triangle", color="orange",
                               background="white"))
    texts = ["Describe the image in a few words please.", "Describe the image in a few words, thanks.",
             "What is in the image? Answer in one short sentence."]
    bodies = [chat_body(t, [im], max_tokens=5, temperature=0, logprobs=True, top_logprobs=5) for im in imgs for t in texts]
    long_text = " ".join("word%d" % i for i in range(60))   # most of the context: evicts nearly everything
    bodies.append(chat_body(long_text, max_tokens=3, temperature=0, logprobs=True, top_logprobs=5))

    def same_pixels(i, j):   # noise.png and noise_l1.png: one picture in two encodings, the same text
        return i % len(texts) == j % len(texts) and {i // len(texts), j // len(texts)} == {0, 1}
    args = ["--context-length", "256"]
    cached = Cluster(router_args=args, worker_args={"prefill_worker": args + ["--kv-blocks", "16"], "decode_worker": args})
    plain = Cluster(router_args=args, worker_args={"prefill_worker": args + ["--no-prefix-cache"], "decode_worker": args})
    try:
        cached.wait_ready()
        plain.wait_ready()
        refs = []
        for b in bodies:
            status, r = plain.post_json("/v1/chat/completions", b)
            assert status == 200, (status, r)
            refs.append(r)
        # the uncached answers of any two requests whose images differ in a pixel, or whose texts
        # differ, are far apart (> 1e-3; cached runs stay within 1e-4 of their own): an answer
        # computed over another request's KV could not pass
        for i in range(len(refs)):
            for j in range(i):
                if same_pixels(i, j):
                    continue
                a, b = greedy_trace(refs[i]), greedy_trace(refs[j])
                assert a[0] != b[0] or max(abs(x - y) for x, y in zip(a[1], b[1])) > 1e-3, (i, j, a, b)
        # far more distinct full blocks than the pool's 16: the cache evicts all the time
        assert sum(r["usage"]["prompt_tokens"] // 16 for r in refs) > 4 * 16
        order = list(range(len(bodies))) * 2
        rnd.shuffle(order)

        def one(i):
            status, r = cached.post_json("/v1/chat/completions", bodies[i])
            assert status == 200, (status, r)
            assert_same_answer(r, refs[i], "request %d" % i)
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            list(ex.map(one, order))
        q, hits, comp = counted_after(cached, (0, 0, 0), sum(r["usage"]["prompt_tokens"] for r in refs) * 2)
        assert hits > 0 and comp < q, (q, hits, comp)
        # the plain prefill's heartbeat (every second) may not have counted its prompts yet
        wait_for(lambda: (plain.metric("prism:prefill_tokens_computed_total") or 0) > 0, 20,
                 "the plain prefill's heartbeat")
        assert prefix_counters(plain)[1] == 0
    finally:
        cached.stop()
        plain.stop()


def chat_turns(c, turns, salt, routers=1):
    """A chat about PNG: each turn re-sends the image and the whole history (as chat clients do)
    and asks one more question, turn t through router t % routers (a balancer's round robin);
    returns each turn's answer (greedy, with top logprobs)."""
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(PNG)}},
                                         {"type": "text", "text": "What is in this picture? Answer in one short "
                                                                  "sentence, and be as precise as you can."}]}]
    out = []
    for t in range(turns):
        if t:
            msgs.append({"role": "user", "content": "And what about detail number %d of it?" % t})
        if t and routers > 1:
            # each router reads the prefills' events on its own link: the one taking this turn has
            # read those of the last turn (another router's client could race them: a missed hit)
            wait_for(lambda: len({c.metric("prism:worker_prefix_index_blocks", router=r) for r in range(routers)}) == 1,
                     10, "every router to index the same blocks")
        body = {"model": "prism-tiny-llava", "messages": msgs, "max_tokens": 5, "temperature": 0, "logprobs": True,
                "top_logprobs": 5, "cache_salt": salt}
        status, r = c.post_json("/v1/chat/completions", body, router=t % routers)
        assert status == 200, (t, status, r)
        out.append(r)
        msgs = msgs + [{"role": "assistant", "content": r["choices"][0]["message"]["content"]}]
    return out


def worker_metric(c, name, worker):
    return c.metric(name, worker=worker) or 0


def test_prefix_routing_and_encoder_skip():
    """Issue 29 items 3-4. Two routers (as behind a balancer: turns alternate between them) and two
    prefill workers, a 4-turn chat about one image (each turn re-sends the image and the history):
    turn 1 goes where the load says; turns 2+ go to the prefill whose prefix cache holds the
    conversation (each router's own index of the prefills' PrefixEvents, keys from the secret both
    derive from router.key: every hit is on that worker, none is looked up on the other), and the
    image is sent to no encoder again (the encoder's embedding cache sees it once;
    prism:encoder_skips_total, summed over the routers, counts turns 2+). Every answer
    (tokens and top logprobs) equals a --no-prefix-cache cluster's. The race: a prefill that lost
    the prefix before the skipped request came (test hook PRISM_TEST_PREFIX_EVICT_ON_ARRIVAL) refuses
    it, the router sends it again with the image encoded, and the answer is still the same."""
    turns = 4
    # no early encodes: a router that has not seen the image would send it to the encoder's cache
    # while the body uploads (an embedding-cache hit, no encode), which would blur what is checked
    two = Cluster(prefills=2, routers=2, router_args=["--no-early-encode"], common_worker_args=LOGS)
    plain = Cluster(worker_args={"prefill_worker": ["--no-prefix-cache"]})
    race = Cluster(worker_env={"prefill_worker": {"PRISM_TEST_PREFIX_EVICT_ON_ARRIVAL": "1"}})
    try:
        for c in (two, plain, race):
            c.wait_ready()
        salt = "chat-%f" % time.time()
        refs = chat_turns(plain, turns, salt)
        got = chat_turns(two, turns, salt, routers=2)
        for t in range(turns):
            assert_same_answer(got[t], refs[t], "turn %d" % (t + 1))
        n_total = sum(r["usage"]["prompt_tokens"] for r in got)
        wait_for(lambda: sum(worker_metric(two, "prism:worker_prefix_cache_queries_total", "prefill-%d" % i)
                             for i in range(2)) >= n_total, 20, "the prefills' heartbeats to count every turn")
        q = [worker_metric(two, "prism:worker_prefix_cache_queries_total", "prefill-%d" % i) for i in range(2)]
        h = [worker_metric(two, "prism:worker_prefix_cache_hits_total", "prefill-%d" % i) for i in range(2)]
        holder = 0 if q[0] >= q[1] else 1
        # every turn on one worker: turn 1 there by load, turns 2+ there by its cached prefix
        assert q[holder] == n_total and q[1 - holder] == 0, (q, n_total)
        assert h[holder] >= sum(r["usage"]["prompt_tokens"] for r in got[:-1]) // 2 and h[1 - holder] == 0, h
        for r in range(2):   # both routers indexed the holder's blocks from its events
            assert two.metric("prism:worker_prefix_index_blocks", router=r, worker="prefill-%d" % holder) > 0
        # the image was encoded once: later turns skipped the encoder entirely (the encoder's
        # counts come with its heartbeats: two more, and they hold everything the chat did)
        assert sum(two.metric("prism:encoder_skips_total", router=r) for r in range(2)) == turns - 1
        assert two.metric("prism:encoder_skips_total", router=1) >= 1   # the other router skipped too
        fresh_heartbeats(two, "encoder-0")
        assert two.metric("prism:worker_embedding_cache_misses_total", tier="encoder") == 1
        assert two.metric("prism:worker_embedding_cache_hits_total", tier="encoder") == 0
        assert plain.metric("prism:encoder_skips_total") == 0
        # a router that starts after the chat was cached (a restart) learns the holder's blocks from
        # the listing the prefill sends every router once a router registers: the chat's first turn,
        # sent again through it, goes to the holder and skips the encoder
        two.kill("router")
        two._start("router", "router", ["--model-path", two.model, "--port", str(two.ports[0]), "--control-endpoint",
                                        two.ctls[0], "--drain-timeout", "0", *two.sec, "--no-early-encode"])
        two.wait_ready()
        wait_for(lambda: (two.metric("prism:worker_prefix_index_blocks", worker="prefill-%d" % holder) or 0) > 0, 20,
                 "the restarted router to index the holder's blocks")
        again = chat_turns(two, 1, salt)
        assert_same_answer(again[0], refs[0], "turn 1 again, through the restarted router")
        assert two.metric("prism:encoder_skips_total") == 1
        # the race: turn 2 skipped, found nothing cached, was sent again encoded
        lost = chat_turns(race, 2, salt)
        for t in range(2):
            assert_same_answer(lost[t], refs[t], "race, turn %d" % (t + 1))
        assert race.metric("prism:encoder_skips_total") == 1
        assert race.metric("prism:prefix_resent_total") == 1
        assert "no longer in the prefix cache" in race.log("prefill-0", tail=0)
    finally:
        for c in (two, plain, race):
            c.stop()


def test_batched_prefill_abort_and_prefix_hit():
    """Batched prefill (prefill_worker run_step): prompts share forwards. The test hook
    PRISM_TEST_PREFILL_FORWARD_GAP_S pauses the prefill between forwards so that prompts meet in one.
    A (600 tokens: three forwards, time for B to come) is in the model when B (1200) comes: a forward
    carries A's last chunk and B's first; then C is sent and B's client leaves (C is sent only once B
    is in the model: sent beside B, it could take B's place beside A and B would leave before its
    first forward). A and C answer as they do alone, the prefill
    counts B left mid-prompt, and every KV block is free afterwards (the free-block gauge). Then a
    prompt whose prefix is cached rides in one forward beside a new prompt: it reads its cached
    blocks (the hit counters) and both answer as alone."""
    import http.client
    blocks = 160
    gap = 0.5
    c = Cluster(common_worker_args=["--heartbeat-interval", "0.1"],
                worker_args={"prefill_worker": ["--chunked-prefill-size", "256", "--kv-blocks", str(blocks)]},
                worker_env={"prefill_worker": {"PRISM_TEST_PREFILL_FORWARD_GAP_S": str(gap)}})

    def body(words, salt):
        return {"model": "prism-tiny-llava", "prompt": words, "max_tokens": 8, "temperature": 0,
                "ignore_eos": True, "cache_salt": salt}

    def text(words, salt):
        status, r = c.post_json("/v1/completions", body(words, salt))
        assert status == 200, (status, r)
        return r["choices"][0]["text"]

    def pf(name):
        return c.metric(name, worker="prefill-0") or 0

    try:
        c.wait_ready()
        salt = "batch-%f" % time.time()
        a_words, b_words, c_words = "one two " * 300, "three four " * 600, "five six " * 150
        refs = {k: text(w, "ref-%s-%s" % (k, salt)) for k, w in (("a", a_words), ("c", c_words))}
        fresh_heartbeats(c, "prefill-0")
        before = work_counters(c, "prefill-0")
        fwd0 = pf("prism:worker_prefill_forwards_total")
        got = {}
        ta = threading.Thread(target=lambda: got.update(a=text(a_words, salt)))
        ta.start()
        wait_for(lambda: pf("prism:worker_prefill_forwards_total") > fwd0, 20, "A's first forward")
        mixed0 = pf("prism:worker_prefill_forward_prompts_total") - pf("prism:worker_prefill_forwards_total")
        conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=60)
        conn.request("POST", "/v1/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps(dict(body(b_words, salt), stream=True)).encode())
        # a forward carried two prompts (A's last chunk and B's first): B is in the model, 1000 tokens to go
        wait_for(lambda: pf("prism:worker_prefill_forward_prompts_total") - pf("prism:worker_prefill_forwards_total")
                 > mixed0, 20, "a forward with A and B")
        tc = threading.Thread(target=lambda: got.update(c=text(c_words, salt)))
        tc.start()
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        ta.join(60)
        tc.join(60)
        assert got == refs, (got, refs)
        wait_for(lambda: work_counters(c, "prefill-0")["prompts_aborted"] == before["prompts_aborted"] + 1, 20,
                 "the prefill worker to leave B mid-prompt")
        wait_for(lambda: c.metric("prism:worker_running", worker="prefill-0") == 0, 20, "the prefill worker idle")
        fresh_heartbeats(c, "prefill-0")
        assert pf("prism:worker_kv_free_blocks") == blocks, (pf("prism:worker_kv_free_blocks"), blocks)
        assert "test hook PRISM_TEST_PREFILL_FORWARD_GAP_S" in c.log("prefill-0", tail=0)
        # a cached prefix beside a new prompt in one forward
        p_words, q_words = "seven eight " * 150, "nine ten " * 100
        p_ref = text(p_words, salt)
        q_ref = text(q_words, "ref-q-" + salt)
        fresh_heartbeats(c, "prefill-0")
        hits0 = pf("prism:worker_prefix_cache_hits_total")
        mixed0 = pf("prism:worker_prefill_forward_prompts_total") - pf("prism:worker_prefill_forwards_total")
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            fp, fq = ex.submit(text, p_words, salt), ex.submit(text, q_words, salt)
            assert (fp.result(), fq.result()) == (p_ref, q_ref)
        fresh_heartbeats(c, "prefill-0")
        assert pf("prism:worker_prefix_cache_hits_total") - hits0 >= 256, (hits0, pf("prism:worker_prefix_cache_hits_total"))
        assert pf("prism:worker_prefill_forward_prompts_total") - pf("prism:worker_prefill_forwards_total") > mixed0, \
            "the cached prompt and the new one did not share a forward"
        assert pf("prism:worker_kv_free_blocks") == blocks
        assert all(c.alive().values()), c.alive()
    finally:
        c.stop()


def test_batched_prefill_prefix_miss():
    """A PREFIX_MISS inside a batch refuses only its prompt. Both test hooks: the prefill empties its
    prefix cache when a prompt with an image marked cached arrives (PRISM_TEST_PREFIX_EVICT_ON_ARRIVAL)
    and pauses between forwards (PRISM_TEST_PREFILL_FORWARD_GAP_S). A long text prompt L is in the
    model when a chat's turn 2 (its image skipped by the encoder, so missed) and a short prompt S
    come: the forward of L's last chunk admits them, refuses turn 2 (the router sends it again with
    the image encoded) and carries S beside L. Every answer is what it is alone."""
    c = Cluster(common_worker_args=["--heartbeat-interval", "0.1"],
                worker_args={"prefill_worker": ["--chunked-prefill-size", "256"]},
                worker_env={"prefill_worker": {"PRISM_TEST_PREFIX_EVICT_ON_ARRIVAL": "1",
                                               "PRISM_TEST_PREFILL_FORWARD_GAP_S": "0.3"}})

    def text(words, salt):
        status, r = c.post_json("/v1/completions", {"model": "prism-tiny-llava", "prompt": words, "max_tokens": 8,
                                                     "temperature": 0, "ignore_eos": True, "cache_salt": salt})
        assert status == 200, (status, r)
        return r["choices"][0]["text"]

    def pf(name):
        return c.metric(name, worker="prefill-0") or 0

    def shared():
        return pf("prism:worker_prefill_forward_prompts_total") - pf("prism:worker_prefill_forwards_total")

    try:
        c.wait_ready()
        salt = "miss-%f" % time.time()
        l_words, s_words = "red green " * 500, "blue yellow " * 40
        refs = {"l": text(l_words, "ref-l-" + salt), "s": text(s_words, "ref-s-" + salt)}
        ref_turns = chat_turns(c, 2, "ref-chat-" + salt)   # turn 2 missed and was sent again, as below
        resent0 = c.metric("prism:prefix_resent_total") or 0
        assert resent0 == 1, resent0
        first = chat_turns(c, 1, salt)   # cached: the router skips its image next time
        assert_same_answer(first[0], ref_turns[0], "turn 1")
        fresh_heartbeats(c, "prefill-0")
        fwd0, shared0 = pf("prism:worker_prefill_forwards_total"), shared()
        got = {}
        tl = threading.Thread(target=lambda: got.update(l=text(l_words, salt)))
        tl.start()
        wait_for(lambda: pf("prism:worker_prefill_forwards_total") > fwd0, 20, "L's first forward")
        t2 = threading.Thread(target=lambda: got.update(turn2=chat_turns(c, 2, salt)[1]))   # turns 1 and 2
        t2.start()
        time.sleep(0.05)
        ts = threading.Thread(target=lambda: got.update(s=text(s_words, salt)))
        ts.start()
        for t in (tl, t2, ts):
            t.join(60)
        assert {k: got.get(k) for k in ("l", "s")} == refs, (got, refs)
        assert_same_answer(got["turn2"], ref_turns[1], "turn 2, missed in a batch")
        # both turns the thread sent (turn 1 again, then turn 2) were skipped, missed and sent again
        assert (c.metric("prism:prefix_resent_total") or 0) == resent0 + 2, (c.metric("prism:prefix_resent_total"), resent0)
        fresh_heartbeats(c, "prefill-0")
        assert shared() > shared0, "no forward carried two prompts"
        assert all(c.alive().values()), c.alive()
    finally:
        c.stop()


def test_all_processes_alive():
    assert all(C.alive().values()), C.alive()


if __name__ == "__main__":
    try:
        rc = run_tests([test_health_ready_models, test_version_and_help, test_stop_token_ids_and_max_completion_tokens,
                        test_embedding_cache_hit, test_chat_jpeg, test_chat_png_and_progressive_jpeg,
                        test_text_only_and_completions, test_max_tokens_length_finish, test_stream_equals_non_stream,
                        test_disaggregated_equals_single_process, test_seeded_sampling_reproducible, test_logprobs,
                        test_stop_string, test_concurrent_distinct_requests, test_malformed_requests,
                        test_bomb_refused_from_header, test_bomb_refused_on_its_first_bytes, test_metrics,
                        test_stage_histograms_add_up, test_upload_time_is_its_own_histogram,
                        test_trace_context_in_every_process,
                        test_memory_plan_is_what_the_workers_allocate, test_tokenize_detokenize,
                        test_chat_template_override_and_unsupported, test_prefix_cache_hits_and_salt,
                        test_prefix_cache_never_aliases, test_prefix_routing_and_encoder_skip,
                        test_batched_prefill_abort_and_prefix_hit, test_batched_prefill_prefix_miss,
                        test_all_processes_alive])
    finally:
        C.stop()
        if os.environ.get("PRISM_KEEP_LOGS"):
            print("logs in", C.log_dir)
    sys.exit(rc)
