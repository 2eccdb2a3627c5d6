/* The synthetic test picture of tools/gen_llama4_goldens.py (synth_image), in C: a gradient plus a
 * hashed texture in uint32 wrap-around arithmetic, so Llama-4 goldens need no image files. Shared by
 * the image and model tests. */
#ifndef PRISM_TEST_LLAMA4_SYNTH_H
#define PRISM_TEST_LLAMA4_SYNTH_H

#include "core/core.h"

/* [h][w][3] RGB8, prism_malloc'd (NULL when out of memory). */
static inline uint8_t *llama4_synth_image(int w, int h, uint32_t seed)
{
    uint8_t *p = prism_malloc((size_t)w * h * 3);
    if (!p) return NULL;
    uint32_t dw = w > 1 ? (uint32_t)w - 1 : 1, dh = h > 1 ? (uint32_t)h - 1 : 1;
    for (uint32_t y = 0; y < (uint32_t)h; y++)
        for (uint32_t x = 0; x < (uint32_t)w; x++)
            for (uint32_t c = 0; c < 3; c++) {
                uint32_t hsh = (x * 73856093u) ^ (y * 19349663u) ^ ((c + seed) * 83492791u);
                hsh = (hsh * 2654435761u) >> 27;
                uint32_t grad = ((x * 255u) / dw * (1u + c) + (y * 255u) / dh * (3u - c)) / 4u;
                p[((size_t)y * w + x) * 3 + c] = (uint8_t)((grad + hsh) & 255u);
            }
    return p;
}

#endif
