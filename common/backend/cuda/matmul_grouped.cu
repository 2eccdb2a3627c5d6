/* Grouped GEMM for MoE experts, one launch for all groups with the group sizes read on the device:
 * for each group e, rows [offsets[e], offsets[e+1]) of y = x · W_e, W_e = w + e*K*N in HF's [K][N]
 * layout. The grid covers ceil(M/BM) + n_groups row tiles (each group adds at most one partial
 * tile); a block finds its group by walking the offsets, then runs a shared-memory tiled GEMM in
 * fp32 with the weights converted from their storage dtype on load. A first, simple kernel: a
 * CUTLASS/cuBLASLt grouped GEMM is the obvious next step for large batches. */
#include "backend/cuda/cuda_common.cuh"

#define BM 32
#define BN 64
#define BK 16
#define THREADS 256

static __global__ void matmul_grouped_kernel(float *y, int ldy, const float *x, int ldx, const void *w, prism_dtype_t wdt,
                                             const int32_t *offsets, int n_groups, int N, int K)
{
    __shared__ float xs[BM][BK + 1];
    __shared__ float ws[BK][BN];
    __shared__ int s_group, s_row0, s_row1;
    if (threadIdx.x == 0) {
        int tile = blockIdx.y, g = -1, r0 = 0, r1 = 0;
        for (int e = 0; e < n_groups; e++) {
            int a = offsets[e], b = offsets[e + 1], n_tiles = (b - a + BM - 1) / BM;
            if (tile < n_tiles) {
                g = e;
                r0 = a + tile * BM;
                r1 = min(b, r0 + BM);
                break;
            }
            tile -= n_tiles;
        }
        s_group = g;
        s_row0 = r0;
        s_row1 = r1;
    }
    __syncthreads();
    int g = s_group, r0 = s_row0, rows = s_row1 - s_row0;
    if (g < 0) return;
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;   /* thread owns rows ty*2+{0,1}, cols tx*4+{0..3} */
    int col0 = blockIdx.x * BN;
    size_t wbase = (size_t)g * K * N;
    float acc[2][4] = {{0}};
    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = threadIdx.x; i < BM * BK; i += THREADS) {
            int r = i / BK, k = i % BK;
            xs[r][k] = (r < rows && k0 + k < K) ? x[(size_t)(r0 + r) * ldx + k0 + k] : 0.0f;
        }
        for (int i = threadIdx.x; i < BK * BN; i += THREADS) {
            int k = i / BN, n = i % BN;
            ws[k][n] = (k0 + k < K && col0 + n < N) ? prism_load_as_f32(w, wdt, wbase + (size_t)(k0 + k) * N + col0 + n)
                                                    : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < BK; k++) {
            float a0 = xs[ty * 2][k], a1 = xs[ty * 2 + 1][k];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float b = ws[k][tx * 4 + j];
                acc[0][j] += a0 * b;
                acc[1][j] += a1 * b;
            }
        }
        __syncthreads();
    }
    for (int i = 0; i < 2; i++) {
        int r = ty * 2 + i;
        if (r >= rows) continue;
        for (int j = 0; j < 4; j++) {
            int c = col0 + tx * 4 + j;
            if (c < N) y[(size_t)(r0 + r) * ldy + c] = acc[i][j];
        }
    }
}

static int launch(cudaStream_t st, float *y, int ldy, const float *x, int ldx, const void *w, prism_dtype_t wdt,
                  const int32_t *offsets, int n_groups, int M, int N, int K)
{
    dim3 grid((unsigned)((N + BN - 1) / BN), (unsigned)((M + BM - 1) / BM + n_groups));
    matmul_grouped_kernel<<<grid, THREADS, 0, st>>>(y, ldy, x, ldx, w, wdt, offsets, n_groups, N, K);
    return PRISM_CUDA_LAUNCHED("matmul_grouped");
}

extern "C" int prism_cuda_matmul_grouped(cudaStream_t st, float *y, int ldy, const float *x, int ldx, const void *w,
                                         prism_dtype_t wdt, const int32_t *offsets, int n_groups, int M, int N, int K)
{
    if (!y || !x || !w || !offsets || n_groups <= 0 || n_groups > 65535 || M < 0 || N <= 0 || K <= 0 || ldy < N ||
        ldx < K || M > PRISM_CUDA_MAX_ROWS ||
        (wdt != PRISM_DTYPE_F32 && wdt != PRISM_DTYPE_BF16 && wdt != PRISM_DTYPE_F16))
        return PRISM_EINVAL;
    if (M == 0) return PRISM_OK;
    return launch(st, y, ldy, x, ldx, w, wdt, offsets, n_groups, M, N, K);
}
