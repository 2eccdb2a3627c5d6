/* Non-causal attention within each of n_seqs sequences of a flattened batch (backend.h,
 * attn_varlen): the windows of a Qwen2.5-VL window-attention layer, or the images of a full one.
 * Sequence s is rows [cu[s], cu[s+1]) (device int32). Grid: x = sequence x query tile (tiles of the
 * longest sequence, max_len; a block past its sequence's end returns at once), y = kv head x head
 * group. The core is attn_tile.cuh's blockwise online softmax: memory is O(tile) whatever the
 * sequence length, never a [seq x seq] score matrix, so a 65k-patch image's full-attention layer
 * runs in the same shared memory as a 64-patch window. */
#include "backend/cuda/attn_tile.cuh"

static __global__ void __launch_bounds__(ATT_THREADS)
attn_varlen_kernel(float *out, int ldo, const float *q, int ldq, const float *k, int ldk, const float *v, int ldv,
                   const int32_t *cu, int n_heads, int n_kv, int hd, float scale, int n_qt, int Gc, int tpb, int n_hg)
{
    __shared__ attn_rows_t R;
    int s = blockIdx.x / n_qt, qt = blockIdx.x % n_qt;
    int kvh = blockIdx.y / n_hg, hg = blockIdx.y % n_hg;
    int base = cu[s], len = cu[s + 1] - base;
    if (qt * tpb >= len) return;   /* block-uniform: before any barrier */
    if (threadIdx.x < ATT_ROWS)
        attn_fill_row(R, threadIdx.x, Gc, tpb, n_heads / n_kv, hg, kvh, qt, len, base, 0, false, len);
    __syncthreads();
    attn_dense_kv kv = {k + (size_t)base * ldk + (size_t)kvh * hd, v + (size_t)base * ldv + (size_t)kvh * hd, ldk, ldv};
    attn_out_t dst = {out, ldo, NULL, n_heads, 1, 0};
    attn_rows(kv, R, hd, scale, q, ldq, 0, len, dst);
}

static int launch(cudaStream_t st, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                  const float *v, int ldv, const int32_t *cu, int n_seqs, int max_len, int n_heads, int n_kv, int hd,
                  float scale)
{
    int Gc, tpb, n_hg;
    attn_grouping(n_heads, n_kv, &Gc, &tpb, &n_hg);
    int n_qt = (max_len + tpb - 1) / tpb;
    dim3 grid((unsigned)((long)n_seqs * n_qt), (unsigned)(n_kv * n_hg));
    attn_varlen_kernel<<<grid, ATT_THREADS, attn_smem_bytes(hd), st>>>(out, ldo, q, ldq, k, ldk, v, ldv, cu, n_heads,
                                                                      n_kv, hd, scale, n_qt, Gc, tpb, n_hg);
    return PRISM_CUDA_LAUNCHED("attn_varlen");
}

extern "C" int prism_cuda_attn_varlen_init(void)
{
    return PRISM_CUDA_TRY(cudaFuncSetAttribute(attn_varlen_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)attn_smem_bytes(PRISM_CUDA_MAX_HEAD_DIM)));
}

extern "C" int prism_cuda_attn_varlen(cudaStream_t st, float *out, int ldo, const float *q, int ldq, const float *k,
                                      int ldk, const float *v, int ldv, const int32_t *cu, int n_seqs, int max_len,
                                      int n_heads, int n_kv_heads, int head_dim, float scale)
{
    if (n_kv_heads <= 0 || n_heads % n_kv_heads || head_dim <= 0 || head_dim > PRISM_CUDA_MAX_HEAD_DIM ||
        n_seqs < 0 || max_len < 0 || !cu || (long)ldq < (long)n_heads * head_dim ||
        (long)ldo < (long)n_heads * head_dim || (long)ldk < (long)n_kv_heads * head_dim ||
        (long)ldv < (long)n_kv_heads * head_dim || (long)n_seqs * ((max_len + 31) / 32) > (1L << 30))
        return PRISM_EINVAL;
    if (n_seqs == 0 || max_len == 0) return PRISM_OK;
    return launch(st, out, ldo, q, ldq, k, ldk, v, ldv, cu, n_seqs, max_len, n_heads, n_kv_heads, head_dim, scale);
}
