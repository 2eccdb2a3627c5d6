/* prism_imgtool: writes synthetic test images — one coloured shape on a plain background, or a
 * photo-like picture (smooth gradients, texture and noise, so JPEG files have realistic sizes).
 *
 *   prism_imgtool --out x.jpg --width 640 --height 480 --shape circle --color red --background white
 *   prism_imgtool --out y.png --width 300 --height 500 --shape triangle --scale 0.2 --offset-x 0.05 --offset-y -0.03
 *   prism_imgtool --out x.png --width 4096 --height 4096 --photo --seed 3
 *   prism_imgtool --out bomb.png --bomb 65000      (valid header claiming 65000x65000, tiny file)
 */
#include "core/core.h"
#include "core/cli.h"

#include <math.h>
#include <spng.h>
#include <stdio.h>
#include <string.h>
#include <turbojpeg.h>
#include <zlib.h>

static const struct { const char *name; uint8_t rgb[3]; } colors[] = {
    {"red", {220, 30, 30}},     {"green", {30, 170, 50}},  {"blue", {30, 60, 220}},
    {"yellow", {240, 220, 30}}, {"purple", {140, 40, 180}}, {"orange", {250, 140, 20}},
    {"white", {255, 255, 255}}, {"black", {0, 0, 0}},       {"gray", {128, 128, 128}},
};

static const uint8_t *color(const char *n)
{
    for (size_t i = 0; i < PRISM_ARRAY_LEN(colors); i++)
        if (!strcmp(colors[i].name, n)) return colors[i].rgb;
    return NULL;
}

static int inside(const char *shape, double x, double y, double cx, double cy, double r)
{
    double dx = x - cx, dy = y - cy;
    if (!strcmp(shape, "circle")) return dx * dx + dy * dy <= r * r;
    if (!strcmp(shape, "square")) return fabs(dx) <= r * 0.85 && fabs(dy) <= r * 0.85;
    /* triangle pointing up, inscribed in the circle of radius r */
    double top = cy - r, bottom = cy + r * 0.5;
    if (y < top || y > bottom) return 0;
    double half = (y - top) / (bottom - top) * r * 0.866;
    return fabs(dx) <= half;
}

static int write_png(const char *path, const uint8_t *rgb, int w, int h)
{
    spng_ctx *ctx = spng_ctx_new(SPNG_CTX_ENCODER);
    FILE *f = fopen(path, "wb");
    if (!ctx || !f) return 1;
    spng_set_png_file(ctx, f);
    struct spng_ihdr ihdr = {.width = (uint32_t)w, .height = (uint32_t)h, .bit_depth = 8, .color_type = SPNG_COLOR_TYPE_TRUECOLOR};
    spng_set_ihdr(ctx, &ihdr);
    int rc = spng_encode_image(ctx, rgb, (size_t)w * h * 3, SPNG_FMT_PNG, SPNG_ENCODE_FINALIZE);
    spng_ctx_free(ctx);
    fclose(f);
    return rc != 0;
}

static int write_jpeg(const char *path, const uint8_t *rgb, int w, int h, int quality, bool progressive)
{
    tjhandle tj = tjInitCompress();
    unsigned char *buf = NULL;
    unsigned long len = 0;
    int flags = progressive ? TJFLAG_PROGRESSIVE : 0;
    if (tjCompress2(tj, rgb, w, 0, h, TJPF_RGB, &buf, &len, TJSAMP_420, quality, flags) != 0) {
        fprintf(stderr, "jpeg: %s\n", tjGetErrorStr2(tj));
        return 1;
    }
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    fwrite(buf, 1, len, f);
    fclose(f);
    tjFree(buf);
    tjDestroy(tj);
    return 0;
}

/* A decompression bomb: a well-formed PNG (IHDR, one IDAT holding the first rows, IEND) whose
 * header claims size x size pixels while the file is a few hundred bytes. */
static void put_chunk(FILE *f, const char *type, const uint8_t *data, uint32_t len)
{
    uint8_t be[4] = {(uint8_t)(len >> 24), (uint8_t)(len >> 16), (uint8_t)(len >> 8), (uint8_t)len};
    fwrite(be, 1, 4, f);
    fwrite(type, 1, 4, f);
    if (len) fwrite(data, 1, len, f);
    uLong crc = crc32(0, (const Bytef *)type, 4);
    if (len) crc = crc32(crc, data, len);
    uint8_t c[4] = {(uint8_t)(crc >> 24), (uint8_t)(crc >> 16), (uint8_t)(crc >> 8), (uint8_t)crc};
    fwrite(c, 1, 4, f);
}

static int write_bomb_png(const char *path, uint32_t size)
{
    FILE *f = fopen(path, "wb");
    if (!f) return 1;
    fwrite("\x89PNG\r\n\x1a\n", 1, 8, f);
    uint8_t ihdr[13] = {(uint8_t)(size >> 24), (uint8_t)(size >> 16), (uint8_t)(size >> 8), (uint8_t)size,
                        (uint8_t)(size >> 24), (uint8_t)(size >> 16), (uint8_t)(size >> 8), (uint8_t)size,
                        1, 0, 0, 0, 0};  /* 1-bit grayscale */
    put_chunk(f, "IHDR", ihdr, 13);
    size_t row = 1 + (size + 7) / 8, raw_n = row * 4;
    uint8_t *raw = prism_xcalloc(raw_n, 1);
    uLongf zn = compressBound((uLong)raw_n);
    uint8_t *z = prism_xmalloc(zn);
    compress(z, &zn, raw, (uLong)raw_n);
    put_chunk(f, "IDAT", z, (uint32_t)zn);
    put_chunk(f, "IEND", NULL, 0);
    prism_free(raw);
    prism_free(z);
    return fclose(f) != 0;
}

int main(int argc, char **argv)
{
    const char *out = NULL, *shape = "circle", *fg = "red", *bg = "white";
    int64_t w = 256, h = 256, quality = 90, seed = 1, bomb = 0;
    double scale = 0.3, off_x = 0, off_y = 0;
    bool progressive = false, photo = false;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("out", &out, "Output file (.jpg/.jpeg or .png)"),
        PRISM_FLAG_INT("width", &w, "Width in pixels"),
        PRISM_FLAG_INT("height", &h, "Height in pixels"),
        PRISM_FLAG_STR("shape", &shape, "circle, square or triangle"),
        PRISM_FLAG_STR("color", &fg, "Shape colour: red green blue yellow purple orange"),
        PRISM_FLAG_STR("background", &bg, "Background: white black gray"),
        PRISM_FLAG_DOUBLE("scale", &scale, "Shape radius as a fraction of the shorter side"),
        PRISM_FLAG_DOUBLE("offset-x", &off_x, "Shape centre offset from the image centre, fraction of the width"),
        PRISM_FLAG_DOUBLE("offset-y", &off_y, "Shape centre offset from the image centre, fraction of the height"),
        PRISM_FLAG_INT("quality", &quality, "JPEG quality 1-100"),
        PRISM_FLAG_BOOL("progressive", &progressive, "Progressive JPEG"),
        PRISM_FLAG_BOOL("photo", &photo, "Photo-like content (gradients, texture, noise)"),
        PRISM_FLAG_INT("seed", &seed, "Random seed for --photo"),
        PRISM_FLAG_INT("bomb", &bomb, "Write a PNG whose header claims N x N pixels"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "prism_imgtool", "Writes synthetic JPEG/PNG test images.", flags);
    if (rc) return rc > 0 ? 0 : 2;
    if (!out) {
        fprintf(stderr, "prism_imgtool: --out is required\n");
        return 2;
    }
    if (bomb > 0) return write_bomb_png(out, (uint32_t)bomb);
    const uint8_t *fc = color(fg), *bc = color(bg);
    if (!fc || !bc || w < 1 || h < 1 || w > 16384 || h > 16384 || !(fabs(off_x) <= 1) || !(fabs(off_y) <= 1) ||
        !(scale > 0 && scale <= 4)) {
        fprintf(stderr, "prism_imgtool: bad colour, size, scale or offset\n");
        return 2;
    }
    uint8_t *rgb = prism_xmalloc((size_t)w * h * 3);
    /* tools/tiny_llava_common.py (render_shape) reimplements this geometry for training the bundled
     * model: keep the two identical. */
    double cx = w / 2.0 + off_x * w, cy = h / 2.0 + off_y * h, r = scale * (w < h ? w : h);
    uint64_t s = (uint64_t)seed * 0x9E3779B97F4A7C15ull + 1;
    for (int64_t y = 0; y < h; y++) {
        for (int64_t x = 0; x < w; x++) {
            uint8_t *p = rgb + ((size_t)y * w + x) * 3;
            if (photo) {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                double fx = (double)x / w, fy = (double)y / h, n = (double)(s & 255) / 255.0 - 0.5;
                double t = sin(fx * 12.0 + seed) * cos(fy * 9.0 - seed) * 0.5 + 0.5;
                p[0] = (uint8_t)fmin(255, fmax(0, 255 * (0.6 * fx + 0.3 * t) + 40 * n));
                p[1] = (uint8_t)fmin(255, fmax(0, 255 * (0.5 * fy + 0.4 * t) + 40 * n));
                p[2] = (uint8_t)fmin(255, fmax(0, 255 * (0.7 * (1 - fx) * fy + 0.2) + 40 * n));
            } else {
                const uint8_t *c = inside(shape, x + 0.5, y + 0.5, cx, cy, r) ? fc : bc;
                memcpy(p, c, 3);
            }
        }
    }
    size_t n = strlen(out);
    bool png = n > 4 && !strcmp(out + n - 4, ".png");
    rc = png ? write_png(out, rgb, (int)w, (int)h) : write_jpeg(out, rgb, (int)w, (int)h, (int)quality, progressive);
    prism_free(rgb);
    if (rc) fprintf(stderr, "prism_imgtool: could not write %s\n", out);
    return rc;
}
