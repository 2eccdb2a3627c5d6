"""Streaming paths end to end (router SSE, stop strings, failures, client disconnect):

- stop strings while streaming, including ones that span many tokens: the streamed text equals the
  non-streamed text cut before the first match, nothing of the stop string ever reaches the client
  (held back while it could still match), and text held back for a match that never comes is
  released at the end;
- a worker that dies mid-stream ends the stream with an SSE error event and [DONE], promptly;
- a client that disconnects mid-stream, or a stop string that hits, makes the router abort the
  request on the decode worker, which then stops generating (its running count in /metrics
  returns to idle);
- a decode worker restarted under the same id while streaming: the stream still ends (the router
  fails the old process's requests when the new one registers);
- the router's loop thread keeps answering while a multi-megabyte prompt is parsed, rendered and
  tokenized (/tokenize, /v1/chat/completions): that work runs on its thread pool, so streams and
  other clients are not stalled behind it.

Run: python3 tests/integration/test_streaming.py [test names]   (PRISM_BINARY_DIR=build dir)
"""
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import (Cluster, assert_abort_stopped_decode, chat_body, make_image, run_tests, wait_for,  # noqa: E402
                     fresh_heartbeats, work_counters)

TMP = tempfile.mkdtemp(prefix="prism-stream-")
JPG = make_image(os.path.join(TMP, "red_circle.jpg"), width=640, height=480, shape="circle", color="red")
FAST_HB = ["--heartbeat-interval", "0.1"]
C = None


def stream_text(body):
    """(text, finish_reason, events) of a streamed chat completion."""
    status, events, done = C.stream("/v1/chat/completions", dict(body, stream=True))
    assert status == 200 and done, (status, events[-2:])
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    fin = [e["choices"][0]["finish_reason"] for e in events if e.get("choices") and e["choices"][0]["finish_reason"]]
    assert len(fin) == 1, fin
    return text, fin[0], events


def reference():
    """The greedy answer with ignore_eos, and the byte offset where each token's text starts."""
    body = chat_body("What is in the image?", [JPG], max_tokens=40, temperature=0, ignore_eos=True, logprobs=True)
    status, r = C.post_json("/v1/chat/completions", body)
    assert status == 200, (status, r)
    text = r["choices"][0]["message"]["content"]
    starts, off = [], 0
    for e in r["choices"][0]["logprobs"]["content"]:
        starts.append(off)
        off += len(bytes(e["bytes"]))
    assert text.isascii(), "the byte offsets below assume ASCII output: %r" % text
    return text, starts


def test_stream_stop_string_spanning_many_tokens():
    full, starts = reference()
    # from inside the 2nd token to inside the 7th: the match completes only tokens later
    a, b = starts[1] + 1, starts[6] + 1
    stop = full[a:b]
    assert full.index(stop) == a and sum(1 for s in starts if a <= s < b) >= 4, (stop, starts)
    base = chat_body("What is in the image?", [JPG], max_tokens=40, temperature=0, ignore_eos=True)
    text, fin, events = stream_text(dict(base, stop=[stop]))
    assert text == full[:a], (text, full[:a], stop)
    assert fin == "stop"
    # the same answer non-streaming
    status, r = C.post_json("/v1/chat/completions", dict(base, stop=[stop]))
    assert status == 200 and r["choices"][0]["message"]["content"] == full[:a], r
    # no chunk ever carried text beyond the cut (held back while a match was possible)
    sent = ""
    for e in events:
        if e.get("choices"):
            sent += e["choices"][0]["delta"].get("content") or ""
            assert full[:a].startswith(sent), ("streamed text that the stop string later removed", sent)


def test_stream_stop_string_never_completed_is_released():
    full, starts = reference()
    a = starts[3]
    decoy = full[a:a + 12] + "\x01"  # matches up to its last byte, never completes
    base = chat_body("What is in the image?", [JPG], max_tokens=40, temperature=0, ignore_eos=True)
    text, fin, _ = stream_text(dict(base, stop=[decoy]))
    assert text == full and fin == "length", (text, full, fin)


def test_stream_earliest_of_several_stop_strings_wins():
    full, starts = reference()
    early, late = full[starts[2]:starts[4]], full[starts[1]:starts[8]]
    assert full.index(late) < full.index(early)
    base = chat_body("What is in the image?", [JPG], max_tokens=40, temperature=0, ignore_eos=True)
    # listed order does not matter: the match that ends first in the text wins
    text, fin, _ = stream_text(dict(base, stop=[late, early]))
    assert text == full[:full.index(early)] and fin == "stop", (text, early, late)


def test_stop_string_aborts_generation():
    """A stop string that hits early ends a 1800-token request at once, and the decode worker is told
    to stop (it would otherwise generate for seconds more)."""
    with Cluster(common_worker_args=FAST_HB, worker_args={"decode_worker": ["--log-level", "debug"]}) as c:
        c.wait_ready()
        body = chat_body("Hi", max_tokens=12, temperature=0, ignore_eos=True)
        status, r = c.post_json("/v1/chat/completions", body)
        text = r["choices"][0]["message"]["content"]
        stop = text[4:9]
        t0 = time.time()
        before = work_counters(c)
        s = c.open_stream("/v1/chat/completions", dict(body, max_tokens=1800, stop=[stop], stream=True))
        events = []
        while True:
            ev = s.next_event()
            if ev is None:
                break
            events.append(ev)
        text2 = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                        if isinstance(e, dict) and e.get("choices"))
        assert text2 == text[:text.index(stop)], (text2, text, stop)
        c.wait_log("decode-0", "aborted", timeout=5)
        assert_abort_stopped_decode(c, before, 1800)
        assert time.time() - t0 < 20


def long_body():
    return chat_body("Hi", max_tokens=1800, temperature=0, ignore_eos=True, stream=True)


def read_content_events(s, n):
    """Reads until n content chunks arrived; returns them."""
    got = []
    while len(got) < n:
        ev = s.next_event()
        assert ev not in (None, "[DONE]") and "error" not in ev, ev
        if ev["choices"] and ev["choices"][0]["delta"].get("content"):
            got.append(ev)
    return got


def test_sse_error_event_when_worker_dies():
    # without migration (test_faults.py covers it): the stream ends with an error event
    with Cluster(router_args=["--worker-timeout", "1", "--max-migrations", "0"], common_worker_args=FAST_HB) as c:
        c.wait_ready()
        s = c.open_stream("/v1/chat/completions", long_body())
        read_content_events(s, 5)
        c.kill("decode-0")
        t0 = time.time()
        rest = []
        while True:
            ev = s.next_event()
            if ev is None:
                break
            rest.append(ev)
        elapsed = time.time() - t0
        errors = [e for e in rest if isinstance(e, dict) and "error" in e]
        assert errors, ("stream ended without an SSE error event", rest[-3:])
        err = errors[0]["error"]
        assert "stopped responding" in err["message"] and err["type"], err
        assert rest[-1] == "[DONE]" and rest.index(errors[0]) == len(rest) - 2, rest[-3:]
        assert elapsed < 10, elapsed
        assert c.procs["router"].poll() is None


def test_client_disconnect_aborts_generation():
    with Cluster(common_worker_args=FAST_HB, worker_args={"decode_worker": ["--log-level", "debug"]}) as c:
        c.wait_ready()
        aborts0 = c.metric("vllm:request_success_total", finished_reason="abort")
        s = c.open_stream("/v1/chat/completions", long_body())
        read_content_events(s, 5)
        wait_for(lambda: c.metric("prism:worker_running", tier="decode") == 1, 10, "the decode worker running it")
        before = work_counters(c)
        s.close()
        # the router forgets the request at once, tells the decode worker, which stops: its running
        # count returns to 0 long before 1800 tokens could have been generated
        wait_for(lambda: c.metric("prism:router_requests_in_flight") == 0, 5, "the router to drop the request")
        c.wait_log("decode-0", "aborted", timeout=5)
        assert_abort_stopped_decode(c, before, 1800)
        assert c.metric("vllm:request_success_total", finished_reason="abort") == aborts0 + 1
        # and it serves the next request
        status, r = c.post_json("/v1/chat/completions", chat_body("Hi", max_tokens=4))
        assert status == 200, (status, r)


def test_client_disconnect_stops_prefill_mid_prompt():
    """A client that leaves while its long prompt is in prefill (1800 one-token chunks) stops it
    mid-prompt: the prefill worker counts the prompt left (prism:worker_prompts_aborted_total); a
    prefill that logs the abort and runs the rest of the prompt fails here."""
    import http.client
    # 5 ms between forwards (test hook): the whole prompt would take 9 s, the abort comes in well under 1
    with Cluster(common_worker_args=FAST_HB, worker_args={"prefill_worker": ["--chunked-prefill-size", "1"]},
                 worker_env={"prefill_worker": {"PRISM_TEST_PREFILL_FORWARD_GAP_S": "0.005"}}) as c:
        c.wait_ready()
        before = work_counters(c, "prefill-0")
        conn = http.client.HTTPConnection("127.0.0.1", c.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", headers={"Content-Type": "application/json"},
                     body=json.dumps(chat_body("tell me " * 900, max_tokens=4)).encode())
        wait_for(lambda: work_counters(c, "prefill-0")["progress"] > before["progress"] + 8, 60,
                 "the prefill worker to start on the long prompt")
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        wait_for(lambda: work_counters(c, "prefill-0")["prompts_aborted"] == before["prompts_aborted"] + 1, 60,
                 "the prefill worker to leave the prompt (prism:worker_prompts_aborted_total)")
        assert "prefill stopped" in c.log("prefill-0", tail=0), c.log("prefill-0")
        wait_for(lambda: c.metric("prism:worker_running", worker="prefill-0") == 0, 10, "the prefill worker idle")
        # stopped, not only counted: the prompt's 1800 one-token forwards did not all run (a fresh heartbeat)
        fresh_heartbeats(c, "prefill-0")
        ran = work_counters(c, "prefill-0")["progress"] - before["progress"]
        print("forwards run for the 1800-token prompt before it stopped:", ran)
        assert ran < 1800, ("the prompt ran to its end", ran)
        status, r = c.post_json("/v1/chat/completions", chat_body("Hi", max_tokens=4))
        assert status == 200, (status, r)


def test_worker_restart_same_id_ends_streams():
    with Cluster(router_args=["--worker-timeout", "2"], common_worker_args=FAST_HB) as c:
        c.wait_ready()
        s = c.open_stream("/v1/chat/completions", long_body())
        read_content_events(s, 3)
        c.kill("decode-0")
        c.start_worker("decode-0", "decode_worker")
        c.wait_log("decode-0", "ready in")
        t0 = time.time()
        s.conn.sock.settimeout(10)
        rest = []
        try:
            while True:
                ev = s.next_event()
                if ev is None:
                    break
                rest.append(ev)
        except OSError as e:
            raise AssertionError("the stream hung for %.1fs after its worker restarted under the same id (%s)"
                                 % (time.time() - t0, e))
        # the stream was migrated: it waited for the restarted decode worker and ends complete
        assert rest and rest[-1] == "[DONE]", rest[-3:]
        assert not any(isinstance(e, dict) and "error" in e for e in rest), rest[-3:]
        finish = [ch["finish_reason"] for e in rest if isinstance(e, dict) for ch in e.get("choices", [])
                  if ch.get("finish_reason")]
        assert finish == ["length"], finish
        assert c.metric("prism:requests_migrated_total") == 1
        status, r = c.post_json("/v1/chat/completions", chat_body("Hi", max_tokens=4))
        assert status == 200, (status, r)


def _huge_prompt(n_bytes, seed=7):
    rng = random.Random(seed)
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliett",
             "kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"]
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(words) + str(rng.randrange(1000)) + rng.choice([" ", ", ", ". ", "\n"])
        out.append(w)
        size += len(w)
    return "".join(out)


def _post_raw(path, body):
    """Sends the whole request; returns (socket, time the last byte was handed to the kernel)."""
    s = socket.create_connection(("127.0.0.1", C.port), timeout=300)
    s.sendall(("POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
               "Connection: close\r\n\r\n" % (path, len(body))).encode() + body)
    return s, time.monotonic()


def _read_all(s):
    data = b""
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            return data
        data += chunk


def test_loop_answers_while_a_huge_prompt_is_tokenized():
    """Finding 14 of the security audit: tokenizing a multi-megabyte prompt took the router's only thread
    for about a second, so every stream and every client stalled behind it. Each request here takes
    the tokenizer hundreds of milliseconds; /health, asked all the while, must keep answering in a
    small fraction of that."""
    text = _huge_prompt(6 << 20)   # the tokenizer takes at most 8 MiB
    bodies = [("/tokenize", {"prompt": text}, 200),
              ("/v1/chat/completions", chat_body(text, max_tokens=1), 400)]   # tokenized, then too long
    for path, obj, want in bodies:
        body = json.dumps(obj).encode()
        s, t_sent = _post_raw(path, body)
        answer = {}
        reader = threading.Thread(target=lambda: answer.update(data=_read_all(s), t=time.monotonic()))
        reader.start()
        worst = 0.0
        n = 0
        while reader.is_alive():
            t0 = time.monotonic()
            status, _, _ = C.request("GET", "/health", timeout=60)
            assert status == 200
            worst = max(worst, time.monotonic() - t0)   # asked while the prompt was still on
            n += 1
        reader.join()
        s.close()
        took = answer["t"] - t_sent
        head = answer["data"].split(b"\r\n", 1)[0]
        assert head.startswith(b"HTTP/1.1 %d" % want), (path, answer["data"][:300])
        if want == 400:
            assert b"maximum context length" in answer["data"], answer["data"][-300:]
        print("  %s: answered in %.2f s; /health asked %d times meanwhile, slowest %.3f s" % (path, took, n, worst))
        assert took > 0.3, "the prompt was too quick to tell (%.2f s): make it larger" % took
        assert worst < took / 4, "the loop stalled %.2f s of the %.2f s the prompt took" % (worst, took)


if __name__ == "__main__":
    # the huge-prompt test parses 6 MiB of text: a parse bound above it (the default budget's is about
    # 2.6 MiB: docs/API.md), and a budget that holds it on every preparation thread
    C = Cluster(router_args=["--mem-budget", "1G", "--max-parse-bytes", "8M"])
    try:
        C.wait_ready()
        rc = run_tests([test_stream_stop_string_spanning_many_tokens, test_stream_stop_string_never_completed_is_released,
                        test_stream_earliest_of_several_stop_strings_wins, test_stop_string_aborts_generation,
                        test_sse_error_event_when_worker_dies,
                        test_client_disconnect_aborts_generation, test_client_disconnect_stops_prefill_mid_prompt,
                        test_worker_restart_same_id_ends_streams,
                        test_loop_answers_while_a_huge_prompt_is_tokenized])
    finally:
        C.stop()
        if os.environ.get("PRISM_KEEP_LOGS"):
            print("logs in", C.log_dir)
    sys.exit(rc)
