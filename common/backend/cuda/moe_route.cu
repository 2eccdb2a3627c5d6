/* MoE routing in one block, no host round trip: (1) every thread takes tokens, picks the top_k
 * experts by repeated max (equal logits: lower expert) and counts them in shared memory; (2) a
 * prefix sum gives the group offsets; (3) one thread per expert scans the choices in token order
 * and places its rows, so the grouping is deterministic and stable. Scores are sigmoid(logit). */
#include "backend/cuda/cuda_common.cuh"

#define THREADS 1024
#define MAX_EXPERTS 1024

static __global__ void moe_route_kernel(const float *logits, int n_tokens, int n_experts, int top_k, int32_t *choice,
                                        int32_t *order, float *weight, int32_t *offsets, int32_t *slot)
{
    __shared__ int32_t cnt[MAX_EXPERTS + 1];
    for (int e = threadIdx.x; e <= n_experts; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int t = threadIdx.x; t < n_tokens; t += blockDim.x) {
        const float *l = logits + (size_t)t * n_experts;
        int32_t *ch = choice + (size_t)t * top_k;
        for (int i = 0; i < top_k; i++) {
            int best = -1;
            for (int e = 0; e < n_experts; e++) {
                bool taken = false;
                for (int j = 0; j < i; j++) taken = taken || ch[j] == e;
                if (!taken && (best < 0 || l[e] > l[best])) best = e;
            }
            ch[i] = best;
            atomicAdd(&cnt[best + 1], 1);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int e = 0; e < n_experts; e++) cnt[e + 1] += cnt[e];
    __syncthreads();
    for (int e = threadIdx.x; e <= n_experts; e += blockDim.x) offsets[e] = cnt[e];
    int R = n_tokens * top_k;
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
        int cur = cnt[e];
        for (int r = 0; r < R; r++) {
            if (choice[r] != e) continue;
            int t = r / top_k;
            order[cur] = t;
            weight[cur] = 1.0f / (1.0f + expf(-logits[(size_t)t * n_experts + e]));
            slot[r] = cur++;
        }
    }
}

static int launch(cudaStream_t st, const float *logits, int n_tokens, int n_experts, int top_k, int32_t *choice,
                  int32_t *order, float *weight, int32_t *offsets, int32_t *slot)
{
    moe_route_kernel<<<1, THREADS, 0, st>>>(logits, n_tokens, n_experts, top_k, choice, order, weight, offsets, slot);
    return PRISM_CUDA_LAUNCHED("moe_route");
}

extern "C" int prism_cuda_moe_route(cudaStream_t st, const float *logits, int n_tokens, int n_experts, int top_k,
                                    int32_t *choice, int32_t *order, float *weight, int32_t *offsets, int32_t *slot)
{
    if (!logits || !choice || !order || !weight || !offsets || !slot || n_tokens < 0 || n_experts <= 0 ||
        n_experts > MAX_EXPERTS || top_k <= 0 || top_k > n_experts || top_k > PRISM_MOE_MAX_TOPK ||
        (long)n_tokens * top_k > PRISM_CUDA_MAX_ROWS)
        return PRISM_EINVAL;
    return launch(st, logits, n_tokens, n_experts, top_k, choice, order, weight, offsets, slot);
}
