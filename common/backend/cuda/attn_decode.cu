/* Paged decode attention (one new query per sequence, any context length): split-K. Each block
 * takes one key range of one (sequence, kv head group); partial (o, max, sum) triples go to
 * scratch carved at create, and a combine kernel merges them. Splits are chosen so the grid
 * fills the GPU even at batch 1 (a 4k context at batch 1 is otherwise 8 blocks on 132 SMs).
 * Falls back to one split (direct output) when the scratch is too small. */
#include "backend/cuda/attn_tile.cuh"

#define MIN_KEYS_PER_SPLIT 256
#define MAX_SPLITS 64

static __global__ void __launch_bounds__(ATT_THREADS)
attn_decode_kernel(float *out, int ldo, float *part, const float *q, int ldq, const float *kc, const float *vc,
                   prism_attn_meta_t meta, int n_heads, int n_kv, int hd, float scale, int n_qt, int Gc, int tpb,
                   int n_hg, int keys_per_split)
{
    __shared__ attn_rows_t R;
    int s = blockIdx.x / n_qt, qt = blockIdx.x % n_qt;
    int kvh = blockIdx.y / n_hg, hg = blockIdx.y % n_hg;
    int split = blockIdx.z, n_split = gridDim.z;
    int q0 = meta.seq_start[s], q_len = meta.seq_start[s + 1] - q0, pos0 = meta.pos0[s];
    if (qt * tpb >= q_len) return;
    if (threadIdx.x < ATT_ROWS)
        attn_fill_row(R, threadIdx.x, Gc, tpb, n_heads / n_kv, hg, kvh, qt, q_len, q0, pos0, true, 0,
                      meta.chunk);
    __syncthreads();
    attn_paged_kv kv = {kc, vc, meta.block_tables + (size_t)s * meta.max_blocks_per_seq, meta.block_size, n_kv * hd,
                        kvh * hd};
    attn_out_t dst = {out, ldo, n_split > 1 ? part : NULL, n_heads, n_split, split};
    int k_begin = split * keys_per_split;
    attn_rows(kv, R, hd, scale, q, ldq, k_begin, k_begin + keys_per_split, dst);
}

/* One warp per (token, head): merges the n_split partials with the usual max-rescaling. */
static __global__ void attn_decode_combine_kernel(float *out, int ldo, const float *part, int n_tokens, int n_heads,
                                                  int hd, int n_split)
{
    int w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (w >= n_tokens * n_heads) return;
    int t = w / n_heads, h = w % n_heads;
    const float *p = part + (size_t)w * n_split * (hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < n_split; s++) {
        const float *ps = p + (size_t)s * (hd + 2);
        if (ps[hd + 1] > 0.0f) M = fmaxf(M, ps[hd]);
    }
    float L = 0.0f;
    for (int s = 0; s < n_split; s++) {
        const float *ps = p + (size_t)s * (hd + 2);
        if (ps[hd + 1] > 0.0f) L += ps[hd + 1] * expf(ps[hd] - M);
    }
    float inv = L > 0.0f ? 1.0f / L : 0.0f;
    float *orow = out + (size_t)t * ldo + (size_t)h * hd;
    for (int d = lane; d < hd; d += 32) {
        float acc = 0.0f;
        for (int s = 0; s < n_split; s++) {
            const float *ps = p + (size_t)s * (hd + 2);
            if (ps[hd + 1] > 0.0f) acc += ps[d] * expf(ps[hd] - M);
        }
        orow[d] = acc * inv;
    }
}

static int launch(cudaStream_t st, float *out, int ldo, const float *q, int ldq, const float *kc, const float *vc,
                  const prism_attn_meta_t *meta, int n_heads, int n_kv, int hd, float scale, float *part,
                  size_t part_floats, int n_sm)
{
    int Gc, tpb, n_hg;
    attn_grouping(n_heads, n_kv, &Gc, &tpb, &n_hg);
    int n_qt = (meta->max_q_len + tpb - 1) / tpb;
    long base = (long)meta->n_seqs * n_qt * n_kv * n_hg;
    long want = ((long)2 * n_sm + base - 1) / base;
    long by_len = (meta->max_ctx_len + MIN_KEYS_PER_SPLIT - 1) / MIN_KEYS_PER_SPLIT;
    size_t per_split = (size_t)meta->n_tokens * n_heads * (size_t)(hd + 2);
    long by_mem = part ? (long)(part_floats / (per_split ? per_split : 1)) : 1;
    long n_split = want < by_len ? want : by_len;
    if (n_split > by_mem) n_split = by_mem;
    if (n_split > MAX_SPLITS) n_split = MAX_SPLITS;
    if (n_split < 1) n_split = 1;
    int kps = (int)((meta->max_ctx_len + n_split - 1) / n_split);
    kps = (kps + ATT_BK - 1) / ATT_BK * ATT_BK;
    n_split = (meta->max_ctx_len + kps - 1) / kps;
    if (n_split < 1) n_split = 1;
    dim3 grid((unsigned)((long)meta->n_seqs * n_qt), (unsigned)(n_kv * n_hg), (unsigned)n_split);
    attn_decode_kernel<<<grid, ATT_THREADS, attn_smem_bytes(hd), st>>>(out, ldo, part, q, ldq, kc, vc, *meta, n_heads,
                                                                      n_kv, hd, scale, n_qt, Gc, tpb, n_hg,
                                                                      n_split > 1 ? kps : (1 << 30));
    int rc = PRISM_CUDA_LAUNCHED("attn_decode");
    if (rc != PRISM_OK || n_split == 1) return rc;
    long warps = (long)meta->n_tokens * n_heads;
    attn_decode_combine_kernel<<<(unsigned)((warps * 32 + 255) / 256), 256, 0, st>>>(out, ldo, part, meta->n_tokens,
                                                                                     n_heads, hd, (int)n_split);
    return PRISM_CUDA_LAUNCHED("attn_decode_combine");
}

extern "C" int prism_cuda_attn_decode_init(void)
{
    return PRISM_CUDA_TRY(cudaFuncSetAttribute(attn_decode_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)attn_smem_bytes(PRISM_CUDA_MAX_HEAD_DIM)));
}

extern "C" int prism_cuda_attn_decode(cudaStream_t st, float *out, int ldo, const float *q, int ldq,
                                      const float *k_cache, const float *v_cache, const prism_attn_meta_t *meta,
                                      int n_heads, int n_kv_heads, int head_dim, float scale, float *part,
                                      size_t part_floats, int n_sm)
{
    if (!meta || n_kv_heads <= 0 || n_heads % n_kv_heads || head_dim <= 0 || head_dim > PRISM_CUDA_MAX_HEAD_DIM ||
        meta->block_size <= 0 || meta->n_seqs <= 0 || meta->max_q_len <= 0 || meta->max_blocks_per_seq <= 0 ||
        meta->chunk < 0 ||
        meta->max_ctx_len <= 0 || meta->n_tokens < 0 ||
        (long)ldq < (long)n_heads * head_dim || (long)ldo < (long)n_heads * head_dim ||
        (long)meta->n_seqs * meta->max_q_len > (1L << 30))
        return PRISM_EINVAL;
    if (meta->n_tokens == 0) return PRISM_OK;
    return launch(st, out, ldo, q, ldq, k_cache, v_cache, meta, n_heads, n_kv_heads, head_dim, scale, part,
                  part_floats, n_sm > 0 ? n_sm : 132);
}
