/* The blockwise online-softmax attention core shared by attn_paged.cu, attn_decode.cu and
 * attn_dense.cu (header-only device code; each op file has its own kernel around it).
 *
 * A block of 8 warps owns up to 32 query "rows" — (token, q head) pairs that share one kv
 * head — and a key range. It walks the keys in tiles of 32: the tile's K (transposed, padded to
 * avoid bank conflicts) and V are staged in shared memory once for all 32 rows, each warp keeps
 * 4 rows' running max / sum / output in registers (lane = key for scores, lane = dims
 * lane, lane+32, ... for the output). Scores never leave registers: memory is O(tile), never
 * a [queries x keys] matrix. fp32 throughout. With GQA the rows of a block are several q heads
 * of the same kv head, so each K/V tile is read once per group instead of once per head.
 *
 * Shared memory: Qs [32][hd] (pre-scaled) + Kt [hd][33] + Vs [32][hd] floats, i.e.
 * 388*hd bytes (49.7 KB at hd 128), so the kernels raise their dynamic limit once at create. */
#ifndef PRISM_BACKEND_CUDA_ATTN_TILE_CUH
#define PRISM_BACKEND_CUDA_ATTN_TILE_CUH

#include "backend/cuda/cuda_common.cuh"

#include <limits.h>

#define ATT_WARPS   8
#define ATT_THREADS (ATT_WARPS * 32)
#define ATT_RPW     4                        /* rows per warp */
#define ATT_ROWS    (ATT_WARPS * ATT_RPW)    /* rows per block */
#define ATT_BK      32                       /* keys per tile (= warp width) */
#define ATT_DPL     (PRISM_CUDA_MAX_HEAD_DIM / 32)  /* output dims per lane */
static_assert(ATT_ROWS == 32 && ATT_BK == 32, "row bookkeeping and key tiles are one warp wide");

static inline size_t attn_smem_bytes(int hd)
{
    return (size_t)hd * (ATT_ROWS + (ATT_BK + 1) + ATT_BK) * sizeof(float);
}

/* Row bookkeeping a kernel fills (threads 0..31) before calling attn_rows. */
struct attn_rows_t {
    int tok[ATT_ROWS];    /* q/out row index, -1 = unused row */
    int head[ATT_ROWS];   /* q head */
    int lim[ATT_ROWS];    /* keys [lo, lim) are visible to this row (causal limit or seq_len) */
    int lo[ATT_ROWS];     /* first visible key: 0, or the start of the row's chunk (chunked attention) */
};

/* Paged cache: key j of the sequence lives in block table[j / bs] at offset j % bs. */
struct attn_paged_kv {
    const float *kc, *vc;
    const int32_t *table;
    int bs, row, off;     /* row = n_kv*hd floats per cached token; off = kvh*hd */
    __device__ __forceinline__ size_t at(int j) const
    {
        return ((size_t)table[j / bs] * bs + (size_t)(j % bs)) * row + off;
    }
    __device__ __forceinline__ const float *k(int j) const { return kc + at(j); }
    __device__ __forceinline__ const float *v(int j) const { return vc + at(j); }
};

/* Contiguous K/V rows of one sequence (ViT tiles). */
struct attn_dense_kv {
    const float *kb, *vb;   /* already offset to the sequence and kv head */
    int ldk, ldv;
    __device__ __forceinline__ const float *k(int j) const { return kb + (size_t)j * ldk; }
    __device__ __forceinline__ const float *v(int j) const { return vb + (size_t)j * ldv; }
};

/* Where a block's result goes: final rows (part == NULL) or split-K partials
 * part[((tok * n_heads + head) * n_split + split)] = {o[hd], m, l}. */
struct attn_out_t {
    float *out;
    int ldo;
    float *part;
    int n_heads, n_split, split;
};

template <class KV>
__device__ void attn_rows(const KV &kv, const attn_rows_t &R, int hd, float scale, const float *q, int ldq,
                          int k_begin, int k_end, const attn_out_t &dst)
{
    extern __shared__ float4 attn_smem4[];
    float *Qs = (float *)attn_smem4;
    float *Kt = Qs + ATT_ROWS * hd;
    float *Vs = Kt + hd * (ATT_BK + 1);
    __shared__ int s_khi, s_klo;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    /* Stage the block's queries, pre-scaled, and find the last key any row needs. */
    for (int idx = tid; idx < ATT_ROWS * hd; idx += ATT_THREADS) {
        int r = idx / hd, d = idx % hd, t = R.tok[r];
        Qs[idx] = t >= 0 ? q[(size_t)t * ldq + (size_t)R.head[r] * hd + d] * scale : 0.0f;
    }
    if (warp == 0) {
        int m = R.lim[lane], lo = R.tok[lane] >= 0 ? R.lo[lane] : INT_MAX;
        for (int o = 16; o > 0; o >>= 1) {
            m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
            lo = min(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        }
        if (lane == 0) {
            s_khi = min(m, k_end);
            s_klo = max(lo == INT_MAX ? 0 : lo, k_begin);   /* tiles before every row's chunk are skipped */
        }
    }
    __syncthreads();
    const int k_hi = s_khi, k_lo = s_klo;

    float m_run[ATT_RPW], l_run[ATT_RPW], o[ATT_RPW][ATT_DPL];
    int lim[ATT_RPW], lo[ATT_RPW];
    bool any = false;
#pragma unroll
    for (int i = 0; i < ATT_RPW; i++) {
        m_run[i] = -INFINITY;
        l_run[i] = 0.0f;
        lim[i] = min(R.lim[warp * ATT_RPW + i], k_hi);
        lo[i] = max(R.lo[warp * ATT_RPW + i], k_lo);
        any = any || (R.tok[warp * ATT_RPW + i] >= 0 && lim[i] > lo[i]);
#pragma unroll
        for (int e = 0; e < ATT_DPL; e++) o[i][e] = 0.0f;
    }
    const bool vec4 = (hd & 3) == 0;

    for (int j0 = k_lo; j0 < k_hi; j0 += ATT_BK) {
        __syncthreads();   /* previous tile fully consumed */
        for (int jj = warp; jj < ATT_BK; jj += ATT_WARPS) {
            int j = j0 + jj;
            if (j < k_hi) {
                const float *kr = kv.k(j), *vr = kv.v(j);
                for (int d = lane; d < hd; d += 32) {
                    Kt[d * (ATT_BK + 1) + jj] = kr[d];
                    Vs[jj * hd + d] = vr[d];
                }
            } else {
                for (int d = lane; d < hd; d += 32) {
                    Kt[d * (ATT_BK + 1) + jj] = 0.0f;
                    Vs[jj * hd + d] = 0.0f;
                }
            }
        }
        __syncthreads();
        if (!any) continue;

        /* scores: lane = key j0 + lane, four rows at once */
        float s[ATT_RPW];
#pragma unroll
        for (int i = 0; i < ATT_RPW; i++) s[i] = 0.0f;
        const float *q0 = Qs + (warp * ATT_RPW) * hd;
        if (vec4) {
            for (int d = 0; d < hd; d += 4) {
                float k0 = Kt[(d + 0) * (ATT_BK + 1) + lane], k1 = Kt[(d + 1) * (ATT_BK + 1) + lane];
                float k2 = Kt[(d + 2) * (ATT_BK + 1) + lane], k3 = Kt[(d + 3) * (ATT_BK + 1) + lane];
#pragma unroll
                for (int i = 0; i < ATT_RPW; i++) {
                    float4 qv = *(const float4 *)(q0 + i * hd + d);
                    s[i] += qv.x * k0 + qv.y * k1 + qv.z * k2 + qv.w * k3;
                }
            }
        } else {
            for (int d = 0; d < hd; d++) {
                float kd = Kt[d * (ATT_BK + 1) + lane];
#pragma unroll
                for (int i = 0; i < ATT_RPW; i++) s[i] += q0[i * hd + d] * kd;
            }
        }

        /* online softmax per row */
        float p[ATT_RPW];
        const int j = j0 + lane;
#pragma unroll
        for (int i = 0; i < ATT_RPW; i++) {
            float si = j < lim[i] && j >= lo[i] ? s[i] : -INFINITY;
            float mx = prism_warp_max(si);
            if (mx == -INFINITY) {   /* row sees none of this tile (warp-uniform) */
                p[i] = 0.0f;
                continue;
            }
            float m_new = fmaxf(m_run[i], mx);
            float corr = m_run[i] == -INFINITY ? 0.0f : expf(m_run[i] - m_new);
            p[i] = si == -INFINITY ? 0.0f : expf(si - m_new);
            l_run[i] = l_run[i] * corr + prism_warp_sum(p[i]);
            m_run[i] = m_new;
#pragma unroll
            for (int e = 0; e < ATT_DPL; e++) o[i][e] *= corr;
        }

        /* o += p · V over the tile */
        const int n_valid = min(ATT_BK, k_hi - j0);
        for (int jj = 0; jj < n_valid; jj++) {
            float pj[ATT_RPW];
#pragma unroll
            for (int i = 0; i < ATT_RPW; i++) pj[i] = __shfl_sync(0xffffffffu, p[i], jj);
            const float *vr = Vs + jj * hd;
#pragma unroll
            for (int e = 0; e < ATT_DPL; e++) {
                int d = lane + 32 * e;
                if (d < hd) {
                    float vd = vr[d];
#pragma unroll
                    for (int i = 0; i < ATT_RPW; i++) o[i][e] += pj[i] * vd;
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < ATT_RPW; i++) {
        int r = warp * ATT_RPW + i, t = R.tok[r];
        if (t < 0) continue;
        if (!dst.part) {
            float inv = l_run[i] > 0.0f ? 1.0f / l_run[i] : 0.0f;
            float *orow = dst.out + (size_t)t * dst.ldo + (size_t)R.head[r] * hd;
#pragma unroll
            for (int e = 0; e < ATT_DPL; e++) {
                int d = lane + 32 * e;
                if (d < hd) orow[d] = o[i][e] * inv;
            }
        } else {
            size_t pi = ((size_t)t * dst.n_heads + R.head[r]) * dst.n_split + dst.split;
            float *prow = dst.part + pi * (size_t)(hd + 2);
#pragma unroll
            for (int e = 0; e < ATT_DPL; e++) {
                int d = lane + 32 * e;
                if (d < hd) prow[d] = o[i][e];
            }
            if (lane == 0) {
                prow[hd] = m_run[i];
                prow[hd + 1] = l_run[i];
            }
        }
    }
}

/* Host: rows of a block for a kv group of G q heads: Gc heads per block, tpb tokens per block. */
static inline void attn_grouping(int n_heads, int n_kv, int *Gc, int *tpb, int *n_hg)
{
    int G = n_heads / n_kv;
    *Gc = G < ATT_ROWS ? G : ATT_ROWS;
    *tpb = ATT_ROWS / *Gc;
    *n_hg = (G + *Gc - 1) / *Gc;
}

/* Device: fills row r (< 32) of a block from (token index within the sequence, head slot).
 * chunk > 0 (causal only): the row sees only keys of its own chunk of positions. */
__device__ __forceinline__ void attn_fill_row(attn_rows_t &R, int r, int Gc, int tpb, int G, int hg, int kvh,
                                              int qt, int q_len, int tok_base, int lim_base, bool causal,
                                              int full_len, int chunk = 0)
{
    int tl = r / Gc, hl = r % Gc;
    int token = qt * tpb + tl, gh = hg * Gc + hl;
    bool ok = tl < tpb && token < q_len && gh < G;
    R.tok[r] = ok ? tok_base + token : -1;
    R.head[r] = kvh * G + (ok ? gh : 0);
    R.lim[r] = ok ? (causal ? lim_base + token + 1 : full_len) : 0;
    R.lo[r] = ok && causal && chunk > 0 ? (lim_base + token) / chunk * chunk : 0;
}

#endif
