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


PROTOCOL_VERSION = 4  # common/net/net.h PRISM_PROTOCOL_VERSION: other versions are refused at unpack


def envelope(type_, body_field, body, rid=7, rid_hi=0x5EC12E7):
    return (pb_int(1, PROTOCOL_VERSION) + pb_int(2, type_) + pb_int(3, rid) + pb_bytes(4, "router-a-1-8000") +
            pb_key(5, 1) + struct.pack("<Q", rid_hi) + pb_bytes(body_field, body))


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
    put("fuzz_envelope", "abort", envelope(10, 19, pb_bytes(1, "client gone")))


if __name__ == "__main__":
    main()
