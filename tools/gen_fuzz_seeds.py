#!/usr/bin/env python3
"""Writes the small seed corpora of the libFuzzer harnesses (tests/fuzz/corpus/<harness>/).

Run from the repository root: python3 tools/gen_fuzz_seeds.py   (needs PIL for the image seeds)
The seeds are committed; CI replays them (tests/run-all.sh). Long fuzzing runs grow their own corpora
outside the tree.
"""
import base64
import io
import json
import os
import struct
import zlib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")
MODEL = os.path.join(ROOT, "models", "prism-tiny-llava")


def protocol_version():
    """PRISM_PROTOCOL_VERSION of common/net/net.h: an envelope of another version is dropped unread."""
    import re
    with open(os.path.join(ROOT, "common", "net", "net.h")) as f:
        return int(re.search(r"#define PRISM_PROTOCOL_VERSION (\d+)", f.read()).group(1))


PROTOCOL_VERSION = protocol_version()


SAMPLING_EXTRAS = {"prompt": "A red", "n": 3, "best_of": 3, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                   "repetition_penalty": 1.2, "logit_bias": {"5": -100, "17": 3.5}, "top_p": 0,
                   "guided_choice": ["yes", "no"], "user": "u", "echo": False}
JSON_SCHEMA_REQ = {"messages": [{"role": "user", "content": "x"}], "response_format": {
    "type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]+$"},
                                         "b": {"type": "array", "items": {"$ref": "#/$defs/n"}, "maxItems": 3}},
        "required": ["a"], "additionalProperties": False, "$defs": {"n": {"enum": [1, 2, None]}}}}}}
TOOLS_REQ = {"messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
    "stream": True}


def put(harness, name, data):
    d = os.path.join(OUT, harness)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def images():
    from PIL import Image
    out = {}
    im = Image.new("RGB", (24, 16), "white")
    for x in range(6, 18):
        for y in range(4, 12):
            im.putpixel((x, y), (220, 30, 30))
    b = io.BytesIO(); im.save(b, "JPEG", quality=80); out["rgb.jpg"] = b.getvalue()
    b = io.BytesIO(); im.save(b, "JPEG", quality=80, progressive=True); out["progressive.jpg"] = b.getvalue()
    b = io.BytesIO(); im.convert("L").save(b, "JPEG"); out["gray.jpg"] = b.getvalue()
    b = io.BytesIO(); im.convert("CMYK").save(b, "JPEG"); out["cmyk.jpg"] = b.getvalue()
    b = io.BytesIO(); im.save(b, "PNG"); out["rgb.png"] = b.getvalue()
    b = io.BytesIO(); im.convert("P").save(b, "PNG"); out["palette.png"] = b.getvalue()
    rgba = im.convert("RGBA"); rgba.putpixel((0, 0), (0, 0, 0, 0))
    b = io.BytesIO(); rgba.save(b, "PNG"); out["rgba.png"] = b.getvalue()
    b = io.BytesIO(); im.convert("I;16").save(b, "PNG"); out["gray16.png"] = b.getvalue()
    b = io.BytesIO(); im.convert("LA").save(b, "PNG"); out["gray_alpha.png"] = b.getvalue()
    return out


def pb_varint(v):
    out = b""
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out += bytes([b | 0x80])
        else:
            return out + bytes([b])


def pb_key(field, wire):
    return pb_varint(field << 3 | wire)


def pb_int(field, v):
    return pb_key(field, 0) + pb_varint(v & ((1 << 64) - 1))


def pb_bytes(field, b):
    if isinstance(b, str):
        b = b.encode()
    return pb_key(field, 2) + pb_varint(len(b)) + b


def pb_packed(field, vals):
    return pb_bytes(field, b"".join(pb_varint(v & ((1 << 64) - 1)) for v in vals))


def pb_float(field, v):
    return pb_key(field, 5) + struct.pack("<f", v)


def envelope(type_, body_field, body, rid=7, rid_hi=0x5EC12E7):
    return (pb_int(1, PROTOCOL_VERSION) + pb_int(2, type_) + pb_int(3, rid) + pb_bytes(4, "router-a-1-8000") +
            pb_key(5, 1) + struct.pack("<Q", rid_hi) + pb_bytes(body_field, body))


# ---- the worker message harnesses (tests/fuzz/fuzz_worker.h): records of (op, envelope, frames) ----
ROUTER_ID = "r1"                        # the router the harness's worker registered with
PEER_EP = "inproc://prism-fuzz-peer"    # bound by the harness: transfers are read back
STUCK_EP = "inproc://prism-fuzz-nobody"  # a peer that never takes anything
OP_ROUTER, OP_DATA, OP_TURN, OP_LATE = 0, 1, 2, 3
IMAGE_TOKEN, IMAGE_ROWS, HIDDEN = 3, 64, 256   # models/prism-tiny-llava


def env_of(type_, body_field, body, rid, router=ROUTER_ID, rid_hi=0):
    e = pb_int(1, PROTOCOL_VERSION) + pb_int(2, type_) + pb_int(3, rid)
    if router is not None:
        e += pb_bytes(4, router)
    if rid_hi:
        e += pb_key(5, 1) + struct.pack("<Q", rid_hi)
    return e + (pb_bytes(body_field, body) if body_field else b"")


def rec(op, env=b"", frames=()):
    """A message record (ops 0, 1, 3); frames: bytes (literal) or (n, pattern4) (n bytes of the pattern)."""
    out = bytes([op]) + struct.pack("<H", len(env)) + env + bytes([len(frames)])
    for f in frames:
        if isinstance(f, tuple):
            n, pat = f
            out += b"\x01" + struct.pack("<I", n)[:3] + pat
        else:
            out += b"\x00" + struct.pack("<H", len(f)) + f
    return out


def turn(n=1):
    return bytes([OP_TURN]) * n


def sampling(max_tokens=4, temperature=0.0, n=0, logprobs=0, stop=(), seed=None, generated=0, rep=0.0, guide=None,
             top_k=0, top_p=0.0, bias=(), ignore_eos=False, priority=0):
    b = pb_float(1, temperature) + pb_int(6, max_tokens)
    if ignore_eos:
        b += pb_int(8, 1)
    if top_p:
        b += pb_float(2, top_p)
    if top_k:
        b += pb_int(3, top_k)
    if seed is not None:
        b += pb_int(4, 1) + pb_int(5, seed)
    if stop:
        b += pb_packed(7, stop)
    if logprobs:
        b += pb_int(9, logprobs)
    if rep:
        b += pb_float(12, rep)
    if bias:
        b += pb_packed(13, [i for i, _ in bias]) + pb_bytes(14, b"".join(struct.pack("<f", v) for _, v in bias))
    if n:
        b += pb_int(15, n)
    if guide:
        b += pb_bytes(16, pb_int(1, guide[0]) + pb_bytes(2, guide[1]))
    if generated:
        b += pb_int(17, generated)
    if priority:
        b += pb_int(30, (priority << 1) ^ (priority >> 63))   # sint32: zigzag
    return b


def prefill_msg(rid, tokens, spans=(), samp=None, endpoint=PEER_EP, router=ROUTER_ID):
    body = pb_packed(1, tokens)
    for off, n in spans:
        body += pb_bytes(2, pb_int(1, off) + pb_int(2, n))
    body += pb_bytes(3, samp if samp is not None else sampling())
    if endpoint is not None:
        body += pb_bytes(4, endpoint)
    return env_of(5, 15, body, rid, router)


def embeddings_msg(rid, index=0, n_tokens=IMAGE_ROWS, hidden=HIDDEN, error=None, router=ROUTER_ID, rid_hi=0):
    body = pb_int(1, index) + pb_int(2, n_tokens) + pb_int(3, hidden)
    if error:
        body += pb_bytes(4, error)
    return env_of(6, 16, body, rid, router, rid_hi)


def abort_msg(rid, router=ROUTER_ID):
    return env_of(10, 19, pb_bytes(1, "client gone"), rid, router)


def image_prompt(n_images=1, text=(10, 11, 12)):
    toks, spans = [0], []
    for _ in range(n_images):
        spans.append((len(toks), IMAGE_ROWS))
        toks += [IMAGE_TOKEN] * IMAGE_ROWS
    return toks + list(text), spans


ROWS = (IMAGE_ROWS * HIDDEN * 4, struct.pack("<f", 0.02))   # one image's embeddings, as a pattern frame
HALF_ROWS = (IMAGE_ROWS * HIDDEN * 2, struct.pack("<f", -0.01))


def prefill_seeds():
    h = "fuzz_prefill_msgs"
    text = [0, 17, 230, 41, 99, 5]
    img, spans = image_prompt()
    put(h, "text", rec(OP_ROUTER, prefill_msg(1, text)) + turn())
    put(h, "image", rec(OP_ROUTER, prefill_msg(2, img, spans)) + rec(OP_DATA, embeddings_msg(2), [ROWS]) + turn(2))
    put(h, "embeddings_first", rec(OP_DATA, embeddings_msg(3), [HALF_ROWS, HALF_ROWS]) +
        rec(OP_ROUTER, prefill_msg(3, img, spans, sampling(max_tokens=8, temperature=0.8, seed=5))) + turn())
    put(h, "abort_mid_prompt", rec(OP_ROUTER, prefill_msg(4, img, spans)) + rec(OP_DATA, embeddings_msg(4), [ROWS]) +
        rec(OP_LATE, abort_msg(4)) + turn(2) + rec(OP_DATA, embeddings_msg(4), [ROWS]) + turn())
    put(h, "abort_before", rec(OP_ROUTER, abort_msg(5)) + rec(OP_DATA, embeddings_msg(5), [ROWS]) +
        rec(OP_ROUTER, prefill_msg(5, img, spans)) + turn(2))
    put(h, "duplicates", rec(OP_ROUTER, prefill_msg(6, img, spans)) + rec(OP_ROUTER, prefill_msg(6, img, spans)) +
        rec(OP_DATA, embeddings_msg(6), [ROWS]) + rec(OP_DATA, embeddings_msg(6), [ROWS]) + turn() +
        rec(OP_ROUTER, abort_msg(6)) + rec(OP_ROUTER, abort_msg(6)) + turn())
    put(h, "orphans", rec(OP_DATA, embeddings_msg(90), [ROWS]) + rec(OP_DATA, embeddings_msg(91), [ROWS]) +
        rec(OP_DATA, embeddings_msg(92, router="intruder"), [ROWS]) + rec(OP_ROUTER, prefill_msg(92, img, spans)) +
        turn(2))
    two, spans2 = image_prompt(2)
    put(h, "two_images_pool_full", rec(OP_ROUTER, prefill_msg(7, two, spans2)) +
        rec(OP_DATA, embeddings_msg(7, 1), [ROWS]) + rec(OP_DATA, embeddings_msg(8), [ROWS]) +
        rec(OP_DATA, embeddings_msg(7, 0), [ROWS]) + turn(3))
    put(h, "huge_counts", rec(OP_ROUTER, prefill_msg(9, img, [(1, 1 << 31)], sampling(max_tokens=(1 << 32) - 1, n=1000,
                                                                                         logprobs=1000))) +
        rec(OP_DATA, embeddings_msg(9, 7, n_tokens=1 << 30, hidden=1 << 20), [ROWS]) +
        rec(OP_DATA, embeddings_msg(9, 1 << 31), [ROWS]) + rec(OP_ROUTER, prefill_msg(10, list(range(200)))) + turn())
    put(h, "full", b"".join(rec(OP_ROUTER, prefill_msg(20 + i, img, spans)) for i in range(5)) + turn(2))
    # the link to a decode worker that takes nothing buffers one transfer; the second waits until its abort
    put(h, "decode_stuck", rec(OP_ROUTER, prefill_msg(30, text, endpoint=STUCK_EP)) + turn() +
        rec(OP_ROUTER, prefill_msg(29, text, endpoint=STUCK_EP)) + rec(OP_ROUTER, prefill_msg(31, text)) + turn(3) +
        rec(OP_ROUTER, abort_msg(29)) + turn(2))
    put(h, "decode_unreachable", rec(OP_ROUTER, prefill_msg(32, text, endpoint="nowhere")) +
        rec(OP_ROUTER, prefill_msg(33, text, endpoint="tcp://10.0.0.1:1")) + turn(2))
    put(h, "choices", rec(OP_ROUTER, prefill_msg(34, text, samp=sampling(max_tokens=6, temperature=1.0, n=3,
                                                                           logprobs=3, top_k=5, top_p=0.9))) + turn())
    put(h, "migrated_penalty", rec(OP_ROUTER, prefill_msg(35, text + [44, 45], samp=sampling(
        max_tokens=8, generated=2, rep=1.3, stop=[1, 2], bias=[(5, 3.0), (7, -100.0)]))) + turn())
    put(h, "guided", rec(OP_ROUTER, prefill_msg(36, text, samp=sampling(guide=(3, "[a-z]{1,4}")))) +
        rec(OP_ROUTER, prefill_msg(37, text, samp=sampling(guide=(2, "")))) + turn(2))
    put(h, "encoder_error", rec(OP_ROUTER, prefill_msg(38, img, spans)) +
        rec(OP_DATA, embeddings_msg(38, error="cannot decode the image")) + turn())
    put(h, "wrong_sources", rec(OP_DATA, prefill_msg(39, text)) + rec(OP_ROUTER, embeddings_msg(39), [ROWS]) +
        rec(OP_DATA, abort_msg(39)) + rec(OP_ROUTER, prefill_msg(40, text, router="r2")) + turn())
    long_prompt = [0] + [IMAGE_TOKEN] * IMAGE_ROWS + list(range(100, 150))
    put(h, "chunks_late_abort", rec(OP_ROUTER, prefill_msg(41, long_prompt, [(1, IMAGE_ROWS)])) +
        rec(OP_DATA, embeddings_msg(41), [ROWS]) + rec(OP_LATE, abort_msg(41)) + turn() +
        rec(OP_ROUTER, prefill_msg(42, long_prompt, [(1, IMAGE_ROWS)])) + rec(OP_DATA, embeddings_msg(42), [ROWS]) +
        turn())
    # 128-bit ids: embeddings with the right low half and another high half belong to no request
    put(h, "wrong_high_half", rec(OP_ROUTER, prefill_msg(44, img, spans)) +
        rec(OP_DATA, embeddings_msg(44, rid_hi=0x5EC12E7), [ROWS]) + turn() +
        rec(OP_DATA, embeddings_msg(44), [ROWS]) + turn())
    # the router's block keys (Prefill.block_keys, 16 bytes a full block: one here) and an image it sent
    # to no encoder (ImageSpan.cached): a cache that does not cover it refuses the prompt (ERROR_PREFIX_MISS)
    long_img = img + list(range(60, 80))
    keyed = lambda rid, keys, cached: env_of(5, 15, pb_packed(1, long_img) + pb_bytes(2, pb_int(1, spans[0][0]) + pb_int(
        2, spans[0][1]) + pb_int(5, 0xC0FFEE) + (pb_int(6, 1) if cached else b"")) + pb_bytes(3, sampling()) +
        pb_bytes(4, PEER_EP) + pb_bytes(7, keys), rid, ROUTER_ID)
    n_blocks = len(long_img) // 16
    put(h, "block_keys_and_cached_image", rec(OP_ROUTER, keyed(45, bytes(range(16)) * n_blocks, False)) +
        rec(OP_DATA, embeddings_msg(45), [ROWS]) + turn(2) +
        rec(OP_ROUTER, keyed(46, bytes(range(16)) * n_blocks, True)) + turn(2) +
        rec(OP_ROUTER, keyed(47, b"\x01" * 17, False)) + rec(OP_ROUTER, keyed(48, b"\x02" * (16 * n_blocks + 16), True)) +
        turn())
    # two orphans fill the pool (2 images); a third image pushes the oldest out: its Prefill, coming
    # after, is answered at once (503) and its embeddings coming later are dropped
    put(h, "orphan_pushed_out_then_prefill", rec(OP_DATA, embeddings_msg(60), [ROWS]) +
        rec(OP_DATA, embeddings_msg(61), [ROWS]) + turn() + rec(OP_DATA, embeddings_msg(62), [ROWS]) + turn() +
        rec(OP_ROUTER, prefill_msg(60, img, spans)) + turn() + rec(OP_DATA, embeddings_msg(60), [ROWS]) +
        rec(OP_ROUTER, prefill_msg(62, img, spans)) + turn(2))
    put(h, "nan_rows", rec(OP_ROUTER, prefill_msg(43, img, spans, sampling(logprobs=4))) +
        rec(OP_DATA, embeddings_msg(43), [(IMAGE_ROWS * HIDDEN * 4, b"\x00\x00\xc0\x7f")]) + turn())


KV_BLOCK_BYTES, KV_BLOCK = 65536, 16   # models/prism-tiny-llava's K/V of one 16-token block (float32)


def kv_msg(rid, n_tokens, samp=None, choices=((0, 17, 1),), prompt=None, router=ROUTER_ID, block_bytes=None,
           n_blocks=None, piece_blocks=0, migrated=False, wire=0):
    """A Kv transfer as prefill sends it, and its frame (piece_blocks: the first piece of that many
    blocks, 0 the whole transfer). choices: (index, first token, rng state). wire: Kv.wire_dtype
    (1: bf16, whose blocks are half the bytes unless block_bytes says otherwise)."""
    nb = n_blocks if n_blocks is not None else (n_tokens + KV_BLOCK - 1) // KV_BLOCK
    if block_bytes is None:
        block_bytes = KV_BLOCK_BYTES // 2 if wire == 1 else KV_BLOCK_BYTES
    body = (pb_int(1, n_tokens) + pb_int(2, KV_BLOCK) + pb_int(3, nb) + pb_int(4, block_bytes) + pb_int(12, nb) +
            pb_int(13, 0) + pb_bytes(5, samp if samp is not None else sampling()) +
            pb_packed(8, [c[0] for c in choices]) + pb_packed(9, [c[1] for c in choices]) +
            pb_packed(10, [c[2] for c in choices]))
    if prompt:
        body += pb_packed(11, prompt)
    if piece_blocks:
        body += pb_int(16, piece_blocks)
    if migrated:   # from a decode worker (preemption by migration): admitted at once or bounced
        body += pb_int(17, 1)
    if wire:
        body += pb_int(18, wire)
    return env_of(9, 18, body, rid, router), [((piece_blocks or nb) * block_bytes, struct.pack("<f", 0.05))]


def kv_piece_msg(rid, first, n, router=ROUTER_ID):
    """A piece after the first of a Kv transfer: its place only."""
    return env_of(9, 18, pb_int(15, first) + pb_int(16, n), rid, router)


def decode_seeds():
    h = "fuzz_decode_msgs"
    MODE_OVERLAP, MODE_GIVE_UP = 0x40, 0x80

    def kv(rid, n_tokens, op=OP_DATA, **kw):
        env, frames = kv_msg(rid, n_tokens, **kw)
        return rec(op, env, frames)

    put(h, "one", kv(1, 6) + turn(6))
    # the first op byte's bits 6 and 7 pick the mode (fuzz_decode_msgs.c)
    put(h, "overlap", bytes([OP_DATA | MODE_OVERLAP]) + kv(2, 6)[1:] + kv(3, 20, samp=sampling(max_tokens=5)) +
        turn(8))
    put(h, "choices", kv(4, 20, samp=sampling(max_tokens=6, temperature=1.0, n=3, logprobs=4, top_k=8),
                         choices=((0, 17, 1), (1, 18, 2), (2, 19, 3))) + turn(3))
    put(h, "give_up_mid_step", bytes([OP_DATA | MODE_GIVE_UP]) + kv(5, 6, samp=sampling(max_tokens=25))[1:] + turn(2))
    put(h, "abort_late", kv(6, 6, samp=sampling(max_tokens=20)) + turn() + rec(OP_LATE, abort_msg(6)) + turn(3))
    put(h, "abort_before_kv", rec(OP_ROUTER, abort_msg(7)) + kv(7, 6) + rec(OP_ROUTER, abort_msg(8)) + turn(2))
    put(h, "wait_for_blocks", b"".join(kv(10 + i, 6, samp=sampling(max_tokens=24)) for i in range(4)) + turn(4) +
        rec(OP_ROUTER, abort_msg(10)) + turn(2))
    put(h, "staged_abort", b"".join(kv(20 + i, 6, samp=sampling(max_tokens=25)) for i in range(4)) + turn() +
        rec(OP_ROUTER, abort_msg(23)) + rec(OP_ROUTER, abort_msg(23)) + turn(2))
    put(h, "too_big", kv(30, 6, samp=sampling(max_tokens=26, n=3), choices=((0, 1, 1), (1, 2, 2), (2, 3, 3))) +
        kv(31, 6, samp=sampling(n=4), choices=((0, 1, 1), (1, 2, 2), (2, 3, 3), (3, 4, 4))) + turn(2))
    env, frames = kv_msg(32, 6)
    put(h, "malformed", kv(33, 6, block_bytes=4096) + kv(34, 6, n_blocks=2) + rec(OP_DATA, env, frames * 2) +
        rec(OP_DATA, env, [(1000, b"\0\0\0\0")]) + rec(OP_ROUTER, env, frames) + rec(OP_DATA, abort_msg(32)) +
        kv(35, 6, choices=((0, 17, 1), (0, 18, 2)), samp=sampling(n=2)) + kv(36, 6, choices=((0, 5000, 1),)) +
        kv(37, 6, samp=sampling(max_tokens=0)) + kv(38, 0) + kv(39, 32) + turn(2))
    put(h, "migrated", kv(40, 8, samp=sampling(max_tokens=6, generated=2, rep=1.2), prompt=[0, 5, 6, 7, 8, 9, 44, 45]) +
        kv(41, 8, samp=sampling(max_tokens=6, generated=2, rep=1.2)) + kv(42, 8, samp=sampling(generated=8)) + turn(4))
    put(h, "guided_stops", kv(43, 6, samp=sampling(max_tokens=8, guide=(3, "[a-c]{2,3}"))) +
        kv(44, 6, samp=sampling(max_tokens=8, stop=[17, 18, 1], bias=[(17, 100.0)], logprobs=21)) + turn(6))
    put(h, "duplicate", kv(45, 6) + kv(45, 6) + turn() + kv(45, 6) + turn(4))
    put(h, "nan_kv", rec(OP_DATA, kv_msg(46, 6, samp=sampling(logprobs=3, temperature=0.7, top_p=0.5))[0],
                         [(KV_BLOCK_BYTES, b"\x00\x00\xc0\x7f")]) + turn(3))
    # optimistic admission (the default): three sequences admitted on one block each outgrow the 5
    # blocks past 16 tokens; the lowest priority (then the youngest) is preempted, the others go on
    long = dict(max_tokens=25, ignore_eos=True)
    put(h, "preempt", kv(50, 6, samp=sampling(**long)) + kv(51, 6, samp=sampling(priority=1, **long)) +
        kv(52, 6, samp=sampling(**long)) + turn(30))
    put(h, "preempt_overlap", bytes([OP_DATA | MODE_OVERLAP]) + kv(53, 6, samp=sampling(**long))[1:] +
        kv(54, 6, samp=sampling(seed=5, temperature=0.8, **long)) + kv(55, 6, samp=sampling(**long)) + turn(16) +
        rec(OP_ROUTER, abort_msg(53)) + turn(20))
    # preemption by migration: the victim is parked (no step, blocks held) and the others stall until
    # the router's Migrate sends its KV to the harness's peer; duplicates, one for no parked sequence,
    # "" (nowhere: dropped), a peer that takes nothing (given up after the input), none at all (the
    # preempt seeds: given up), and penalties (recompute, no parking)
    def migrate(rid, ep):
        return rec(OP_ROUTER, env_of(12, 21, pb_bytes(1, ep), rid))
    put(h, "migrate", kv(56, 6, samp=sampling(**long)) + kv(57, 6, samp=sampling(priority=1, **long)) +
        kv(58, 6, samp=sampling(seed=3, temperature=0.9, **long)) + migrate(57, PEER_EP) + turn(12) +
        migrate(57, PEER_EP) + turn(2) + migrate(57, PEER_EP) + migrate(57, PEER_EP) + migrate(99, PEER_EP) + turn(20))
    put(h, "migrate_nowhere", bytes([OP_DATA | MODE_OVERLAP]) + kv(59, 6, samp=sampling(**long))[1:] +
        kv(60, 6, samp=sampling(priority=1, **long)) + kv(61, 6, samp=sampling(**long)) + turn(12) +
        migrate(60, "") + turn(2) + migrate(60, "") + turn(2) + migrate(61, STUCK_EP) + turn(20))
    put(h, "migrate_abort", kv(62, 6, samp=sampling(**long)) + kv(63, 6, samp=sampling(priority=1, **long)) +
        kv(64, 6, samp=sampling(**long)) + turn(14) + rec(OP_ROUTER, abort_msg(63)) + migrate(63, PEER_EP) +
        turn(20))
    # KV migrated in from another decode worker: admitted when it fits (a sequence 10 tokens in, its
    # last token not fed), bounced (Tokens.preempted) when it does not, never staged; pieces of one
    # block with a bounced first piece's later pieces dropped
    put(h, "migrated_in", kv(68, 20, samp=sampling(generated=10, seed=4, temperature=0.9, **long), migrated=True) +
        b"".join(kv(69 + i, 6, samp=sampling(**long)) for i in range(3)) + turn(2) +
        kv(72, 20, samp=sampling(generated=10, **long), migrated=True) + turn(4) +
        kv(68, 20, samp=sampling(generated=10, **long), migrated=True) + turn(20))
    ids6 = [1, 2, 3, 4, 5, 6]
    put(h, "preempt_penalties", kv(65, 6, samp=sampling(rep=1.3, **long), prompt=ids6) +
        kv(66, 6, samp=sampling(priority=1, rep=1.3, **long), prompt=ids6) +
        kv(67, 6, samp=sampling(rep=1.3, **long), prompt=ids6) + turn(30))
    put(h, "other_router", kv(47, 6, router="r2") + kv(48, 6, router=None) + turn(5) +
        rec(OP_ROUTER, abort_msg(48, None)))
    # bit 5: pieces of one block (a 20-token prompt's transfer is two)
    MODE_PIECES = 0x20

    def first(rid, n_tokens, pb=1, **kw):
        return kv(rid, n_tokens, piece_blocks=pb, **kw)

    def piece(rid, at, n=1, frame=None):
        return rec(OP_DATA, kv_piece_msg(rid, at, n), [frame if frame is not None else (n * KV_BLOCK_BYTES, b"\0\0\0\0")])

    def pieces_mode(rec_bytes, extra=0):
        return bytes([rec_bytes[0] | MODE_PIECES | extra]) + rec_bytes[1:]

    put(h, "pieces", pieces_mode(first(60, 20)) + piece(60, 1) + turn(6) +
        first(61, 20, samp=sampling(max_tokens=4, temperature=1.0, n=3), choices=((0, 17, 1), (1, 18, 2), (2, 19, 3))) +
        turn() + piece(61, 1) + turn(6))
    # out of order, a second first piece, a piece larger than a piece, a frame of the wrong length, a
    # piece of no transfer, a first piece larger than a piece, a transfer that stops midway
    put(h, "pieces_faults", pieces_mode(first(62, 20)) + piece(62, 2) + first(63, 20) + first(63, 20) +
        first(64, 20) + piece(64, 1, 2) + first(65, 20) + piece(65, 1, frame=b"kv") + piece(66, 1) +
        first(67, 20, pb=2) + turn() + first(68, 20, samp=sampling(max_tokens=8)) + turn(3))
    # two transfers arriving hold 4 of the 5 blocks: a third of two pieces cannot wait (preempted
    # before admission), a single piece takes the last block, the next single piece waits (no slot)
    # while the two go on, and one more first piece is turned away (one waits at most)
    put(h, "pieces_interleaved", pieces_mode(first(70, 20, samp=sampling(max_tokens=10))) +
        first(71, 20, samp=sampling(max_tokens=10)) + first(72, 20) + first(73, 6) + first(74, 6) +
        first(75, 20, samp=sampling(n=2), choices=((0, 17, 1), (1, 18, 2))) + piece(70, 1) + turn() +
        piece(72, 1) + piece(71, 1) + turn(12))
    put(h, "pieces_give_up", pieces_mode(first(76, 20), 0x80) + turn() + first(77, 6) + turn())
    # bf16 transfers (Kv.wire_dtype 1, half the bytes, widened into the fp32 cache): whole, n = 3,
    # and in pieces; then refused ones: bf16 claiming fp32 blocks, fp32 claiming bf16 blocks, a
    # frame of the other type's length, an unknown wire type, a bf16 piece of fp32 length
    half = KV_BLOCK_BYTES // 2
    put(h, "bf16", kv(90, 6, wire=1, samp=sampling(max_tokens=8)) +
        kv(91, 20, wire=1, samp=sampling(max_tokens=4, temperature=1.0, n=3), choices=((0, 17, 1), (1, 18, 2), (2, 19, 3))) +
        turn(8))
    put(h, "bf16_pieces", pieces_mode(first(92, 20, wire=1)) + piece(92, 1, frame=(half, b"\x80\x3f")) + turn(4) +
        first(93, 20, wire=1) + piece(93, 1) + turn(2))
    env, frames = kv_msg(94, 6, wire=1)
    put(h, "bf16_malformed", kv(95, 6, wire=1, block_bytes=KV_BLOCK_BYTES) + kv(96, 6, block_bytes=half) +
        rec(OP_DATA, env, [(KV_BLOCK_BYTES, b"\0\0\0\0")]) + kv(97, 6, wire=7) + kv(98, 6, wire=7, block_bytes=half) +
        kv(99, 6, wire=2 ** 31 - 1) + turn(3))
    # n > 1 under optimistic admission (issue 28): an n = 2 request of 6 tokens running to the
    # context (each choice at most 2 blocks: admitted to grow, 4 of the 5 blocks kept for them)
    # beside a long n = 1: the pool runs out, the n = 1 is preempted and never a choice; with a swap
    # region (mode bit 4) a choice of the n = 2 (priority 1) is swapped out alone, its sibling going on
    MODE_SWAP = 0x10
    two = dict(n=2, seed=9, temperature=0.9, **long)
    put(h, "preempt_choices", kv(80, 6, samp=sampling(**long)) +
        kv(81, 6, samp=sampling(priority=1, **two), choices=((0, 17, 1), (1, 18, 2))) + turn(30))
    put(h, "preempt_choices_swap", bytes([OP_DATA | MODE_SWAP]) + kv(82, 6, samp=sampling(**long))[1:] +
        kv(83, 6, samp=sampling(priority=1, **two), choices=((0, 17, 1), (1, 18, 2))) + turn(30))
    # a choice with no victim: a transfer whose pieces stopped holds two blocks (not a victim: in no
    # step); the n = 2 grows into the rest and its second choice waits for a block (stalled, not
    # recomputed) until the stopped transfer fails after the input
    put(h, "choices_wait", pieces_mode(first(84, 20)) +
        first(85, 6, samp=sampling(**two), choices=((0, 17, 1), (1, 18, 2))) + turn(30))



def pb_fixed64(field, v):
    return pb_key(field, 1) + struct.pack("<Q", v)


def encode_msg(rid, index=0, content_hash=0, endpoint=PEER_EP, early_id=0, router=ROUTER_ID):
    body = pb_int(1, index) + pb_int(2, content_hash)
    if endpoint is not None:
        body += pb_bytes(3, endpoint)
    if early_id:
        body += pb_fixed64(6, early_id)
    return env_of(4, 13, body, rid, router)


def encoder_seeds(imgs):
    h = "fuzz_encoder_msgs"
    jpg, png, gray = imgs["rgb.jpg"], imgs["rgba.png"], imgs["gray.jpg"]

    def enc(rid, image, op=OP_ROUTER, **kw):
        return rec(op, encode_msg(rid, **kw), [image])

    put(h, "one", enc(1, jpg, content_hash=11) + turn(2))
    put(h, "batch", enc(2, jpg, content_hash=21) + enc(3, png, content_hash=22) + enc(4, imgs["progressive.jpg"],
                                                                                      content_hash=23) + turn(3))
    put(h, "cache_hit", enc(5, gray, content_hash=31) + enc(6, gray, content_hash=31) + turn() +
        enc(7, gray, index=1, content_hash=31) + turn(2))
    put(h, "early_adopted", enc(77, png, content_hash=41, endpoint="") +
        enc(8, png, content_hash=41, early_id=77) + turn(2))
    put(h, "early_done_first", enc(78, jpg, content_hash=42, endpoint="") + turn(2) +
        enc(9, jpg, content_hash=42, early_id=78) + turn(2))
    put(h, "abort_queued", enc(10, jpg, content_hash=51) + rec(OP_ROUTER, abort_msg(10)) + turn() +
        rec(OP_ROUTER, abort_msg(10)) + turn())
    put(h, "abort_during_vit", enc(11, jpg, content_hash=52) + enc(12, png, content_hash=53) +
        rec(OP_LATE, abort_msg(11)) + turn(3))
    put(h, "prefill_stuck", enc(13, jpg, content_hash=54, endpoint=STUCK_EP) + turn(2) +   # the link buffers one
        enc(14, png, content_hash=55, endpoint=STUCK_EP) + enc(15, gray, content_hash=57) + turn(3) +
        rec(OP_ROUTER, abort_msg(14)) + turn(2))
    put(h, "prefill_unreachable", enc(15, gray, content_hash=56, endpoint="nowhere") + turn(2))
    bomb = png[:16] + struct.pack(">II", 65000, 65000) + png[24:]
    bomb = bomb[:29] + struct.pack(">I", zlib.crc32(bomb[12:29])) + bomb[33:]
    put(h, "bad_images", enc(16, b"not an image", content_hash=61) + enc(17, jpg[:len(jpg) // 2], content_hash=62) +
        enc(18, bomb, content_hash=63) + rec(OP_ROUTER, encode_msg(19, content_hash=64)) +
        rec(OP_ROUTER, encode_msg(20, content_hash=65), [jpg, png]) + rec(OP_ROUTER, env_of(4, 0, b"", 21), [jpg]) +
        turn(3))
    put(h, "queue_full", b"".join(enc(30 + i, jpg, content_hash=70 + i) for i in range(6)) +
        rec(OP_ROUTER, encode_msg(36, content_hash=80), [(30000, b"\xff\xd8\xff\xe0")]) + turn(4))
    put(h, "queue_bytes", rec(OP_ROUTER, encode_msg(37, content_hash=81), [(30000, b"\x89PNG")]) +
        rec(OP_ROUTER, encode_msg(38, content_hash=82), [(30000, b"\x89PNG")]) + turn(2))
    put(h, "duplicates", enc(39, jpg, content_hash=83) + enc(39, jpg, content_hash=83) + enc(39, png, content_hash=84,
                                                                                            router="r2") + turn(3))



ENC, PRE, DEC = 0, 1, 2   # fuzz_router_ctl's workers


def rrec(worker, env):
    return bytes([worker]) + struct.pack("<H", len(env)) + env


def tokens_msg(rid, ids, finish=0, from_prefill=False, error=None, kind=0, index=0, logprobs=(), prompt_tokens=0):
    body = pb_packed(1, ids) + pb_int(3, finish)
    for lp, top in logprobs:
        body += pb_bytes(2, pb_float(1, lp) + b"".join(pb_bytes(2, pb_int(1, t) + pb_float(2, v)) for t, v in top))
    if prompt_tokens:
        body += pb_int(4, prompt_tokens)
    if error:
        body += pb_bytes(5, error) + pb_int(9, kind)
    if from_prefill:
        body += pb_int(8, 1)
    if index:
        body += pb_int(10, index)
    return env_of(8, 17, body, rid, None)


def router_seeds():
    h = "fuzz_router_ctl"
    ONE, STREAM, CHAT, N2 = 1, 4, 8, 16
    MT1, MT4, MT16, MT64 = 0, 0x20, 0x40, 0x60
    STOP, LENGTH = 1, 2
    put(h, "first_token_ends", bytes([ONE | MT1]) + rrec(PRE, tokens_msg(0, [17], LENGTH, True)))
    put(h, "stream", bytes([ONE | STREAM | MT16]) + rrec(PRE, tokens_msg(0, [17], 0, True, prompt_tokens=6)) +
        rrec(DEC, tokens_msg(0, [18, 19])) + rrec(DEC, tokens_msg(0, [20], STOP)))
    put(h, "decode_before_prefill", bytes([2 | MT4]) + rrec(DEC, tokens_msg(1, [30])) + rrec(DEC, tokens_msg(1, [31])) +
        rrec(PRE, tokens_msg(1, [29], 0, True)) + rrec(DEC, tokens_msg(1, [32], LENGTH)) +
        rrec(PRE, tokens_msg(0, [5], 0, True)))
    # a decode that runs ahead of the prefill's first token sends more than the request may get (4
    # tokens): held up to n x max_tokens token ids, then the request fails (500); later messages, the
    # first token included, find no request
    put(h, "decode_overruns_before_first_token", bytes([ONE | MT4]) +
        b"".join(rrec(DEC, tokens_msg(0, [30 + i])) for i in range(6)) + rrec(DEC, tokens_msg(0, [])) +
        rrec(PRE, tokens_msg(0, [29], 0, True)))
    put(h, "wrong_workers", bytes([ONE | MT4]) + rrec(ENC, tokens_msg(0, [17], 0, True)) +
        rrec(DEC, tokens_msg(0, [17], 0, True)) + rrec(PRE, tokens_msg(0, [17], 0, False)) +
        rrec(PRE, env_of(7, 14, pb_int(1, 0), 0, None)) + rrec(PRE, tokens_msg(0, [17], 0, True)) +
        rrec(PRE, tokens_msg(0, [18], 0, True)))
    put(h, "errors", bytes([3 | STREAM | MT4]) + rrec(PRE, tokens_msg(0, [], 4, True, "prefill worker is full", 2)) +
        rrec(PRE, tokens_msg(1, [], 4, True, "bad", 1)) + rrec(DEC, tokens_msg(2, [], 4, False, "decode failed", 4)) +
        rrec(PRE, tokens_msg(2, [7], 0, True)) + rrec(DEC, tokens_msg(1, [], 4, False, "gone", 3)))
    put(h, "chat_logprobs_n2", bytes([ONE | CHAT | N2 | MT4]) +
        rrec(PRE, tokens_msg(0, [17], 0, True, logprobs=[(-0.5, [(17, -0.5), (18, -1.5)])])) +
        rrec(PRE, tokens_msg(0, [19], 0, True, index=1, logprobs=[(-0.1, [(19, -0.1), (3, -4.0)])])) +
        rrec(DEC, tokens_msg(0, [20, 21, 22], LENGTH, logprobs=[(-1.0, [(20, -1.0)])] * 3)) +
        rrec(DEC, tokens_msg(0, [23], STOP, index=1, logprobs=[(-0.2, [(23, -0.2), (1, -9.0)])])))
    put(h, "huge", bytes([ONE | STREAM | MT64]) + rrec(PRE, tokens_msg(0, list(range(4090, 4200)), 0, True)) +
        rrec(DEC, tokens_msg(0, [5] * 300, 0, index=7)) +
        rrec(DEC, tokens_msg(0, [6], 0, logprobs=[(float("nan"), [(i, -1.0) for i in range(60)])])))
    hb = pb_bytes(1, "decode-0") + pb_int(2, 3) + pb_int(4, 0) + pb_int(13, 99) + pb_int(14, 1)
    put(h, "heartbeats_drain", bytes([ONE | MT16]) + rrec(DEC, env_of(3, 12, hb, 0, None)) +
        rrec(PRE, tokens_msg(0, [17], 0, True)) + rrec(DEC, env_of(3, 12, hb + pb_int(15, 1), 0, None)) +
        rrec(DEC, tokens_msg(0, [18], LENGTH)) + rrec(DEC, env_of(3, 12, pb_int(15, 1), 0, None)))
    reg = (pb_int(1, 3) + pb_bytes(2, "prefill-0") + pb_bytes(3, "tcp://127.0.0.1:2") + pb_int(6, 0) + pb_int(7, 0) +
           pb_int(12, 0) + pb_fixed64(13, 77))
    put(h, "register_junk", bytes([ONE | MT4]) + rrec(PRE, env_of(1, 10, reg, 0, None)) +
        rrec(PRE, env_of(1, 0, b"", 0, None)) + rrec(ENC, env_of(1, 10, pb_int(1, 1) + pb_fixed64(13, 5), 0, None)) +
        rrec(PRE, tokens_msg(0, [17], 0, True)))
    done = pb_int(1, 0) + pb_int(2, 1) + pb_float(3, 1.5)
    # issue 26 finding 5: a body that stops after its image (flag 0x80) sends an early job that the
    # client's hang-up must abort (no answer), or that its encoder answers first (id 0: the early job)
    ABANDON = 0x80
    put(h, "regress-early-job-of-an-abandoned-body", bytes([ABANDON]))
    put(h, "regress-early-job-answered-then-abandoned", bytes([ABANDON | ONE | CHAT | MT4]) +
        rrec(ENC, env_of(7, 14, done, 1, None)) + rrec(PRE, tokens_msg(0, [17], 0, True)))
    # prefix events (PrefixEvents: stored, evicted, reset) from the prefill, malformed and oversized ones,
    # and from workers of other tiers (refused); a prefill's ERROR_PREFIX_MISS (the request is sent again)
    key = lambda i: struct.pack("<QQ", 0x1000 + i, 0x77 + i)
    ev = lambda stored=b"", evicted=b"", reset=False: env_of(13, 22, (pb_bytes(1, stored) if stored else b"") + (
        pb_bytes(2, evicted) if evicted else b"") + (pb_int(3, 1) if reset else b""), 0, None)
    put(h, "prefix_events", bytes([2 | CHAT | MT4]) + rrec(PRE, ev(key(0) + key(1) + key(2))) +
        rrec(PRE, ev(key(3), key(1))) + rrec(PRE, ev(key(4), reset=True)) + rrec(PRE, ev(b"\x05" * 17)) +
        rrec(PRE, ev(b"\x06" * (16 * 513))) + rrec(ENC, ev(key(5))) + rrec(DEC, ev(evicted=key(4))) +
        rrec(PRE, tokens_msg(0, [], 4, True, "prefix no longer cached for an image sent without embeddings", 5)) +
        rrec(PRE, tokens_msg(0, [], 4, True, "prefix no longer cached for an image sent without embeddings", 5)) +
        rrec(PRE, tokens_msg(1, [17], LENGTH, True)))
    put(h, "encode_done_unknown", bytes([0]) + rrec(ENC, env_of(7, 14, done, 0, None)) +
        rrec(ENC, env_of(7, 14, done + pb_bytes(5, "bad image") + pb_int(6, 1), 123456789, None)) +
        rrec(ENC, env_of(7, 0, b"", 5, None)) + rrec(DEC, env_of(99, 0, b"", 5, None)) + rrec(PRE, b"\x08\x01junk"))


def fetch_seeds():
    """fuzz_fetch_url (router/fetch_policy.c): mode byte, then a URL / URL NUL Location / CIDR NUL 16
    address bytes / 4 IPv4 bytes. "file://@" stands for the harness's allowed directory."""
    urls = ["https://a.test/img.jpg?x=1#f", "HTTP://A.TEST:80/x/../img.jpg", "http://[::1]:8080/a.png",
            "http://198.51.100.2/a.jpg", "ftp://a.test/x", "http://u:p@a.test/", "http://b.test/x",
            "https://xn--bcher-kva.example/", "file://@/a.jpg", "file://@/sub/b.jpg", "file://@/in.jpg",
            "file://@/up/s", "file://@/abs", "file://@/sub/%2e%2e/%2e%2e/secret/s", "file://@/../secret/s",
            "file://localhost@/a.jpg", "file:///etc/passwd", "file://@/a%00.jpg", "http://a.test" + "/a" * 40]
    for i, u in enumerate(urls):
        put("fuzz_fetch_url", "url-%02d" % i, b"\x00" + u.encode())
    redirects = [("https://a.test/d/x.jpg", "y.jpg"), ("https://a.test/d/x.jpg", "//b.test/c"),
                 ("https://a.test/d/x.jpg", "file://@/a.jpg"), ("http://a.test/", "https://[::1]/z#q"),
                 ("http://a.test/", "http://a.test:99999/")]
    for i, (u, loc) in enumerate(redirects):
        put("fuzz_fetch_url", "redirect-%02d" % i, b"\x01" + u.encode() + b"\x00" + loc.encode())
    v4 = lambda a: bytes(10) + b"\xff\xff" + bytes(a)  # noqa: E731
    cidrs = [("10.9.0.0/24", v4([10, 9, 0, 7])), ("fd00::/8", bytes([0xfd]) + bytes(15)),
             ("0.0.0.0/0", v4([8, 8, 8, 8])), ("::1", bytes(15) + b"\x01"), ("127.0.0.1/32", v4([127, 0, 0, 2]))]
    for i, (c, a) in enumerate(cidrs):
        put("fuzz_fetch_url", "cidr-%02d" % i, b"\x02" + c.encode() + b"\x00" + a)
    for i, a in enumerate([[127, 0, 0, 1], [169, 254, 169, 254], [100, 100, 100, 200], [8, 8, 8, 8], [0, 0, 0, 0]]):
        put("fuzz_fetch_url", "ipv4-%02d" % i, b"\x03" + bytes(a))


def main():
    imgs = images()
    for name, data in imgs.items():
        put("fuzz_image", name, bytes([0]) + data)
        put("fuzz_image", "scaled-" + name, bytes([0x25]) + data)
    for name in ("rgb.jpg", "rgba.png", "gray.jpg"):
        mime = "image/png" if name.endswith(".png") else "image/jpeg"
        put("fuzz_data_url", name + ".txt", "data:%s;base64,%s" % (mime, base64.b64encode(imgs[name]).decode()))
    put("fuzz_data_url", "params.txt", "data:image/png;charset=utf-8;name=x;base64,iVBORw0KGgo=")
    put("fuzz_data_url", "pad.txt", "QUJDRA==")
    put("fuzz_data_url", "percent.txt", "data:image/png,%89PNG")

    chat = {"model": "prism-tiny-llava", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}},
                                     {"type": "text", "text": "What is in the image?"}]}],
        "max_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 3, "stop": ["\n", "END"],
        "stop_token_ids": [2], "logprobs": True, "top_logprobs": 3, "stream": True,
        "stream_options": {"include_usage": True}}
    comp = {"model": "prism-tiny-llava", "prompt": "A red circle on a", "max_tokens": 4, "logprobs": 2,
            "ignore_eos": True, "stop": "x"}
    comp_ids = {"prompt": [1, 319, 2654], "max_completion_tokens": 2, "n": 1}
    put("fuzz_openai", "chat.json", b"\x01" + json.dumps(chat).encode())
    put("fuzz_openai", "completion.json", b"\x00" + json.dumps(comp).encode())
    put("fuzz_openai", "completion_ids.json", b"\x00" + json.dumps(comp_ids).encode())
    put("fuzz_openai", "bad.json", b"\x01{\"messages\":[{\"role\":\"user\"}],\"max_tokens\":-1}")
    # the API surface: penalties, logit_bias, n, structured output, tools and tool messages
    put("fuzz_openai", "sampling_extras.json", b"\x00" + json.dumps(SAMPLING_EXTRAS).encode())
    put("fuzz_openai", "json_schema.json", b"\x01" + json.dumps(JSON_SCHEMA_REQ).encode())
    put("fuzz_openai", "tools.json", b"\x01" + json.dumps(TOOLS_REQ).encode())

    def http(method, path, body=b"", headers=(), chunked=False):
        h = "%s %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n" % (method, path)
        for k, v in headers:
            h += "%s: %s\r\n" % (k, v)
        if chunked:
            h += "Transfer-Encoding: chunked\r\n\r\n"
            mid = len(body) // 2
            parts = [body[:mid], body[mid:]]
            return h.encode() + b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in parts if p) + b"0\r\n\r\n"
        h += "Content-Length: %d\r\n\r\n" % len(body)
        return h.encode() + body

    cj, pj = json.dumps(chat).encode(), json.dumps(comp).encode()
    put("fuzz_http_server", "chat_stream", b"\x00\x40" + http("POST", "/v1/chat/completions", cj))
    put("fuzz_http_server", "completion_later", b"\x10\x08" + http("POST", "/v1/completions", pj))
    put("fuzz_http_server", "chunked", b"\x02\x01" + http("POST", "/v1/completions", pj, chunked=True))
    put("fuzz_http_server", "pipelined", b"\x00\xff" + http("GET", "/health?x=1") + http("GET", "/metrics") +
        http("POST", "/v1/completions", pj, headers=[("Expect", "100-continue")]))
    put("fuzz_http_server", "upgrade", b"\x20\x02" + b"GET / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\n"
        b"Upgrade: websocket\r\n\r\nMORE BYTES AFTER THE UPGRADE")
    # lifted images checked while they stream in (mode 0x08), 9 bytes per loop turn: a real PNG, a PNG
    # header of 65000x65000 (refused on its first bytes), bad base64
    def chat_img(url):
        return json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}).encode()
    bomb = imgs["rgba.png"][:16] + struct.pack(">II", 65000, 65000) + imgs["rgba.png"][24:]
    bomb = bomb[:29] + struct.pack(">I", zlib.crc32(bomb[12:29])) + bomb[33:]
    for name, data in (("image_png", imgs["rgba.png"]), ("image_bomb", bomb)):
        put("fuzz_http_server", name, b"\x08\x01" + http("POST", "/v1/chat/completions",
                                                          chat_img("data:image/png;base64," + base64.b64encode(data).decode())))
    put("fuzz_http_server", "image_bad_b64", b"\x18\x03" + http("POST", "/v1/chat/completions",
                                                                  chat_img("data:image/jpeg;base64,/9j/4A!A")))
    put("fuzz_http_server", "http10", b"\x01\x10" + b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" %
        (len(pj), pj))

    safetensors_hdr = json.dumps({"__metadata__": {"format": "pt"},
                                  "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                                  "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
                                  "c": {"dtype": "F16", "shape": [], "data_offsets": [32, 34]}}).encode()
    payload = struct.pack("<6f", 1, 2, 3, 4, 5, 6) + b"\x80\x3f" * 4 + b"\x00\x3c"
    put("fuzz_safetensors", "small.safetensors", struct.pack("<Q", len(safetensors_hdr)) + safetensors_hdr + payload)

    with open(os.path.join(MODEL, "config.json"), "rb") as f:
        cfg = f.read()
    with open(os.path.join(MODEL, "generation_config.json"), "rb") as f:
        gen = f.read()
    put("fuzz_config", "llava.json", cfg + b"\x00" + gen)
    put("fuzz_config", "llama.json", json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                                  "num_attention_heads": 4, "num_key_value_heads": 2,
                                                  "intermediate_size": 128, "vocab_size": 100,
                                                  "max_position_embeddings": 256, "rope_scaling": {
                                                      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64}}))
    put("fuzz_config", "qwen2.json", json.dumps({"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 1,
                                                  "num_attention_heads": 2, "intermediate_size": 64,
                                                  "vocab_size": 50, "max_position_embeddings": 64,
                                                  "tie_word_embeddings": True, "eos_token_id": [1, 2]}))

    sp = {"version": "1.0", "added_tokens": [{"id": 0, "content": "<unk>", "special": True, "normalized": False},
                                             {"id": 1, "content": "<s>", "special": True, "normalized": False}],
          "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                             {"type": "Replace", "pattern": {"String": " "},
                                                              "content": "\u2581"}]},
          "pre_tokenizer": None,
          "post_processor": {"type": "TemplateProcessing",
                             "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                        {"Sequence": {"id": "A", "type_id": 0}}],
                             "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
          "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"},
                                                        "content": " "},
                                                       {"type": "ByteFallback"}, {"type": "Fuse"},
                                                       {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
          "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": True, "fuse_unk": True,
                    "vocab": {"<unk>": 0, "<s>": 1, "<0xE4>": 2, "<0xB8>": 3, "<0xAD>": 4, "\u2581": 5, "a": 6,
                              "b": 7, "ab": 8, "\u2581ab": 9, "c": 10},
                    "merges": ["a b", ["\u2581", "ab"]]}}
    put("fuzz_tokenizer_json", "sentencepiece.json", json.dumps(sp))
    bl_vocab = {c: i for i, c in enumerate(["!", "H", "e", "l", "o", "\u0120", "w", "r", "d", "He", "ll", "llo",
                                            "\u0120w", "<|endoftext|>"])}
    bl = {"version": "1.0", "added_tokens": [{"id": 13, "content": "<|endoftext|>", "special": True}],
          "normalizer": {"type": "NFC"},
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"Regex": "\\s+|\\w+|[^\\s\\w]+"}, "behavior": "Isolated", "invert": False},
              {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
          "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False},
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True},
          "model": {"type": "BPE", "vocab": bl_vocab, "merges": ["H e", "l l", "ll o", "\u0120 w"],
                    "ignore_merges": False}}
    put("fuzz_tokenizer_json", "bytelevel.json", json.dumps(bl))

    ids = [1, 319, 2654, 338, 29871, 13, 0, 32000, 32001]
    put("fuzz_detok", "ids_skip", bytes([1]) + b"".join(struct.pack("<H", 0x8000 | i) for i in ids))
    put("fuzz_detok", "ids_raw", bytes([0]) + b"".join(struct.pack("<H", 0x8000 | (i * 37 % 30000)) for i in range(64)))
    put("fuzz_detok", "out_of_range", bytes([0]) + struct.pack("<4H", 0x4000, 0x40ff, 0x8001, 0x4010))

    with open(os.path.join(MODEL, "chat_template.jinja"), "rb") as f:
        put("fuzz_template", "model.jinja", f.read())
    put("fuzz_template", "loops.jinja",
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.content is string %}{{ m.role | upper }}: "
        "{{ m.content | trim }}{% else %}{% for p in m.content %}{{ p.type }}{% endfor %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}{{ messages | length }}{{ '%d' | format(3) }}"
        "{% if add_generation_prompt %}{{ bos_token ~ 'assistant:' }}{% endif %}{{ raise_exception('x') if false }}"
        "{{ tools | tojson }}{{ messages[-1].content | default('none') }}{% macro f(a, b=2) %}{{ a + b }}{% endmacro %}"
        "{{ f(1) }}{{ 'a,b' .split(',') | join('-') }}{{ range(3) | list }}{{ {'k': 1}.items() | list }}")
    put("fuzz_template", "with_messages.jinja",
        b"{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}\x00" +
        json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]).encode())

    put("fuzz_envelope", "tokens", envelope(8, 17, pb_packed(1, [5, 6, 7]) + pb_int(3, 1) +
                                            pb_bytes(2, pb_float(1, -0.5) + pb_bytes(2, pb_int(1, 9) + pb_float(2, -1.0)))))
    put("fuzz_envelope", "register", envelope(1, 10, pb_int(1, 3) + pb_bytes(2, "decode-0") +
                                              pb_bytes(3, "tcp://127.0.0.1:5555") + pb_int(6, 1024) + pb_int(7, 16)))
    put("fuzz_envelope", "prefill", envelope(5, 15, pb_packed(1, [1, 32000, 32000, 29871]) +
                                             pb_bytes(2, pb_int(1, 1) + pb_int(2, 2)) +
                                             pb_bytes(3, pb_float(1, 0.7) + pb_int(6, 16) + pb_packed(7, [2])) +
                                             pb_bytes(4, "tcp://127.0.0.1:6000") + pb_bytes(5, "decode-0")))
    put("fuzz_envelope", "kv", envelope(9, 18, pb_int(1, 5) + pb_int(2, 16) + pb_int(3, 1) + pb_int(4, 65536) +
                                        pb_bytes(5, pb_int(6, 4)) + pb_int(6, 42)))
    put("fuzz_envelope", "kv_bf16", envelope(9, 18, pb_int(1, 5) + pb_int(2, 16) + pb_int(3, 1) + pb_int(4, 32768) +
                                             pb_bytes(5, pb_int(6, 4)) + pb_int(18, 1) + pb_int(18, 7)))
    put("fuzz_envelope", "abort", envelope(10, 19, pb_bytes(1, "client gone")))
    prefill_seeds()
    decode_seeds()
    encoder_seeds(imgs)
    router_seeds()
    fetch_seeds()


if __name__ == "__main__":
    main()
