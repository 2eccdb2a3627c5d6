"""Accuracy of the bundled models/prism-tiny-llava through the whole cluster (router -> encoder ->
prefill -> decode), on a held-out set of pictures the model never trained on.

The model is trained (tools/train_tiny_llava.py) to answer "A <colour> <shape> on a <background>
background." for one circle, square or triangle in one of six colours on a white, black or gray
background. Here prism_imgtool draws new pictures from the same distribution with another seed:
every colour/shape/background combination, JPEG (baseline and progressive, several qualities) and
PNG, sizes from 64x64 to 4096x4096 including non-square ones. Each goes through the cluster with
temperature 0; at least 95% of the answers must name the right colour and the right shape (and no
other colour or shape). Accuracy and every miss are printed.

Run: python3 tests/integration/test_accuracy.py   (PRISM_BINARY_DIR=build dir)
     PRISM_ACCURACY_N=<n> adds n random pictures on top of the fixed set (default 18).
"""
import concurrent.futures
import math
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from cluster import Cluster, chat_body, make_image, run_tests  # noqa: E402

COLORS = ["red", "green", "blue", "yellow", "purple", "orange"]
SHAPES = ["circle", "square", "triangle"]
BACKGROUNDS = ["white", "black", "gray"]
QUESTIONS = ["What is in the image?", "Describe the image.", "What do you see?"]
SEED = 90210  # training uses other seeds: none of these pictures was seen in training
MIN_ACCURACY = 0.95
TMP = tempfile.mkdtemp(prefix="prism-acc-")


def random_geometry(rng):
    """Size, placement and encoding, drawn like the training pictures (tools/train_tiny_llava.py)."""
    short = math.exp(rng.uniform(math.log(64), math.log(1024)))
    aspect = math.exp(rng.uniform(math.log(0.5), math.log(2.0)))
    w, h = (short * aspect, short) if aspect >= 1 else (short, short / aspect)
    return {
        "width": max(64, min(4096, int(round(w)))), "height": max(64, min(4096, int(round(h)))),
        "scale": round(rng.uniform(0.15, 0.4), 4),
        "offset_x": round(rng.uniform(-0.08, 0.08), 4), "offset_y": round(rng.uniform(-0.08, 0.08), 4),
        "ext": rng.choice([".jpg", ".jpg", ".png"]),
        "quality": rng.choice([40, 60, 75, 85, 95]), "progressive": rng.random() < 0.35,
    }


def build_cases():
    rng = random.Random(SEED)
    combos = [(c, s, b) for c in COLORS for s in SHAPES for b in BACKGROUNDS]
    rng.shuffle(combos)
    cases = [dict(random_geometry(rng), color=c, shape=s, background=b) for c, s, b in combos]
    # Fixed extremes on top of the random ones: tiny, huge, and the widest/tallest aspect ratios.
    fixed = [(64, 64, ".png"), (64, 64, ".jpg"), (64, 128, ".jpg"), (128, 64, ".png"), (4096, 4096, ".jpg"),
             (4096, 4096, ".png"), (4096, 2048, ".jpg"), (2048, 4096, ".png"), (2048, 1024, ".jpg"),
             (1024, 2048, ".jpg"), (1500, 1001, ".png"), (97, 61, ".jpg")]
    extra = int(os.environ.get("PRISM_ACCURACY_N", "18"))
    for i in range(len(fixed) + extra):
        g = random_geometry(rng)
        if i < len(fixed):
            g["width"], g["height"], g["ext"] = fixed[i]
        c, s, b = rng.choice(combos)
        cases.append(dict(g, color=c, shape=s, background=b))
    for i, case in enumerate(cases):
        case["question"] = QUESTIONS[i % len(QUESTIONS)]
        name = "%03d_%s_%s_%s_%dx%d%s" % (i, case["color"], case["shape"], case["background"], case["width"],
                                          case["height"], case["ext"])
        opts = {k: case[k] for k in ("width", "height", "shape", "color", "background", "scale", "offset_x",
                                      "offset_y")}
        if case["ext"] == ".jpg":
            opts["quality"] = case["quality"]
            if case["progressive"]:
                opts["progressive"] = True
        case["path"] = make_image(os.path.join(TMP, name), **opts)
    return cases


def names_it(answer, case):
    """Right colour and right shape named, and no other colour or shape."""
    words = set(answer.lower().replace(".", " ").replace(",", " ").split())
    return (case["color"] in words and case["shape"] in words
            and not (words & set(COLORS)) - {case["color"]} and not (words & set(SHAPES)) - {case["shape"]})


t0 = time.time()
CASES = build_cases()
print("%d held-out pictures written in %.1fs" % (len(CASES), time.time() - t0), flush=True)
C = Cluster()
print("cluster ready in %.2fs" % C.wait_ready(), flush=True)


def test_held_out_accuracy():
    def ask(case):
        status, r = C.post_json("/v1/chat/completions",
                                chat_body(case["question"], [case["path"]], max_tokens=24, temperature=0))
        assert status == 200, (status, r, case["path"])
        return r["choices"][0]["message"]["content"]

    t = time.time()
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        answers = list(ex.map(ask, CASES))
    right = [names_it(a, c) for a, c in zip(answers, CASES)]
    exact = sum(a.strip() == "A %s %s on a %s background." % (c["color"], c["shape"], c["background"])
                for a, c in zip(answers, CASES))
    acc = sum(right) / len(CASES)
    print("accuracy (colour and shape): %d/%d = %.1f%%; exact answers incl. background %d/%d; %.1fs"
          % (sum(right), len(CASES), 100 * acc, exact, len(CASES), time.time() - t), flush=True)
    for ok, a, c in zip(right, answers, CASES):
        if not ok:
            print("  MISS %s %s on %s (%dx%d%s, scale %.2f): %r" % (c["color"], c["shape"], c["background"],
                                                                 c["width"], c["height"], c["ext"], c["scale"], a))
    by = {}
    for ok, c in zip(right, CASES):
        for key in ("color", "shape", "background", "ext"):
            by.setdefault((key, c[key]), []).append(ok)
    print("  per group: " + ", ".join("%s %d/%d" % (v, sum(o), len(o)) for (k, v), o in sorted(by.items())))
    assert acc >= MIN_ACCURACY, "accuracy %.1f%% < %.0f%%" % (100 * acc, 100 * MIN_ACCURACY)


def test_text_only_answers():
    for text in ("Hello", "What can you do?"):
        status, r = C.post_json("/v1/chat/completions",
                                {"model": "prism-tiny-llava", "messages": [{"role": "user", "content": text}],
                                 "max_tokens": 24, "temperature": 0})
        assert status == 200, (status, r)
        content = r["choices"][0]["message"]["content"]
        print("  text-only %r -> %r" % (text, content))
        assert content.strip(), r


def test_all_processes_alive():
    assert all(C.alive().values()), C.alive()


if __name__ == "__main__":
    try:
        rc = run_tests([test_held_out_accuracy, test_text_only_answers, test_all_processes_alive])
    finally:
        C.stop()
        if os.environ.get("PRISM_KEEP_LOGS"):
            print("logs in", C.log_dir)
    sys.exit(rc)
