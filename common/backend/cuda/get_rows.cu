/* Embedding gather: out[i][dim] (f32) = table[ids[i]][dim] (f32 / bf16 / f16); ids outside
 * [0, n_table) give zero rows. One block per output row. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 256

static __global__ void get_rows_kernel(float *out, const void *table, prism_dtype_t dt, int n_table,
                                       const int32_t *ids, int dim)
{
    int id = ids[blockIdx.x];
    float *o = out + (size_t)blockIdx.x * dim;
    bool ok = id >= 0 && id < n_table;
    size_t base = (size_t)(ok ? id : 0) * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = ok ? prism_load_as_f32(table, dt, base + j) : 0.0f;
}

static int launch(cudaStream_t st, float *out, const void *table, prism_dtype_t dt, int n_table,
                  const int32_t *ids, int n, int dim)
{
    get_rows_kernel<<<n, THREADS, 0, st>>>(out, table, dt, n_table, ids, dim);
    return PRISM_CUDA_LAUNCHED("get_rows");
}

extern "C" int prism_cuda_get_rows(cudaStream_t st, float *out, const void *table, prism_dtype_t dt, int n_table,
                                   const int32_t *ids, int n, int dim)
{
    if (dim <= 0 || n < 0 || n > PRISM_CUDA_MAX_ROWS || n_table < 0 ||
        (dt != PRISM_DTYPE_F32 && dt != PRISM_DTYPE_BF16 && dt != PRISM_DTYPE_F16))
        return PRISM_EINVAL;
    if (n == 0) return PRISM_OK;
    return launch(st, out, table, dt, n_table, ids, n, dim);
}
