#!/usr/bin/env python3
"""Generates the image fixtures in tests/data/image/ (deterministic: seeded numpy, fixed encoders).

For every image it records what the reference stack (PIL + transformers' CLIP image processor, as
vLLM runs it for LLaVA) produces:
  * decode: the RGB8 pixels transformers' convert_to_rgb gives (RGBA/LA/tRNS composited on white),
    as an FNV-1a 64 checksum of the [h][w][3] bytes;
  * preprocessing with crop/shortest_edge 64: the full float32 [3][64][64] array of the PIL backend
    (CLIPImageProcessorPil), little-endian, <name>.clip64.f32;
  * preprocessing at 64, 224, 336 (LLaVA-1.5's real config) and a padded-crop config: FNV-1a 64 of
    the float32 bytes, for the PIL backend and, when torchvision is importable, the torchvision one
    (the C side matches both bit for bit, so checksums suffice and keep the fixtures small).
The manifest is manifest.json. C tests read only these files; Python is not needed at test time.

Which backend is "the" reference: transformers 5.x returns the torchvision CLIPImageProcessor when
torchvision is installed (vLLM always installs it) and CLIPImageProcessorPil otherwise. Both are
recorded. torchvision is not in the project's base environment; to record it, install it without
pulling CUDA packages, e.g.
    pip install --no-deps --target "$TVLIB" torchvision==0.29.2 && PYTHONPATH="$TVLIB" python3 tools/gen_image_goldens.py
(0.29.2 matches the torch 2.15 here; the CPU resize path it takes does not depend on the wheel's CUDA build).

--measure-dir DIR additionally writes full 224/336 reference arrays (PIL and torchvision) there, for
the measurement harness (tests/unit/image/image_measure.c); they are not committed.

Known, deliberate divergence: PIL converts 16-bit grayscale PNGs ("I;16") to RGB by clipping to 255
(nearly all-white images). Prism keeps the high byte, like PIL does for 16-bit RGB/RGBA. The gray16
fixture therefore records high-byte pixels, run through the same processor.
"""
import argparse
import io
import json
import os
import struct
import sys
import zlib

import numpy as np
from PIL import Image

SEED = 20240611
FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3

LLAVA_MEAN = [0.48145466, 0.4578275, 0.40821073]
LLAVA_STD = [0.26862954, 0.26130258, 0.27577711]


def fnv1a64(data: bytes) -> str:
    # Vectorised FNV-1a is not possible; chunking keeps this fast enough for a few MB.
    h = FNV_OFFSET
    mask = 0xFFFFFFFFFFFFFFFF
    for b in data:
        h = ((h ^ b) * FNV_PRIME) & mask
    return "%016x" % h


def clip_config(size):
    return {
        "crop_size": {"height": size, "width": size},
        "do_center_crop": True,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": LLAVA_MEAN,
        "image_processor_type": "CLIPImageProcessor",
        "image_std": LLAVA_STD,
        "processor_class": "LlavaProcessor",
        "resample": 3,
        "rescale_factor": 0.00392156862745098,
        "size": {"shortest_edge": size},
    }


def pad_config():
    """Shortest edge 45 under a 64x64 crop: exercises center_crop's zero padding (odd margins,
    where transformers' numpy path and torchvision put the extra row on different sides)."""
    c = clip_config(64)
    c["size"] = {"shortest_edge": 45}
    return c


# ------------------------------------------------------------------ synthetic content

def synth_rgb(w, h, seed, noise=6.0):
    """Gradients, hard-edged shapes, fine stripes and a little noise: smooth enough to compress,
    sharp enough that resampling details show up."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.zeros((h, w, 3))
    img[..., 0] = 255 * x / max(w - 1, 1)
    img[..., 1] = 255 * y / max(h - 1, 1)
    img[..., 2] = 127 + 100 * np.sin(x / max(w, 1) * 6.28 * 3) * np.cos(y / max(h, 1) * 6.28 * 2)
    for _ in range(12):
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        r = rng.uniform(0.03, 0.2) * min(w, h)
        col = rng.uniform(0, 255, 3)
        if rng.random() < 0.5:
            m = (x - cx) ** 2 + (y - cy) ** 2 < r * r
        else:
            m = (abs(x - cx) < r) & (abs(y - cy) < r * 0.6)
        img[m] = col
    # fine stripes in one band: aliasing-prone content
    band = (y > h * 0.7) & (y < h * 0.8)
    img[band] = (((x[band] // 2) % 2) * 255)[:, None]
    img += rng.normal(0, noise, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def synth_alpha(w, h, seed):
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    a = 255 * (x + y) / max(w + h - 2, 1)
    a[(x < w * 0.25)] = 0
    a[(y < h * 0.2)] = 255
    a += rng.normal(0, 3, a.shape)
    return np.clip(np.rint(a), 0, 255).astype(np.uint8)


# ------------------------------------------------------------------ raw PNG writer

ADAM7 = [(0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2)]


def png_chunk(tag, data):
    c = struct.pack(">I", len(data)) + tag + data
    return c + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)


def pack_rows(arr, depth):
    """arr: [h][w][c] integers -> list of raw scanlines (no filter byte)."""
    h = arr.shape[0]
    rows = []
    for r in range(h):
        row = arr[r].reshape(-1)
        if depth == 16:
            rows.append(row.astype(">u2").tobytes())
        elif depth == 8:
            rows.append(row.astype(np.uint8).tobytes())
        else:
            bits = np.unpackbits(row.astype(np.uint8)[:, None], axis=1)[:, 8 - depth:].reshape(-1)
            rows.append(np.packbits(bits).tobytes())
    return rows


def write_png(arr, color_type, depth, palette=None, trns=None, interlace=False):
    """Minimal PNG encoder (filter 0 or 'Sub' alternating) covering what PIL cannot write:
    16-bit RGB(A), low bit depths, Adam7."""
    h, w = arr.shape[:2]
    if arr.ndim == 2:
        arr = arr[:, :, None]
    out = b"\x89PNG\r\n\x1a\n"
    out += png_chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, depth, color_type, 0, 0, 1 if interlace else 0))
    if palette is not None:
        out += png_chunk(b"PLTE", bytes(np.asarray(palette, np.uint8).reshape(-1)))
    if trns is not None:
        out += png_chunk(b"tRNS", trns)
    raw = b""
    passes = ADAM7 if interlace else [(0, 0, 1, 1)]
    for (x0, y0, dx, dy) in passes:
        sub = arr[y0::dy, x0::dx]
        if sub.shape[0] == 0 or sub.shape[1] == 0:
            continue
        for i, row in enumerate(pack_rows(sub, depth)):
            raw += b"\x00" + row
    out += png_chunk(b"IDAT", zlib.compress(raw, 9))
    out += png_chunk(b"IEND", b"")
    return out


# ------------------------------------------------------------------ fixture set

def encode_pil(im, fmt, **kw):
    b = io.BytesIO()
    im.save(b, format=fmt, **kw)
    return b.getvalue()


def build_images():
    """(name, bytes, note)"""
    out = []
    s = SEED

    def rgb(w, h, k, noise=6.0):
        return synth_rgb(w, h, s + k, noise)

    out.append(("jpeg_base_640x480", encode_pil(Image.fromarray(rgb(640, 480, 1)), "JPEG", quality=90), ""))
    out.append(("jpeg_prog_800x600", encode_pil(Image.fromarray(rgb(800, 600, 2)), "JPEG", quality=85, progressive=True), ""))
    out.append(("jpeg_444_64x64", encode_pil(Image.fromarray(rgb(64, 64, 3)), "JPEG", quality=95, subsampling=0), "upscaled"))
    out.append(("jpeg_422_333x217", encode_pil(Image.fromarray(rgb(333, 217, 4)), "JPEG", quality=90, subsampling=1), ""))
    out.append(("jpeg_gray_300x500", encode_pil(Image.fromarray(rgb(300, 500, 5)[..., 1]), "JPEG", quality=90), ""))
    out.append(("jpeg_cmyk_200x150", encode_pil(Image.fromarray(rgb(200, 150, 6)).convert("CMYK"), "JPEG", quality=90), "Adobe CMYK"))
    out.append(("jpeg_2048x2048", encode_pil(Image.fromarray(rgb(2048, 2048, 7, 2.0)), "JPEG", quality=80), ""))
    out.append(("jpeg_prog_1024x2048", encode_pil(Image.fromarray(rgb(1024, 2048, 8, 2.0)), "JPEG", quality=80, progressive=True), "1:2"))
    out.append(("jpeg_2048x1024", encode_pil(Image.fromarray(rgb(2048, 1024, 9, 2.0)), "JPEG", quality=80), "2:1"))
    out.append(("jpeg_1500x1001", encode_pil(Image.fromarray(rgb(1500, 1001, 10, 3.0)), "JPEG", quality=85), ""))

    out.append(("png_rgb_333x222", encode_pil(Image.fromarray(rgb(333, 222, 20, 1.5)), "PNG"), ""))
    rgba = np.dstack([rgb(256, 384, 21, 1.5), synth_alpha(256, 384, 21)])
    out.append(("png_rgba_256x384", encode_pil(Image.fromarray(rgba, "RGBA"), "PNG"), "alpha on white"))
    pal = Image.fromarray(rgb(200, 200, 22, 0.0)).quantize(colors=64, dither=Image.Dither.NONE)
    pal.info["transparency"] = bytes([0, 128] + [255] * 62)
    out.append(("png_palette_trns_200x200", encode_pil(pal, "PNG", transparency=bytes([0, 128] + [255] * 62)), "palette + tRNS"))
    idx = (rgb(150, 100, 23, 0.0)[..., 0] // 16).astype(np.uint8)
    palette = np.random.default_rng(s + 23).integers(0, 256, (16, 3))
    out.append(("png_palette4_150x100", write_png(idx, 3, 4, palette=palette), "4-bit palette"))
    out.append(("png_gray_150x300", encode_pil(Image.fromarray(rgb(150, 300, 24, 1.5)[..., 2]), "PNG"), ""))
    g = rgb(120, 120, 25, 0.0)[..., 0]
    g[40:80, 40:80] = 77
    out.append(("png_gray_trns_120x120", write_png(g, 0, 8, trns=struct.pack(">H", 77)), "gray + tRNS"))
    la = np.dstack([rgb(120, 90, 26, 1.5)[..., 0], synth_alpha(120, 90, 26)])
    out.append(("png_la_120x90", encode_pil(Image.fromarray(la, "LA"), "PNG"), "gray + alpha"))
    r16 = rgb(100, 80, 27, 1.5).astype(np.uint16) * 257 + np.random.default_rng(s + 27).integers(0, 257, (80, 100, 3)).astype(np.uint16)
    out.append(("png_rgb16_100x80", write_png(r16, 2, 16), "16-bit RGB"))
    a16 = np.dstack([rgb(90, 70, 28, 1.5).astype(np.uint16) * 257, synth_alpha(90, 70, 28).astype(np.uint16) * 257])
    out.append(("png_rgba16_90x70", write_png(a16, 6, 16), "16-bit RGBA"))
    g16 = rgb(64, 96, 29)[..., 1].astype(np.uint16) * 257 + 3
    out.append(("png_gray16_64x96", write_png(g16, 0, 16), "16-bit gray: high byte (PIL clips, see docstring)"))
    g1 = (rgb(100, 50, 30, 0.0)[..., 0] > 127).astype(np.uint8)
    out.append(("png_gray1_100x50", write_png(g1, 0, 1), "1-bit gray"))
    ri = np.dstack([rgb(97, 61, 31, 1.5), synth_alpha(97, 61, 31)])
    out.append(("png_rgba_interlaced_97x61", write_png(ri, 6, 8, interlace=True), "Adam7 + alpha"))
    yy, xx = np.mgrid[0:256, 0:256]
    allc = np.dstack([xx, 255 - xx, (xx * 7) % 256, yy]).astype(np.uint8)
    out.append(("png_alpha_all_256x256", encode_pil(Image.fromarray(allc, "RGBA"), "PNG"), "every (value, alpha) pair"))
    out.append(("png_rgb_64x128", encode_pil(Image.fromarray(rgb(64, 128, 32, 1.5)), "PNG"), "upscaled, 1:2"))
    return out


def reference_rgb(name, data):
    from transformers.image_transforms import convert_to_rgb

    im = Image.open(io.BytesIO(data))
    im.load()
    if name.startswith("png_gray16"):
        a = np.asarray(im, dtype=np.uint16) if im.mode != "I" else np.asarray(im).astype(np.uint16)
        a = (a >> 8).astype(np.uint8)
        return np.repeat(a[..., None], 3, axis=2), im
    return convert_to_rgb(im, return_numpy=True), im


def processors():
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    procs = {}
    for size in (64, 224, 336):
        procs[("pil", size)] = CLIPImageProcessorPil(**clip_config(size))
    procs[("pil", "pad")] = CLIPImageProcessorPil(**pad_config())
    try:
        import torchvision  # noqa: F401
        from transformers.models.clip.image_processing_clip import CLIPImageProcessor

        for size in (64, 224, 336):
            procs[("tv", size)] = CLIPImageProcessor(**clip_config(size))
        procs[("tv", "pad")] = CLIPImageProcessor(**pad_config())
        tv_version = torchvision.__version__
    except Exception as e:  # torchvision absent: PIL-only fixtures
        print("torchvision backend unavailable (%s); recording PIL only" % e, file=sys.stderr)
        tv_version = None
    return procs, tv_version


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--out", default=os.path.join(here, "..", "tests", "data", "image"))
    ap.add_argument("--measure-dir", default=None)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.measure_dir:
        os.makedirs(args.measure_dir, exist_ok=True)

    import transformers
    import PIL

    procs, tv_version = processors()
    for size in (64, 224, 336, "pad"):
        with open(os.path.join(args.out, "preprocessor_config_%s.json" % size), "w") as f:
            json.dump(clip_config(size) if size != "pad" else pad_config(), f, indent=2, sort_keys=True)
            f.write("\n")

    entries = []
    for name, data, note in build_images():
        ext = "jpg" if name.startswith("jpeg") else "png"
        fname = "%s.%s" % (name, ext)
        with open(os.path.join(args.out, fname), "wb") as f:
            f.write(data)
        rgb, im = reference_rgb(name, data)
        h, w = rgb.shape[:2]
        e = {
            "file": fname,
            "note": note,
            "format": ext if ext == "png" else "jpeg",
            "width": w,
            "height": h,
            "pil_mode": im.mode,
            "progressive": bool(im.info.get("progressive") or im.info.get("progression") or im.info.get("interlace")),
            "rgb_fnv": fnv1a64(np.ascontiguousarray(rgb).tobytes()),
        }
        # Processors take the PIL image as vLLM hands it over (gray16: the high-byte RGB image).
        src = Image.fromarray(rgb) if name.startswith("png_gray16") else im
        for backend in ("pil", "tv"):
            if (backend, 64) not in procs:
                continue
            for size in (64, 224, 336):
                pv = procs[(backend, size)](src, return_tensors="np")["pixel_values"][0]
                pv = np.ascontiguousarray(pv, dtype="<f4")
                assert pv.shape == (3, size, size), pv.shape
                e["%s_%d_fnv" % (backend, size)] = fnv1a64(pv.tobytes())
                if size == 64 and backend == "pil":
                    out = "%s.clip64.f32" % name
                    pv.tofile(os.path.join(args.out, out))
                    e["pil_64_file"] = out
                elif args.measure_dir:
                    pv.tofile(os.path.join(args.measure_dir, "%s.%s%d.f32" % (name, backend, size)))
            pv = procs[(backend, "pad")](src, return_tensors="np")["pixel_values"][0]
            e["%s_pad_fnv" % backend] = fnv1a64(np.ascontiguousarray(pv, dtype="<f4").tobytes())
        entries.append(e)
        print("%-28s %5dx%-5d %-5s %7d bytes  %s" % (name, w, h, im.mode, len(data), note))

    manifest = {
        "generator": "tools/gen_image_goldens.py",
        "seed": SEED,
        "transformers": transformers.__version__,
        "pillow": PIL.__version__,
        "torchvision": tv_version,
        "checksum": "FNV-1a 64 over raw bytes (RGB8 [h][w][3]; float32 LE [3][s][s])",
        "images": entries,
    }
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
