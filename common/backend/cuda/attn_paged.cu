/* Causal attention of each sequence's new queries over its paged KV cache (prefill chunks and
 * decode steps mixed in one call), GQA by grouping the q heads of a kv head into one block.
 * Grid: x = sequence x query tile, y = kv head x head group. See attn_tile.cuh. */
#include "backend/cuda/attn_tile.cuh"

static __global__ void __launch_bounds__(ATT_THREADS)
attn_paged_kernel(float *out, int ldo, const float *q, int ldq, const float *kc, const float *vc,
                  prism_attn_meta_t meta, int n_heads, int n_kv, int hd, float scale, int n_qt, int Gc, int tpb, int n_hg)
{
    __shared__ attn_rows_t R;
    int s = blockIdx.x / n_qt, qt = blockIdx.x % n_qt;
    int kvh = blockIdx.y / n_hg, hg = blockIdx.y % n_hg;
    int q0 = meta.seq_start[s], q_len = meta.seq_start[s + 1] - q0, pos0 = meta.pos0[s];
    if (qt * tpb >= q_len) return;   /* uniform over the block */
    if (threadIdx.x < ATT_ROWS)
        attn_fill_row(R, threadIdx.x, Gc, tpb, n_heads / n_kv, hg, kvh, qt, q_len, q0, pos0, true, 0,
                      meta.chunk);
    __syncthreads();
    attn_paged_kv kv = {kc, vc, meta.block_tables + (size_t)s * meta.max_blocks_per_seq, meta.block_size, n_kv * hd,
                        kvh * hd};
    attn_out_t dst = {out, ldo, NULL, n_heads, 1, 0};
    attn_rows(kv, R, hd, scale, q, ldq, 0, 1 << 30, dst);
}

static int launch(cudaStream_t st, float *out, int ldo, const float *q, int ldq, const float *kc, const float *vc,
                  const prism_attn_meta_t *meta, int n_heads, int n_kv, int hd, float scale)
{
    int Gc, tpb, n_hg;
    attn_grouping(n_heads, n_kv, &Gc, &tpb, &n_hg);
    int n_qt = (meta->max_q_len + tpb - 1) / tpb;
    dim3 grid((unsigned)((long)meta->n_seqs * n_qt), (unsigned)(n_kv * n_hg));
    attn_paged_kernel<<<grid, ATT_THREADS, attn_smem_bytes(hd), st>>>(out, ldo, q, ldq, kc, vc, *meta, n_heads, n_kv,
                                                                     hd, scale, n_qt, Gc, tpb, n_hg);
    return PRISM_CUDA_LAUNCHED("attn_paged");
}

extern "C" int prism_cuda_attn_paged_init(void)
{
    return PRISM_CUDA_TRY(cudaFuncSetAttribute(attn_paged_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)attn_smem_bytes(PRISM_CUDA_MAX_HEAD_DIM)));
}

extern "C" int prism_cuda_attn_paged(cudaStream_t st, float *out, int ldo, const float *q, int ldq,
                                     const float *k_cache, const float *v_cache, const prism_attn_meta_t *meta,
                                     int n_heads, int n_kv_heads, int head_dim, float scale)
{
    if (!meta || n_kv_heads <= 0 || n_heads % n_kv_heads || head_dim <= 0 || head_dim > PRISM_CUDA_MAX_HEAD_DIM ||
        meta->block_size <= 0 || meta->n_seqs <= 0 || meta->max_q_len <= 0 || meta->max_blocks_per_seq <= 0 ||
        meta->chunk < 0 ||
        (long)ldq < (long)n_heads * head_dim || (long)ldo < (long)n_heads * head_dim ||
        (long)meta->n_seqs * meta->max_q_len > (1L << 30))
        return PRISM_EINVAL;
    if (meta->n_tokens == 0) return PRISM_OK;
    return launch(st, out, ldo, q, ldq, k_cache, v_cache, meta, n_heads, n_kv_heads, head_dim, scale);
}
