#!/usr/bin/env python3
"""Builds the tokenizer conformance corpus and the HF `tokenizers` goldens for it.

Outputs (tests/data/tokenizer/):
  corpus.jsonl                 one JSON string per line (seeded, deterministic)
  golden_<name>.jsonl          per tokenizer, line i describes corpus line i:
      {"ids": [...],           encode(s, add_special_tokens=False).ids
       "pre": [...], "suf": [...]   encode(s, add_special_tokens=True).ids == pre + ids + suf
                                    (omitted when empty)
       "d": str,               decode(ids, skip_special_tokens=False), omitted when == s
       "ds": str,              decode(pre+ids+suf, skip_special_tokens=True), omitted when == d
       "dk": str}              decode(pre+ids+suf, skip_special_tokens=False), on every 8th line
                               only, and omitted when == decode(pre, False) + d + decode(suf, False)
      The first line of each golden file is a header {"tokenizer": path, "n": count, "stride": k,
      "edge": e}: the golden lines describe, in order, corpus lines i with i < e or i % k == 0.

Tokenizers: ../shared/tokenizers/{llama3_1,qwen3,llama2} beside the repository (or $PRISM_SHARED_DIR/tokenizers)
and the bundled models/prism-tiny-llava/tokenizer.json (missing ones are skipped), plus three small
synthetic tokenizers trained here (tests/data/tokenizer/synth_*.json, committed) that cover the
components the real files do not use.

Usage: python3 tools/gen_tokenizer_goldens.py [--n 5200] [--seed 1234]
"""
import argparse
import json
import os
import random
import sys
import unicodedata

os.environ.setdefault("RAYON_NUM_THREADS", "1")   # before tokenizers starts its thread pool

from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "tokenizer")
SHARED = os.environ.get("PRISM_SHARED_DIR", os.path.join(os.path.dirname(ROOT), "shared"))

TOKENIZERS = [
    ("llama3_1", os.path.join(SHARED, "tokenizers", "llama3_1", "tokenizer.json")),
    ("qwen3", os.path.join(SHARED, "tokenizers", "qwen3", "tokenizer.json")),
    ("llama2", os.path.join(SHARED, "tokenizers", "llama2", "tokenizer.json")),
    ("prism_tiny_llava", os.path.join(ROOT, "models", "prism-tiny-llava", "tokenizer.json")),
]

WORDS = ("the of and to in is was for on that with as by at from his her it an were are which this be "
         "or has had not but one their they been have who all would there she he we you I what when "
         "time people year way day man thing woman life child world school state family student group "
         "country problem hand part place case week company system program question work government "
         "number night point home water room mother area money story fact month lot right study book "
         "eye job word business issue side kind head house service friend father power hour game line "
         "end member law car city community name president team minute idea kid body information back "
         "parent face others level office door health person art war history party result change "
         "morning reason research girl guy moment air teacher force education tokenizer transformer "
         "encoder decoder attention Prism LLaVA GPU kernel latency throughput naïve café résumé "
         "coöperate façade jalapeño Zürich São Paulo München Ελλάδα").split()
CONTRACTIONS = ["don't", "I'll", "she's", "we're", "they've", "I'm", "he'd", "it's", "You'RE", "WE'LL",
                "'S", "'s", "'t", "'ll", "'re", "'ve", "'m", "'d", "O'Neil", "rock'n'roll"]
PUNCT = list(".,;:!?") + ["...", " - ", " -- ", "—", "–", "(", ")", "\"", "'", "«", "»", "“", "”", "‘", "’", "…"]

CODE = [
    "def {f}({a}, {b}):\n    return {a} + {b} * {n}\n",
    "for (int {a} = 0; {a} < {n}; ++{a}) {{\n\t{b}[{a}] = {f}({a});\n}}\n",
    "const {f} = async ({a}) => {{ await fetch(`/api/${{{a}}}`); }};",
    "fn {f}(&mut self, {a}: u32) -> Result<Vec<u8>, Error> {{ Ok(vec![{n}; {a} as usize]) }}",
    "<div class=\"{f}\"><span id='{a}'>{n}</span></div>\r\n",
    "{{\"{f}\": [{n}, {n2}], \"{a}\": null, \"{b}\": true}}",
    "SELECT {a}, COUNT(*) FROM {f} WHERE {b} > {n} GROUP BY {a};",
    "#include <stdio.h>\nint main(void) {{ printf(\"%d\\n\", {n}); return 0; }}\n",
    "if [ -f \"${a}\" ]; then\n  echo \"{f} $(( {n} + 1 ))\"\nfi\n",
    "    {a} = {{'{b}': {n}, \"{f}\": [1, 2, 3]}}\n        # {f}: TODO fix\n",
    "import numpy as np\n{a} = np.zeros(({n}, {n2}), dtype=np.float32)\n",
    "public static void {f}(String[] {a}) throws IOException {{\n\t\tSystem.out.println({a}.length);\n\t}}",
    "x <- c({n}, {n2})\nlm({a} ~ {b}, data = df)",
    "  - name: {f}\n    image: prism/{a}:{n}\n    args: [\"--{b}\", \"{n2}\"]\n",
]
IDENTS = ["foo", "bar", "baz", "x", "y", "i", "j", "idx", "tokens", "kv_cache", "camelCase", "snake_case_name",
          "HTTPServer", "_private", "__init__", "getValue", "MAX_LEN", "ptr", "buf", "self"]

SPECIAL_TEXT = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                "<|reserved_special_token_0|>", "<|reserved_special_token_250|>", "<|im_start|>", "<|im_end|>",
                "<|endoftext|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|vision_start|>",
                "<s>", "</s>", "<unk>", "[INST]", "[/INST]", "<<SYS>>", "<</SYS>>", "<image>", "<pad>",
                "[MASK]", "<sep>", "[SEP2]", "<|user|>", " <tool>", "hello", "ab", "ing", "  x",
                "<|begin_of_text", "<s", "s>", "<|im_start", "<|", "|>", "<<s>>", "< s >", "<S>"]

EDGE = ["", " ", "  ", "   ", "\n", "\n\n", "\t", "\r\n", "\r", " \n ", "a", "A", ".", "'", "''", "'s", "'S",
        "'ſ", "'K", "'ﬆ", "x'Re y'LL", "I'M", "\u00a0", "\u3000", "\u2009", "\u180e", "\u200b", "\u200d",
        "\x0b\x0c", "\x85", "\x1c\x1d\x1e\x1f", "\x00", "a\x00b", "\ufeff", "\ufffd", "\ufffd\ufffd",
        "e\u0301", "E\u0301\u0323", "a\u0323\u0301", "a\u0301\u0323", "\u212b", "\u0344", "\u1100\u1161\u11a8",
        "\u1100\u1161", "\uac00\u11a8", "\u0915\u093c", "\u0958", "\u00c5", "A\u030a", "\u1e9b\u0323",
        "ﬁ", "①②③", "Ⅻ", "½", "²³", "٣٤٥", "१२३", "๑๒๓", "\u0661\u0662", "𝟘𝟙𝟚", "ǅ", "ß", "ẞ", "İ", "ı",
        "a" * 600, "ab" * 300, "9" * 200, " " * 100, "\n" * 50, "\t" * 30, "😀" * 40, "-" * 80, "=" * 64,
        "...........", "!!!???", "____init____", "😀", "👍🏽", "👨‍👩‍👧‍👦", "🇺🇸🇯🇵", "🏳️‍🌈", "1️⃣", "❤️",
        "a b", "a  b", " a", "a ", " a ", "\ta", "a\t", "a\n", "\na", "a\r\nb", " \r\n \r\n ", "x\u00a0y",
        "a [MASK] b", "a   [MASK]", "[MASK]", "x\t\t[MASK]y", "<sep>   next", "<sep>\n\nz", "a[SEP2]b",
        "a [SEP2] b", " [SEP2] ", "hello world", "sayhello", "hello_", "_hello", "hello!", "hello1", "héllo hello",
        "ab cd", "cab", " ab ", "ab", "ab1", "a <tool>   b", " <tool>", "<tool>", "  x  x", "sing", "singing ing",
        "<|user|>hi", "<image><image>", "hello world", "Hello World!", "HELLO", "hELLo", "don't stop", "12345", "123456789", "3.14159",
        "-42", "1e-10", "0x1F", "1,000,000", "2024-01-31", "12:30:45", "+1 (555) 010-9999"]


def rand_word(r):
    return r.choice(WORDS)


def english(r):
    n = r.randint(1, 25)
    out = []
    for i in range(n):
        w = rand_word(r)
        if r.random() < 0.08:
            w = r.choice(CONTRACTIONS)
        if r.random() < 0.1:
            w = w.upper() if r.random() < 0.5 else w.capitalize()
        out.append(w)
        if r.random() < 0.12:
            out[-1] += r.choice(PUNCT)
    s = " ".join(out)
    if r.random() < 0.5:
        s = s[:1].upper() + s[1:] + r.choice([".", "!", "?", "", "\n"])
    return s


def chars_from(r, ranges, n):
    out = []
    for _ in range(n):
        lo, hi = r.choice(ranges)
        out.append(chr(r.randint(lo, hi)))
    return "".join(out)


def script_text(r, ranges, punct, space=True, marks=None, markp=0.0):
    n = r.randint(1, 40)
    out = []
    for i in range(n):
        lo, hi = r.choice(ranges)
        out.append(chr(r.randint(lo, hi)))
        if marks and r.random() < markp:
            out.append(chr(r.randint(*marks)))
        if space and r.random() < 0.18:
            out.append(" ")
        if r.random() < 0.06:
            out.append(r.choice(punct))
    return "".join(out)


def chinese(r):
    return script_text(r, [(0x4E00, 0x9FA5)], ["，", "。", "！", "？", "、", "：", "“", "”", "（", "）", "1", "2024年"],
                       space=False)


def japanese(r):
    return script_text(r, [(0x3041, 0x3093), (0x30A1, 0x30F6), (0x4E00, 0x9FA5), (0x30FC, 0x30FC)],
                       ["。", "、", "「", "」", "！", "ー", "〜"], space=False)


def korean(r):
    s = script_text(r, [(0xAC00, 0xD7A3)], [".", ",", "?", "!"], space=True)
    if r.random() < 0.2:   # decomposed jamo: exercises NFC composition
        s += "".join(chr(0x1100 + r.randint(0, 18)) + chr(0x1161 + r.randint(0, 20)) +
                     (chr(0x11A8 + r.randint(0, 26)) if r.random() < 0.5 else "") for _ in range(r.randint(1, 5)))
    return s


def arabic(r):
    return script_text(r, [(0x0621, 0x063A), (0x0641, 0x064A)], ["،", "؟", ".", "٣"], marks=(0x064B, 0x0652), markp=0.2)


def hindi(r):
    return script_text(r, [(0x0905, 0x0939)], ["।", ",", "?"], marks=(0x093C, 0x094D), markp=0.4)


def russian(r):
    return script_text(r, [(0x0410, 0x044F), (0x0401, 0x0401), (0x0451, 0x0451)], [",", ".", "!", "—", "«", "»"])


def greek(r):
    s = script_text(r, [(0x0391, 0x03A9), (0x03B1, 0x03C9), (0x03AC, 0x03AF)], [",", ".", ";", "·"],
                    marks=(0x0300, 0x0301), markp=0.15)
    return s


def thai(r):
    return script_text(r, [(0x0E01, 0x0E2E), (0x0E30, 0x0E3A), (0x0E40, 0x0E4E)], [" ", "ๆ", "๑"], space=False)


EMOJI = ["😀", "😂", "🥲", "🤖", "🚀", "🔥", "✨", "👍", "👍🏻", "👍🏿", "👨‍💻", "👩‍🔬", "👨‍👩‍👧‍👦", "🧑🏽‍🤝‍🧑🏻",
         "🏳️‍🌈", "🏴‍☠️", "❤️", "❤️‍🔥", "☺️", "✌️", "#️⃣", "1️⃣", "🇺🇸", "🇯🇵", "🇩🇪", "🇧🇷", "🇮🇳", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "🫠", "🪐"]


def emoji(r):
    out = []
    for _ in range(r.randint(1, 12)):
        out.append(r.choice(EMOJI) if r.random() < 0.7 else rand_word(r))
        if r.random() < 0.4:
            out.append(" ")
    return "".join(out)


def code(r):
    t = r.choice(CODE)
    s = t.format(f=r.choice(IDENTS), a=r.choice(IDENTS), b=r.choice(IDENTS), n=r.randint(0, 10 ** r.randint(1, 6)),
                 n2=r.randint(0, 999))
    if r.random() < 0.3:
        s = s.replace("    ", "\t")
    if r.random() < 0.2:
        s = s.replace("\n", "\r\n")
    return s


def number(r):
    k = r.randint(0, 9)
    if k == 0:
        return str(r.randint(0, 10 ** r.randint(1, 45)))
    if k == 1:
        return "%.*f" % (r.randint(1, 8), r.uniform(-1e6, 1e6))
    if k == 2:
        return "{:,}".format(r.randint(0, 10 ** r.randint(3, 15)))
    if k == 3:
        return " ".join(str(r.randint(0, 10 ** r.randint(1, 6))) for _ in range(r.randint(2, 10)))
    if k == 4:
        return "%04d-%02d-%02d %02d:%02d" % (r.randint(1900, 2100), r.randint(1, 12), r.randint(1, 28),
                                              r.randint(0, 23), r.randint(0, 59))
    if k == 5:
        return "v%d.%d.%d" % (r.randint(0, 20), r.randint(0, 99), r.randint(0, 999))
    if k == 6:
        return "".join(r.choice("0123456789") for _ in range(r.randint(1, 64)))
    if k == 7:
        return "%d%%" % r.randint(0, 100) + " of " + str(r.randint(1, 99999)) + " items"
    if k == 8:
        return "$" + str(r.randint(1, 10 ** 9)) + "." + "%02d" % r.randint(0, 99)
    return "x" + str(r.randint(0, 999)) + "y" + str(r.randint(0, 99999)) + "z"


WS = [" ", "  ", "   ", "    ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", "\u00a0", "\u3000",
      "\u2009", "\u200b", "\x0b", "\x0c", "\u2028", "\u180e", "        ", "\n\t", " \t "]


def whitespace(r):
    out = []
    for _ in range(r.randint(1, 12)):
        out.append(r.choice(WS) * r.randint(1, 3))
        if r.random() < 0.6:
            out.append(rand_word(r) if r.random() < 0.8 else number(r))
    return "".join(out)


def special(r):
    out = []
    for _ in range(r.randint(1, 8)):
        c = r.random()
        if c < 0.45:
            out.append(r.choice(SPECIAL_TEXT))
        elif c < 0.75:
            out.append(rand_word(r))
        else:
            out.append(r.choice(WS))
    sep = r.choice(["", " ", "\n", ""])
    return sep.join(out)


def chat(r):
    role = r.choice(["system", "user", "assistant"])
    k = r.randint(0, 2)
    if k == 0:
        return "<|start_header_id|>%s<|end_header_id|>\n\n%s<|eot_id|>" % (role, english(r))
    if k == 1:
        return "<|im_start|>%s\n%s<|im_end|>\n" % (role, english(r))
    return "<s>[INST] %s [/INST] %s </s>" % (english(r), english(r))


def random_unicode(r):
    out = []
    for _ in range(r.randint(1, 30)):
        while True:
            plane = r.random()
            cp = r.randint(0, 0x2FFFF) if plane < 0.95 else r.randint(0xE0000, 0xE01EF)
            if 0xD800 <= cp < 0xE000:
                continue
            cat = unicodedata.category(chr(cp))
            if cat in ("Cn", "Cs", "Co"):
                continue
            break
        out.append(chr(cp))
        if r.random() < 0.15:
            out.append(" ")
    return "".join(out)


def long_word(r):
    k = r.randint(0, 3)
    if k == 0:
        return "".join(r.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(r.randint(30, 400)))
    if k == 1:
        return "".join(r.choice(WORDS) for _ in range(r.randint(5, 40)))
    if k == 2:
        return "https://example.com/" + "/".join(r.choice(IDENTS) for _ in range(r.randint(2, 10))) + "?q=" + str(r.randint(0, 10 ** 9))
    return chinese(r) * r.randint(2, 6)


GENS = [(english, 18), (chinese, 6), (japanese, 5), (korean, 5), (arabic, 4), (hindi, 4), (russian, 4),
        (greek, 3), (thai, 3), (emoji, 5), (code, 9), (number, 7), (whitespace, 6), (special, 6), (chat, 3),
        (random_unicode, 6), (long_word, 2)]


def mixed(r):
    parts = []
    for _ in range(r.randint(2, 5)):
        g = r.choices([g for g, _ in GENS], weights=[w for _, w in GENS])[0]
        parts.append(g(r))
    return r.choice(["", " ", "\n", "  "]).join(parts)


def build_corpus(n, seed):
    r = random.Random(seed)
    corpus = list(EDGE)
    gens = GENS + [(mixed, 10)]
    while len(corpus) < n:
        g = r.choices([g for g, _ in gens], weights=[w for _, w in gens])[0]
        corpus.append(g(r))
    return corpus


def golden(tok, corpus):
    lines = []
    probe = tok.encode("hello", add_special_tokens=False).ids
    probe_s = tok.encode("hello", add_special_tokens=True).ids
    pre_default = next(p for p in range(len(probe_s)) if probe_s[p:p + len(probe)] == probe)
    for i, s in enumerate(corpus):
        e = tok.encode(s, add_special_tokens=False).ids
        es = tok.encode(s, add_special_tokens=True).ids
        # TemplateProcessing etc. wrap the plain ids; find the wrapper (the usual prefix length
        # first: an empty encoding would fit anywhere)
        pre_n = None
        cands = [pre_default] + list(range(len(es) - len(e) + 1))
        for p in cands:
            if es[p:p + len(e)] == e:
                pre_n = p
                break
        assert pre_n is not None, ("post-processor does not wrap", s)
        pre, suf = es[:pre_n], es[pre_n + len(e):]
        rec = {"ids": e}
        if pre:
            rec["pre"] = pre
        if suf:
            rec["suf"] = suf
        d = tok.decode(e, skip_special_tokens=False)
        if d != s:
            rec["d"] = d
        ds = tok.decode(es, skip_special_tokens=True)
        if ds != d:
            rec["ds"] = ds
        dk = tok.decode(es, skip_special_tokens=False)
        if i % 8 == 0 and dk != tok.decode(pre, skip_special_tokens=False) + d + tok.decode(suf, skip_special_tokens=False):
            rec["dk"] = dk
        lines.append(json.dumps(rec, ensure_ascii=False, separators=(",", ":")))
    return lines


SYNTH_STRIDE = 4   # synthetic goldens cover every 4th corpus string (small vocabularies, many ids)


def build_synth(corpus, retrain):
    """Small tokenizers trained on the corpus that exercise the components the real ones do not:
    Metaspace/Digits/WhitespaceSplit/Split behaviours, NFD/Strip/Replace/Prepend normalizers,
    added-token lstrip/rstrip/single_word/normalized, unk + fuse_unk, subword prefix/suffix,
    Roberta/Bert/Template post-processors, Metaspace/Replace/Strip/Fuse decoders, ignore_merges."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
    train = corpus[::2]
    out = {}

    # 1. SentencePiece-like without byte fallback: NFD, right strip, space collapsing; Metaspace "first"
    t = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    t.normalizer = normalizers.Sequence([normalizers.NFD(), normalizers.Strip(left=False, right=True),
                                         normalizers.Replace(Regex(" {2,}"), " ")])
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")])
    t.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    tr = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
                             limit_alphabet=300)
    t.train_from_iterator(train, tr)
    t.add_special_tokens([AddedToken("[MASK]", lstrip=True, special=True),
                          AddedToken("<sep>", rstrip=True, special=True),
                          AddedToken("<image>", normalized=False, special=True)])
    t.add_tokens([AddedToken("hello", single_word=True, normalized=True), AddedToken("ing", normalized=True),
                  AddedToken("  x", normalized=False)])
    t.post_processor = processors.RobertaProcessing(("</s>", t.token_to_id("</s>")), ("<s>", t.token_to_id("<s>")))
    out["synth_metaspace"] = t

    # 2. Word-based splitting with subword affixes and Replace/Strip decoders
    t = Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=False, continuing_subword_prefix="##", end_of_word_suffix="</w>"))
    t.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Replace("``", '"'), normalizers.Prepend("_")])
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(r"[.,;:!?]"), behavior="merged_with_next"),
        pre_tokenizers.Split(Regex(r"\p{N}+"), behavior="merged_with_previous"),
        pre_tokenizers.Split("-", behavior="contiguous"),
        pre_tokenizers.Split(Regex(r"[^_]+"), behavior="removed", invert=True)])
    t.decoder = decoders.Sequence([decoders.Replace("</w>", " "), decoders.Replace("##", ""), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])  # stop>0 panics in HF on empty text
    tr = trainers.BpeTrainer(vocab_size=900, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False,
                             continuing_subword_prefix="##", end_of_word_suffix="</w>", limit_alphabet=400)
    t.train_from_iterator(train, tr)
    t.add_special_tokens([AddedToken("[SEP2]", single_word=True, lstrip=True, rstrip=True, special=True)])
    t.post_processor = processors.BertProcessing(("[SEP]", t.token_to_id("[SEP]")), ("[CLS]", t.token_to_id("[CLS]")))
    out["synth_wordpiece_like"] = t

    # 3. GPT-2 style byte-level with prefix space, Digits first, template with bos/eos, ignore_merges
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.Strip(left=True, right=False)
    t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=False),
                                               pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True)])
    t.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=1200, special_tokens=["<bos>", "<eos>"], show_progress=False,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(train, tr)
    t.add_special_tokens([AddedToken("<|user|>", normalized=False, special=True)])
    t.add_tokens([AddedToken(" <tool>", rstrip=True, normalized=False), AddedToken("ab", single_word=True, normalized=False)])
    t.post_processor = processors.TemplateProcessing(single="<bos> $A <eos>", pair="<bos> $A <eos> $B:1 <eos>:1",
                                                     special_tokens=[("<bos>", t.token_to_id("<bos>")),
                                                                     ("<eos>", t.token_to_id("<eos>"))])
    j = json.loads(t.to_str())
    j["model"]["ignore_merges"] = True
    out["synth_bytelevel"] = Tokenizer.from_str(json.dumps(j))

    paths = {}
    for name, tok in out.items():
        path = os.path.join(OUT, name + ".json")
        if os.path.exists(path) and not retrain:
            paths[name] = path   # BPE training breaks count ties by hash order: keep the committed file
            continue
        j = json.loads(tok.to_str())
        with open(path, "w", encoding="utf-8") as f:
            json.dump(j, f, ensure_ascii=False, separators=(",", ":"))
        paths[name] = path
    return paths


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--retrain-synth", action="store_true", help="retrain tests/data/tokenizer/synth_*.json")
    args = ap.parse_args()
    os.makedirs(OUT, exist_ok=True)
    corpus = build_corpus(args.n, args.seed)
    with open(os.path.join(OUT, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for s in corpus:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    print("corpus: %d strings, %d bytes" % (len(corpus), sum(len(s.encode()) for s in corpus)))
    synth = build_synth(corpus, args.retrain_synth)
    for name, path in TOKENIZERS + sorted(synth.items()):
        if not os.path.exists(path):
            print("skip %s: %s not found" % (name, path), file=sys.stderr)
            continue
        tok = Tokenizer.from_file(path)
        stride = SYNTH_STRIDE if name in synth else 1
        sel = [i for i in range(len(corpus)) if i < len(EDGE) or i % stride == 0]
        lines = golden(tok, [corpus[i] for i in sel])
        rel = os.path.relpath(path, os.path.dirname(ROOT))
        out = os.path.join(OUT, "golden_%s.jsonl" % name)
        with open(out, "w", encoding="utf-8") as f:
            f.write(json.dumps({"tokenizer": rel, "n": len(lines), "stride": stride, "edge": len(EDGE)}) + "\n")
            f.write("\n".join(lines) + "\n")
        print("%s: %d bytes" % (out, os.path.getsize(out)))


if __name__ == "__main__":
    main()
