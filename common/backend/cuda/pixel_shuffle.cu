/* Pixel shuffle (transformers' pixel_shuffle, ratio 1/s) as a gather:
 * out[i][h2*(g/s)+w2][(dh*s+dw)*C + c] = x[i][(s*h2+dh)*g + s*w2+dw][c]; rows past g*g of each
 * input image (the CLS) are never read. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void pixel_shuffle_kernel(float *out, const float *x, int n_img, int rows_per_img, int g, int C, int s)
{
    int go = g / s, oc = s * s * C;
    size_t total = (size_t)n_img * go * go * oc;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        int col = (int)(k % oc);
        size_t orow = k / oc;
        int i = (int)(orow / ((size_t)go * go)), cell = (int)(orow % ((size_t)go * go));
        int h2 = cell / go, w2 = cell % go;
        int sub = col / C, c = col % C, dh = sub / s, dw = sub % s;
        out[k] = x[((size_t)i * rows_per_img + (size_t)(s * h2 + dh) * g + s * w2 + dw) * C + c];
    }
}

static int launch(cudaStream_t st, float *out, const float *x, int n_img, int rows_per_img, int g, int C, int s)
{
    size_t total = (size_t)n_img * g * g * C;
    pixel_shuffle_kernel<<<prism_cuda_blocks(total, THREADS), THREADS, 0, st>>>(out, x, n_img, rows_per_img, g, C, s);
    return PRISM_CUDA_LAUNCHED("pixel_shuffle");
}

extern "C" int prism_cuda_pixel_shuffle(cudaStream_t st, float *out, const float *x, int n_img, int rows_per_img, int g,
                                        int C, int s)
{
    if (!out || !x || n_img < 0 || g <= 0 || C <= 0 || s <= 0 || g % s || rows_per_img < g * g) return PRISM_EINVAL;
    if (n_img == 0) return PRISM_OK;
    return launch(st, out, x, n_img, rows_per_img, g, C, s);
}
