/* GEMMs through cuBLAS: y[M][N] = x[M][K] · W[N][K]ᵀ (+ b) (+ y).
 *
 * Row-major y = x·Wᵀ is column-major yᵀ = W·xᵀ with W read transposed ("TN", the layout tensor
 * cores like best). bf16/f16 weights: x is rounded to the weight dtype into the conversion
 * scratch (chunks of rows when M*K does not fit) and the GEMM runs bf16 x bf16 -> fp32 with fp32
 * accumulation (CUBLAS_COMPUTE_32F). fp32 weights: plain SGEMM (no TF32), for tests. Bias is
 * broadcast into y first so the GEMM always runs with beta = 1 in that case. cuBLAS gets a fixed
 * workspace from the pool, so it never allocates on the request path. */
#include "backend/cuda/cuda_impl.h"

#include <cublas_v2.h>

static const char *cublas_err(cublasStatus_t s)
{
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED: return "alloc failed";
    case CUBLAS_STATUS_INVALID_VALUE: return "invalid value";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "arch mismatch";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "execution failed";
    case CUBLAS_STATUS_INTERNAL_ERROR: return "internal error";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "not supported";
    default: return "error";
    }
}

static int cublas_check(cublasStatus_t s, const char *what, int line)
{
    if (s == CUBLAS_STATUS_SUCCESS) return PRISM_OK;
    prism_log(PRISM_LOG_ERROR, __FILE__, line, "cublas: %s failed: %s (%d)", what, cublas_err(s), (int)s);
    return s == CUBLAS_STATUS_INVALID_VALUE ? PRISM_EINVAL : s == CUBLAS_STATUS_NOT_SUPPORTED ? PRISM_ENOTSUP : PRISM_EIO;
}
#define CB(call) cublas_check((call), #call, __LINE__)

int prism_cuda_gemm_init(prism_cuda_ctx_t *c)
{
    cublasHandle_t h = NULL;
    int rc;
    if ((rc = CB(cublasCreate(&h)))) return rc;
    c->cublas = h;
    if ((rc = CB(cublasSetStream(h, c->stream)))) return rc;
    if ((rc = CB(cublasSetWorkspace(h, c->cublas_ws, c->cublas_ws_bytes)))) return rc;
    /* No TF32 for fp32 GEMMs: they exist for exactness checks. */
    return CB(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH));
}

void prism_cuda_gemm_free(prism_cuda_ctx_t *c)
{
    if (c->cublas) cublasDestroy((cublasHandle_t)c->cublas);
    c->cublas = NULL;
}

int prism_cuda_matmul(void *ctx, float *y, int ldy, const float *x, int ldx, const void *w, prism_dtype_t wdt,
                      const float *b, int M, int N, int K, bool accumulate)
{
    prism_cuda_ctx_t *c = ctx;
    cublasHandle_t h = c->cublas;
    if (M < 0 || N <= 0 || K <= 0 || ldy < N || ldx < K || !y || !x || !w) return PRISM_EINVAL;
    if (wdt != PRISM_DTYPE_F32 && wdt != PRISM_DTYPE_BF16 && wdt != PRISM_DTYPE_F16) return PRISM_EINVAL;
    if (M == 0) return PRISM_OK;
    int rc;
    float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    if (b) {
        if ((rc = prism_cuda_bias_rows(c->stream, y, ldy, b, M, N, accumulate))) return rc;
        beta = 1.0f;
    }
    if (wdt == PRISM_DTYPE_F32)
        return CB(cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, (const float *)w, K, x, ldx, &beta, y, ldy));

    cudaDataType_t t = wdt == PRISM_DTYPE_BF16 ? CUDA_R_16BF : CUDA_R_16F;
    int rows = (int)PRISM_MIN((size_t)M, c->conv_bytes / ((size_t)K * 2));
    if (rows < 1) return PRISM_ELIMIT;   /* K beyond the scratch (> 32M elements at the minimum) */
    for (int r0 = 0; r0 < M; r0 += rows) {
        int m = PRISM_MIN(rows, M - r0);
        if ((rc = prism_cuda_convert(c->stream, c->conv, wdt, x + (size_t)r0 * ldx, (size_t)m, (size_t)K, (size_t)ldx)))
            return rc;
        if ((rc = CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, m, K, &one, w, t, K, c->conv, t, K, &beta,
                                  y + (size_t)r0 * ldy, CUDA_R_32F, ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT))))
            return rc;
    }
    return PRISM_OK;
}
