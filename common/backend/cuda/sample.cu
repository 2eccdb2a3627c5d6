/* Sampling on the GPU: temperature, top-k, top-p, seeded inverse-CDF; one block per row.
 *
 * The CPU reference (common/sample) sorts candidates by (probability desc, id asc), keeps the
 * top k, then the smallest prefix whose mass reaches top_p of theirs, then walks the prefix
 * until the cumulative mass passes u * total. Each of those steps is "find the element where a
 * running sum over that order first reaches a target", which a radix descent answers without
 * sorting or scratch memory: every element gets a distinct 64-bit key
 *     C = (bits of p) << 32 | (0xffffffff - id)        (p >= 0, so the bits order like p)
 * whose descending order is exactly the CPU's order, and 8 passes of a 256-bin histogram over
 * the key bytes locate the element. Masses are fixed point (p * 2^32 as integers), so sums are
 * exact and order-independent: the same uniform always gives the same token, whatever the
 * scheduling. Elements with p < 2^-32 of the top one get mass 0 and are never drawn. */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 1024

struct samp_ctx {
    const float *l;
    int vocab;
    float mx, inv_t;
};

__device__ __forceinline__ float samp_p(const samp_ctx &c, int i) { return expf((c.l[i] - c.mx) * c.inv_t); }
__device__ __forceinline__ uint64_t samp_key(float p, int i)
{
    return ((uint64_t)__float_as_uint(p) << 32) | (uint64_t)(0xffffffffu - (uint32_t)i);
}
__device__ __forceinline__ uint64_t samp_mass(float p) { return (uint64_t)__float2ull_rz(p * 4294967296.0f); }

__device__ uint64_t block_sum_u64(uint64_t v, uint64_t *sh)
{
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (threadIdx.x == 0) sh[0] = 0;
    __syncthreads();
    if ((threadIdx.x & 31) == 0) atomicAdd((unsigned long long *)sh, (unsigned long long)v);
    __syncthreads();
    uint64_t r = sh[0];
    __syncthreads();   /* sh is reused by the caller's next histogram */
    return r;
}

/* Sum of weights over candidates C >= cut. */
__device__ uint64_t samp_total(const samp_ctx &c, uint64_t cut, bool mass, uint64_t *sh)
{
    uint64_t acc = 0;
    for (int i = threadIdx.x; i < c.vocab; i += blockDim.x) {
        float p = samp_p(c, i);
        if (samp_key(p, i) >= cut) acc += mass ? samp_mass(p) : 1;
    }
    return block_sum_u64(acc, sh);
}

/* Key of the element at which the running weight, over candidates C >= cut in descending C,
 * first reaches target (>= 1). */
__device__ uint64_t samp_select(const samp_ctx &c, uint64_t cut, uint64_t target, bool mass, uint64_t *hist,
                                uint64_t *bc)
{
    uint64_t prefix = 0, pmask = 0;
    for (int b = 7; b >= 0; b--) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) hist[i] = 0;
        __syncthreads();
        /* Strided elements of one thread mostly share the high bytes: accumulate runs locally
         * so the shared atomics stay few even when every element lands in one bin. */
        int run_bin = -1;
        uint64_t run = 0;
        for (int i = threadIdx.x; i < c.vocab; i += blockDim.x) {
            float p = samp_p(c, i);
            uint64_t C = samp_key(p, i);
            if (C < cut || (C & pmask) != prefix) continue;
            int bin = (int)((C >> (8 * b)) & 255);
            if (bin != run_bin) {
                if (run_bin >= 0 && run) atomicAdd((unsigned long long *)&hist[run_bin], (unsigned long long)run);
                run_bin = bin;
                run = 0;
            }
            run += mass ? samp_mass(p) : 1;
        }
        if (run_bin >= 0 && run) atomicAdd((unsigned long long *)&hist[run_bin], (unsigned long long)run);
        __syncthreads();
        if (threadIdx.x == 0) {
            uint64_t cum = 0;
            int chosen = -1;
            for (int bin = 255; bin >= 0; bin--) {
                if (hist[bin] && cum + hist[bin] >= target) {
                    chosen = bin;
                    break;
                }
                cum += hist[bin];
            }
            if (chosen < 0) {   /* target beyond the total: clamp to the last candidate */
                for (chosen = 0; chosen < 255 && !hist[chosen]; chosen++) {}
                target = hist[chosen] ? hist[chosen] : 1;
            } else {
                target -= cum;
            }
            bc[0] = prefix | ((uint64_t)chosen << (8 * b));
            bc[1] = target;
        }
        __syncthreads();
        prefix = bc[0];
        target = bc[1];
        pmask |= (uint64_t)0xff << (8 * b);
        __syncthreads();
    }
    return prefix;
}

static __global__ void __launch_bounds__(THREADS)
sample_kernel(int32_t *out, const float *logits, int vocab, const prism_cuda_sample_row_t *rows)
{
    __shared__ uint64_t hist[256];
    __shared__ uint64_t bc[2];
    __shared__ float fsh[33];
    const prism_cuda_sample_row_t prm = rows[blockIdx.x];
    samp_ctx c;
    c.l = logits + (size_t)blockIdx.x * vocab;
    c.vocab = vocab;

    /* max (and its first index, for greedy rows) */
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, c.l[i]);
    mx = prism_warp_max(mx);
    if ((threadIdx.x & 31) == 0) fsh[threadIdx.x >> 5] = mx;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < (blockDim.x >> 5) ? fsh[threadIdx.x] : -INFINITY;
        v = prism_warp_max(v);
        if (threadIdx.x == 0) fsh[32] = v;
    }
    __syncthreads();
    c.mx = fsh[32];

    /* Below 1e-5 (and NaN) greedy, as the CPU sampler (PRISM_SAMPLE_MIN_TEMPERATURE): near 1e-38
     * 1/T overflows and every probability would be NaN. */
    bool greedy = !(prm.temperature >= 1e-5f) || prm.top_k == 1;
    c.inv_t = greedy ? 1.0f : 1.0f / prm.temperature;
    if (greedy) {
        /* first index holding the max: min over matching indices */
        __shared__ int first;
        if (threadIdx.x == 0) first = vocab;
        __syncthreads();
        int loc = vocab;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (c.l[i] == c.mx) { loc = i; break; }
        if (loc < vocab) atomicMin(&first, loc);
        __syncthreads();
        if (threadIdx.x == 0) out[blockIdx.x] = first < vocab ? first : 0;
        return;
    }

    uint64_t cut = 0;
    if (prm.top_k > 0 && prm.top_k < vocab) cut = samp_select(c, 0, (uint64_t)prm.top_k, false, hist, bc);
    if (prm.top_p > 0.0f && prm.top_p < 1.0f) {
        uint64_t total = samp_total(c, cut, true, hist);
        uint64_t limit = (uint64_t)ceil((double)prm.top_p * (double)total);
        if (limit < 1) limit = 1;
        cut = samp_select(c, cut, limit, true, hist, bc);
    }
    uint64_t total = samp_total(c, cut, true, hist);
    uint64_t r = (uint64_t)(prm.uniform * (double)total);
    if (r >= total) r = total ? total - 1 : 0;
    uint64_t key = samp_select(c, cut, r + 1, true, hist, bc);
    if (threadIdx.x == 0) out[blockIdx.x] = (int32_t)(0xffffffffu - (uint32_t)(key & 0xffffffffu));
}

static int launch(cudaStream_t st, int32_t *out, const float *logits, int n_rows, int vocab,
                  const prism_cuda_sample_row_t *rows)
{
    sample_kernel<<<n_rows, THREADS, 0, st>>>(out, logits, vocab, rows);
    return PRISM_CUDA_LAUNCHED("sample");
}

extern "C" int prism_cuda_sample_k(cudaStream_t st, int32_t *out, const float *logits, int n_rows, int vocab,
                                   const prism_cuda_sample_row_t *rows)
{
    if (vocab <= 0 || n_rows < 0 || n_rows > PRISM_CUDA_MAX_SAMPLE_ROWS) return PRISM_EINVAL;
    if (n_rows == 0) return PRISM_OK;
    return launch(st, out, logits, n_rows, vocab, rows);
}
