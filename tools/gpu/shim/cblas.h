/* Minimal stand-in for <cblas.h> so tools/gpu builds the CPU reference backend on machines without
 * OpenBLAS (the GPU machines). Only what the CPU backend calls; naive_blas.c implements it. */
#ifndef PRISM_GPU_SHIM_CBLAS_H
#define PRISM_GPU_SHIM_CBLAS_H

enum CBLAS_ORDER { CblasRowMajor = 101, CblasColMajor = 102 };
enum CBLAS_TRANSPOSE { CblasNoTrans = 111, CblasTrans = 112 };

void cblas_sgemm(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, enum CBLAS_TRANSPOSE tb, int M, int N, int K,
                 float alpha, const float *A, int lda, const float *B, int ldb, float beta, float *C, int ldc);
void cblas_sgemv(enum CBLAS_ORDER order, enum CBLAS_TRANSPOSE ta, int rows, int cols, float alpha, const float *A,
                 int lda, const float *x, int incx, float beta, float *y, int incy);
void openblas_set_num_threads(int n);

#endif
