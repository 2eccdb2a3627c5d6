/* Attention over contiguous q/k/v (ViT tiles: bidirectional; causal optional), n_seqs
 * sequences of seq_len tokens, GQA allowed. Grid: x = sequence x query tile, y = kv head x head
 * group. Memory is O(tile) whatever the image size: no [seq x seq] score matrix anywhere. */
#include "backend/cuda/attn_tile.cuh"

static __global__ void __launch_bounds__(ATT_THREADS)
attn_dense_kernel(float *out, int ldo, const float *q, int ldq, const float *k, int ldk, const float *v, int ldv,
                  int seq_len, int n_heads, int n_kv, int hd, float scale, int causal, int n_qt, int Gc, int tpb,
                  int n_hg)
{
    __shared__ attn_rows_t R;
    int s = blockIdx.x / n_qt, qt = blockIdx.x % n_qt;
    int kvh = blockIdx.y / n_hg, hg = blockIdx.y % n_hg;
    if (threadIdx.x < ATT_ROWS)
        attn_fill_row(R, threadIdx.x, Gc, tpb, n_heads / n_kv, hg, kvh, qt, seq_len, s * seq_len, 0, causal != 0,
                      seq_len);
    __syncthreads();
    size_t base = (size_t)s * seq_len;
    attn_dense_kv kv = {k + base * ldk + (size_t)kvh * hd, v + base * ldv + (size_t)kvh * hd, ldk, ldv};
    attn_out_t dst = {out, ldo, NULL, n_heads, 1, 0};
    attn_rows(kv, R, hd, scale, q, ldq, 0, seq_len, dst);
}

static int launch(cudaStream_t st, float *out, int ldo, const float *q, int ldq, const float *k, int ldk,
                  const float *v, int ldv, int n_seqs, int seq_len, int n_heads, int n_kv, int hd, float scale,
                  bool causal)
{
    int Gc, tpb, n_hg;
    attn_grouping(n_heads, n_kv, &Gc, &tpb, &n_hg);
    int n_qt = (seq_len + tpb - 1) / tpb;
    dim3 grid((unsigned)((long)n_seqs * n_qt), (unsigned)(n_kv * n_hg));
    attn_dense_kernel<<<grid, ATT_THREADS, attn_smem_bytes(hd), st>>>(out, ldo, q, ldq, k, ldk, v, ldv, seq_len,
                                                                     n_heads, n_kv, hd, scale, causal, n_qt, Gc, tpb,
                                                                     n_hg);
    return PRISM_CUDA_LAUNCHED("attn_dense");
}

extern "C" int prism_cuda_attn_dense_init(void)
{
    return PRISM_CUDA_TRY(cudaFuncSetAttribute(attn_dense_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)attn_smem_bytes(PRISM_CUDA_MAX_HEAD_DIM)));
}

extern "C" int prism_cuda_attn_dense(cudaStream_t st, float *out, int ldo, const float *q, int ldq, const float *k,
                                     int ldk, const float *v, int ldv, int n_seqs, int seq_len, int n_heads,
                                     int n_kv_heads, int head_dim, float scale, bool causal)
{
    if (n_kv_heads <= 0 || n_heads % n_kv_heads || head_dim <= 0 || head_dim > PRISM_CUDA_MAX_HEAD_DIM ||
        n_seqs < 0 || seq_len <= 0 || (long)ldq < (long)n_heads * head_dim || (long)ldo < (long)n_heads * head_dim ||
        (long)ldk < (long)n_kv_heads * head_dim || (long)ldv < (long)n_kv_heads * head_dim ||
        (long)n_seqs * seq_len > (1L << 30))
        return PRISM_EINVAL;
    if (n_seqs == 0) return PRISM_OK;
    return launch(st, out, ldo, q, ldq, k, ldk, v, ldv, n_seqs, seq_len, n_heads, n_kv_heads, head_dim, scale, causal);
}
