/* gpu_model: random-weight Llama- and CLIP-shaped models driven through prism_backend_i, for the
 * GPU check and benchmark on machines that cannot load checkpoints (no jansson there). The
 * forward passes follow common/model/llm.c and vision.c op for op (fused qkv and gate|up
 * weights, paged KV, the same norms / RoPE / attention calls), so their timings are the model
 * code's timings. Weights come from a seeded generator: on the host (identical on CPU and CUDA,
 * for checks) or on the device (fast, for the 8B benchmark). */
#ifndef PRISM_GPU_MODEL_H
#define PRISM_GPU_MODEL_H

#include "backend/backend.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
    int hidden, n_layers, n_heads, n_kv, head_dim, inter, vocab;
    float eps, theta;
} gm_llm_cfg_t;

typedef struct {
    int image, patch, hidden, n_layers, heads, inter, proj;   /* proj: text hidden of the projector */
    float eps;
} gm_vit_cfg_t;

typedef struct gm_llm gm_llm_t;
typedef struct gm_vit gm_vit_t;

/* device_init: weights filled on the device (CUDA only); else host-generated and uploaded. */
int  gm_llm_create(prism_backend_t *be, const gm_llm_cfg_t *c, uint64_t seed, bool device_init, int max_tokens,
                   int max_seqs, int n_blocks, int block_size, gm_llm_t **out);
void gm_llm_free(gm_llm_t *m);
size_t gm_llm_weight_bytes(const gm_llm_t *m);
size_t gm_llm_kv_bytes_per_token(const gm_llm_t *m);
/* One forward: S sequences, each q_len[s] new tokens at positions pos0[s]..; every sequence s
 * owns blocks [s*blocks_per_seq, (s+1)*blocks_per_seq). logits_host (may be NULL: logits stay on
 * the device, the call still waits for completion) gets the last token's [S][vocab];
 * argmax_host (may be NULL) the greedy token per sequence. */
int  gm_llm_forward(gm_llm_t *m, int S, const int32_t *tokens, const int32_t *q_len, const int32_t *pos0,
                    int blocks_per_seq, float *logits_host, int32_t *argmax_host);

int  gm_vit_create(prism_backend_t *be, const gm_vit_cfg_t *c, uint64_t seed, bool device_init, int max_images,
                   gm_vit_t **out);
void gm_vit_free(gm_vit_t *v);
size_t gm_vit_weight_bytes(const gm_vit_t *v);
/* pixels host [n][3][image][image]; out host [n][patches][proj] or NULL (stays on the device). */
int  gm_vit_encode(gm_vit_t *v, const float *pixels, int n, float *out);

/* tools/gpu/gpu_fill.cu */
int gm_device_fill(prism_backend_t *be, void *dst, prism_dtype_t dt, size_t n, float scale, float offset,
                   uint64_t seed);

#ifdef __cplusplus
}
#endif

#endif
