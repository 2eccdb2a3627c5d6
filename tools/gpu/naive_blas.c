/* Naive SGEMM for the tools/gpu CPU reference (row-major, every transpose combination), threaded
 * over rows with pthreads: slow but exact enough, and it needs no BLAS on the GPU machine. */
#include "cblas.h"

#include <pthread.h>
#include <stdlib.h>

static int g_threads = 1;
void openblas_set_num_threads(int n) { g_threads = n > 0 ? n : 1; }

typedef struct {
    int ta, tb, M, N, K, lda, ldb, ldc, r0, r1;
    float alpha, beta;
    const float *A, *B;
    float *C;
} job_t;

static void *run(void *p)
{
    job_t *j = p;
    for (int i = j->r0; i < j->r1; i++)
        for (int n = 0; n < j->N; n++) {
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            int k = 0;
            if (!j->ta && j->tb) {   /* the only layout cpu_backend.c uses: x · Wᵀ, both rows contiguous */
                const float *a = j->A + (size_t)i * j->lda, *b = j->B + (size_t)n * j->ldb;
                for (; k + 4 <= j->K; k += 4) {
                    s0 += a[k] * b[k]; s1 += a[k + 1] * b[k + 1]; s2 += a[k + 2] * b[k + 2]; s3 += a[k + 3] * b[k + 3];
                }
                for (; k < j->K; k++) s0 += a[k] * b[k];
            } else {
                for (; k < j->K; k++) {
                    float a = j->ta ? j->A[(size_t)k * j->lda + i] : j->A[(size_t)i * j->lda + k];
                    float b = j->tb ? j->B[(size_t)n * j->ldb + k] : j->B[(size_t)k * j->ldb + n];
                    s0 += a * b;
                }
            }
            float *c = j->C + (size_t)i * j->ldc + n;
            float v = j->alpha * ((s0 + s1) + (s2 + s3));
            *c = j->beta == 0.0f ? v : v + j->beta * *c;
        }
    return NULL;
}

void cblas_sgemm(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, int M, int N, int K,
                 float alpha, const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc)
{
    if (order != CblasRowMajor) abort();
    int nt = g_threads > 64 ? 64 : g_threads;
    if ((long)M * N * K < (1L << 22) || M < nt) nt = 1;
    job_t jobs[64];
    pthread_t th[64];
    for (int t = 0; t < nt; t++) {
        jobs[t] = (job_t){ta == CblasTrans, tb == CblasTrans, M, N, K, lda, ldb, ldc, M * t / nt, M * (t + 1) / nt,
                          alpha, beta, A, B, C};
        if (t) pthread_create(&th[t], NULL, run, &jobs[t]);
    }
    run(&jobs[0]);
    for (int t = 1; t < nt; t++) pthread_join(th[t], NULL);
}

/* y = alpha·op(A)·x + beta·y, A rows x cols row-major, unit strides (all the CPU backend uses), as a
 * one-row sgemm: op(A) = Aᵀ gives y[cols] = x[rows]·A, op(A) = A gives y[rows] = x[cols]·Aᵀ. */
void cblas_sgemv(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, int rows, int cols, float alpha, const float *A,
                 int lda, const float *x, int incx, float beta, float *y, int incy)
{
    if (order != CblasRowMajor || incx != 1 || incy != 1) abort();
    if (ta == CblasTrans)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, 1, cols, rows, alpha, x, rows, A, lda, beta, y, cols);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, 1, rows, cols, alpha, x, cols, A, lda, beta, y, rows);
}
