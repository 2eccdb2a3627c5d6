/* gpu_kit: drives the product's own model code (prism_llm_*, prism_vision_*) with random weights
 * (the --random-weights path: no checkpoint, no JSON) for the GPU check and benchmark. Only what a
 * config.json would say is built here; loading, the forward passes and the weight values are
 * common/model's (values come from prism_random_normalish, so a CPU and a CUDA load of the same
 * shapes hold the same weights, CUDA's rounded to bf16). */
#ifndef PRISM_GPU_KIT_H
#define PRISM_GPU_KIT_H

#include "model/model.h"

/* A Llama-shaped text config (SiLU MLP, RMSNorm, no biases, untied head, max_pos 8192). */
prism_model_config_t kit_text_config(int hidden, int n_layers, int n_heads, int n_kv_heads, int head_dim,
                                     int intermediate, int vocab, float rms_eps, float rope_theta);
/* A LLaVA-1.5-shaped vision config on top of text: CLIP tower (quick_gelu, feature layer -2, CLS
 * dropped) and a GELU projector to text->hidden. */
prism_model_config_t kit_vision_config(const prism_model_config_t *text, int image_size, int patch, int v_hidden,
                                       int v_layers, int v_heads, int v_intermediate);

/* A language model plus a KV cache in which sequence s owns blocks [s*bps, (s+1)*bps). */
typedef struct {
    prism_model_config_t cfg;
    prism_llm_t *llm;
    prism_kv_cache_t *kv;
    int max_seqs, bps, block_size;
    int32_t *tables;              /* [max_seqs][bps] */
    const int32_t **rows;         /* [max_seqs] */
    int32_t *seq_start;           /* [max_seqs + 1] */
} kit_llm_t;

int  kit_llm_create(prism_backend_t *be, const prism_model_config_t *cfg, uint64_t seed, int max_tokens,
                    int max_seqs, int bps, int block_size, kit_llm_t **out);
void kit_llm_free(kit_llm_t *m);
/* One prism_llm_forward: S sequences, q_len[s] new tokens each at positions pos0[s].. ; logits
 * [S][vocab] of each sequence's last token land in logits_host (the product always downloads
 * them: the timing includes that copy). */
int  kit_llm_forward(kit_llm_t *m, int S, const int32_t *tokens, const int32_t *q_len, const int32_t *pos0,
                     float *logits_host);
size_t kit_kv_bytes_per_token(const kit_llm_t *m);

#endif
