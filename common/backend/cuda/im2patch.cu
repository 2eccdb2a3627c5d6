/* im2patch: pixels [n][C][H][W] -> out [n*(H/p)*(W/p)][C*p*p], patches row-major, feature index
 * c*p*p + ky*p + kx (the flattened Conv2d weight layout), so the patch embedding is one GEMM. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void im2patch_kernel(float *out, const float *pix, int n_img, int C, int H, int W, int p)
{
    int gh = H / p, gw = W / p, feat = C * p * p;
    size_t total = (size_t)n_img * gh * gw * feat;
    for (size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (size_t)gridDim.x * blockDim.x) {
        int f = (int)(k % feat);
        size_t patch = k / feat;
        int px = (int)(patch % gw), py = (int)((patch / gw) % gh);
        size_t n = patch / ((size_t)gw * gh);
        int c = f / (p * p), ky = (f / p) % p, kx = f % p;
        out[k] = pix[(((n * C + c) * H) + (size_t)py * p + ky) * W + (size_t)px * p + kx];
    }
}

static int launch(cudaStream_t st, float *out, const float *pix, int n_img, int C, int H, int W, int p)
{
    size_t total = (size_t)n_img * C * H * W;
    im2patch_kernel<<<prism_cuda_blocks(total, THREADS), THREADS, 0, st>>>(out, pix, n_img, C, H, W, p);
    return PRISM_CUDA_LAUNCHED("im2patch");
}

extern "C" int prism_cuda_im2patch(cudaStream_t st, float *out, const float *pixels, int n_img, int C, int H, int W,
                                   int p)
{
    if (p <= 0 || C <= 0 || H <= 0 || W <= 0 || n_img < 0 || H % p || W % p) return PRISM_EINVAL;
    if (n_img == 0) return PRISM_OK;
    return launch(st, out, pixels, n_img, C, H, W, p);
}
