/* model: checkpoint loading (config.json + safetensors) and the forward passes of the language
 * model (Llama / Qwen2 / Llama-4, table-driven per layer) and the vision towers (CLIP + projector
 * for LLaVA; Llama-4's tower + pixel shuffle + adapter + projector), over a prism_backend_t.
 *
 *   prism_model_config_t cfg;
 *   char err[256];
 *   prism_model_config_load("models/prism-tiny-llava", &cfg, err, sizeof err);
 *   prism_llm_t *llm;
 *   prism_llm_load(be, &cfg, dir, 512, 16, &llm, err, sizeof err);   // weights + activation arena
 *   prism_kv_cache_t *kv;
 *   prism_kv_cache_create(be, &cfg, n_blocks, 16, &kv);
 *   prism_llm_batch_t b = { .n_seqs = 1, .n_tokens = n, .tokens = ids, .seq_start = (int32_t[]){0, n},
 *                           .pos0 = (int32_t[]){0}, .block_tables = (const int32_t *[]){table} };
 *   prism_llm_forward(llm, kv, &b, logits);      // logits [n_seqs][vocab] of the last tokens
 *
 * Memory: weights live in one backend allocation carved into named tensors; activations come
 * from one arena sized at load for (max_batch_tokens, max_seqs) or max_images; forward and encode
 * never allocate. The KV cache is a separate pool of fixed-size blocks owned by the caller's
 * block manager (common/kv); this module only stores and reads block contents.
 */
#ifndef PRISM_MODEL_H
#define PRISM_MODEL_H

#include "core/core.h"
#include "backend/backend.h"

#define PRISM_MODEL_MAX_EOS 8
#define PRISM_MODEL_MAX_LAYERS 1024

/* Per-layer behaviour of the text model: the forward is driven by this table (Llama / Qwen2 set
 * ROPE on every layer; Llama-4 derives it from no_rope_layers, layer_types, use_qk_norm,
 * attn_temperature_tuning and moe_layers / interleave_moe_layer_step). */
enum {
    PRISM_LAYER_ROPE    = 1 << 0,  /* RoPE on q and k */
    PRISM_LAYER_CHUNKED = 1 << 1,  /* chunked (local) attention over attention_chunk tokens */
    PRISM_LAYER_QK_NORM = 1 << 2,  /* per-head RMS ("L2") norm of q and k after RoPE, no weight */
    PRISM_LAYER_TEMP    = 1 << 3,  /* attention temperature tuning of q (Llama-4 NoPE layers) */
    PRISM_LAYER_MOE     = 1 << 4,  /* routed experts + shared expert instead of a dense MLP */
    PRISM_LAYER_QK_RMS  = 1 << 5,  /* per-head RMSNorm of q and k with learned weights (q_norm, k_norm)
                                    * BEFORE RoPE (Qwen3) */
};

typedef enum {
    PRISM_VISION_CLIP   = 0,       /* LLaVA: CLIP tower, feature layer, 2-layer projector */
    PRISM_VISION_LLAMA4 = 1,       /* Llama-4: unfold + CLS last + 2D RoPE, pixel shuffle, adapter, projector */
    PRISM_VISION_QWEN25 = 2,       /* Qwen2.5-VL: native resolution, window attention, 2x2 merger (vision_qwen.c) */
    PRISM_VISION_QWEN3  = 3,       /* Qwen3-VL: native resolution, interpolated learned positions, DeepStack */
} prism_vision_arch_t;

/* Per-layer behaviour of a native-resolution tower (Qwen-VL). */
#define PRISM_MODEL_MAX_VLAYERS 256
enum {
    PRISM_VLAYER_FULLATT = 1 << 0, /* attention over the whole image (else within windows) */
};
#define PRISM_MODEL_MAX_DEEPSTACK 8

typedef struct prism_model_config {
    /* text (Llama / Qwen2) */
    int hidden, n_layers, n_heads, n_kv_heads, head_dim, intermediate, vocab, max_pos;
    float rms_eps, rope_theta;
    int rope_scaling_type;  /* 0 none, 1 llama3 */
    float rope_factor, rope_low_freq_factor, rope_high_freq_factor; int rope_orig_max_pos;
    bool tie_word_embeddings, attention_bias;   /* attention_bias: Qwen2 q/k/v biases */
    bool o_bias;              /* attention output bias (Llama attention_bias also covers o_proj) */
    bool mlp_bias;            /* Llama mlp_bias (rare) */
    int act;                  /* text MLP activation (PRISM_ACT_SILU for Llama/Qwen2) */
    int bos_token_id, eos_token_ids[8], n_eos;  /* eos may be a list in config/generation_config */
    int pad_token_id;         /* -1 when absent */
    /* vision (CLIP); has_vision false for text-only checkpoints */
    bool has_vision;
    int v_image_size, v_patch, v_hidden, v_layers, v_heads, v_intermediate;
    int v_num_channels;       /* 3 */
    float v_eps; int v_act;   /* PRISM_ACT_QUICK_GELU / PRISM_ACT_GELU_ERF / ... */
    int v_feature_layer;      /* e.g. -2 */
    bool v_select_default;    /* "default" drops CLS; "full" keeps it */
    int proj_act;
    bool proj_bias;           /* LLaVA multimodal_projector_bias */
    int image_token_index, image_seq_length;  /* tokens per image after projector */
    char arch[64];
    /* --- table-driven text model (Llama-4 fills the non-default values) --- */
    int rope_mode;            /* prism_rope_mode_t: NEOX (Llama/Qwen2 HF layout) or INTERLEAVE (Llama-4) */
    int mrope_section[3];     /* M-RoPE (Qwen-VL): rotary pairs per position row (t, h, w), in runs; all 0:
                               * plain RoPE */
    bool mrope_interleaved;   /* Qwen3-VL: M-RoPE pairs interleaved t, h, w (pair j: h when j % 3 == 1 and
                               * j < 3 * s1, w when j % 3 == 2 and j < 3 * s2, else t) instead of in runs */
    int dense_intermediate;   /* width of dense MLP layers: intermediate_size_mlp (Llama-4), else intermediate */
    int attention_chunk;      /* attention_chunk_size of PRISM_LAYER_CHUNKED layers (0: none) */
    float floor_scale, attn_scale;   /* temperature tuning: q *= log1p(floor((p+1)/floor_scale))*attn_scale + 1 */
    int n_experts, top_k;     /* MoE layers: num_local_experts, num_experts_per_tok; experts and the
                               * shared expert are `intermediate` wide */
    uint8_t layer_flags[PRISM_MODEL_MAX_LAYERS];   /* PRISM_LAYER_* of each of n_layers layers */
    /* --- Llama-4 vision (vision_arch PRISM_VISION_LLAMA4) --- */
    int vision_arch;          /* prism_vision_arch_t */
    float v_rope_theta;       /* 2D RoPE base */
    int v_shuffle;            /* 1 / pixel_shuffle_ratio (2): tokens per tile = (grid / v_shuffle)^2 */
    int v_adapter_dim;        /* projector_input_dim == projector_output_dim: adapter fc1/fc2 width */
    int v_output_dim;         /* vision_output_dim: multi_modal_projector.linear_1 input */
    int boi_token_id, eoi_token_id;  /* <|image_start|>, <|image_end|> (-1 when absent) */
    /* --- Qwen-VL vision (vision_arch PRISM_VISION_QWEN25 / _QWEN3): images at native resolution;
     * image_seq_length is 0 (the token count follows each image's size: image/qwenvl_proc.h) --- */
    int v_temporal_patch;     /* temporal_patch_size: frames per patch (a still image is repeated) */
    int v_merge;              /* spatial_merge_size: patches per LM token along each axis */
    int v_window;             /* window_size in pixels (window attention outside PRISM_VLAYER_FULLATT layers) */
    uint8_t v_layer_flags[PRISM_MODEL_MAX_VLAYERS];   /* PRISM_VLAYER_* of each of v_layers layers */
    int v_num_pos;            /* Qwen3-VL: num_position_embeddings, the learned position grid (a square) */
    int n_deepstack;          /* Qwen3-VL DeepStack: vision layers whose merged features are added to the LM's
                               * first n_deepstack layers at the image tokens */
    int v_deepstack[PRISM_MODEL_MAX_DEEPSTACK];   /* those vision layers, as config.json lists them */
    /* --- set by the caller, not by config.json ---
     * Seeded random weights of the configured shapes (norms 1, biases 0, the rest N(0, 0.02))
     * instead of reading safetensors — for benchmarks of full-size architectures that cannot be
     * downloaded here. */
    bool random_weights;
    uint64_t random_seed;
    /* Tensor parallelism (prism_model_config_set_tp).
     * 0 or 1 = the whole model. With tp_size T > 1 every size this module reports or allocates is
     * the rank's own (weights, activation arena, KV block bytes, KV heads): see prism_tp_shard_t. */
    int tp_size, tp_rank;
} prism_model_config_t;

/* config.json (+generation_config.json for eos); accepts llava (text_config/vision_config),
 * llama4 (Llama4ForConditionalGeneration: text_config/vision_config), llama4_text, llama, qwen2; rope_parameters vs rope_scaling/rope_theta; missing HF defaults filled as
 * transformers does. Values are bounds-checked (PRISM_ECORRUPT / PRISM_ENOTSUP with err set). */
int  prism_model_config_load(const char *model_dir, prism_model_config_t *cfg, char *err, size_t errlen);
/* Same from a config.json text (generation_config text optional, may be NULL). */
int  prism_model_config_parse(const char *config_json, const char *generation_config_json,
                              prism_model_config_t *cfg, char *err, size_t errlen);
/* The context (tokens per sequence) a process serves: `requested` (--context-length) when > 0, at
 * most max_pos; else max_pos, but no more than PRISM_MODEL_DEFAULT_CONTEXT. Block tables, prompt
 * slots and KV admission are planned for this many tokens, so a config's theoretical maximum
 * (Llama-4 Scout: 10,485,760 positions) is not the default. Router and workers agree on it. */
#define PRISM_MODEL_DEFAULT_CONTEXT 131072
int prism_model_context_length(const prism_model_config_t *cfg, int64_t requested);
/* Fills inv_freq[head_dim/2] for the text RoPE (llama3 scaling applied when configured). */
void prism_model_rope_inv_freq(const prism_model_config_t *cfg, float *inv_freq);
/* Floats of one image-token row a prefill hands the language model (prism_llm_batch_t.embed_rows):
 * the embedding, then (DeepStack, Qwen3-VL) one feature row per DeepStack level. */
static inline int prism_model_embed_row_floats(const prism_model_config_t *cfg)
{
    return cfg->hidden * (1 + cfg->n_deepstack);
}
/* Whether the vision tower is a native-resolution one (vision_qwen.c: Qwen2.5-VL, Qwen3-VL). */
static inline bool prism_model_native_vision(const prism_model_config_t *cfg)
{
    return cfg->has_vision && (cfg->vision_arch == PRISM_VISION_QWEN25 || cfg->vision_arch == PRISM_VISION_QWEN3);
}
/* Whether the text model rotates by M-RoPE's three position rows (cfg.mrope_section). */
static inline bool prism_model_mrope(const prism_model_config_t *cfg)
{
    return cfg->mrope_section[0] + cfg->mrope_section[1] + cfg->mrope_section[2] > 0;
}

/* Between-layer hook: how a caller counts progress inside a long forward and drops cancelled items
 * of a batch without finishing them — the model knows nothing of sockets or requests. Set once
 * per model (prism_llm_set_hook / prism_vision_set_hook); called on the thread running the forward.
 *   layer(ud, done, total): after the embeddings (done = 0) and after each layer; returns true when
 *       some item may have been cancelled since the last call. Must be cheap (an atomic load).
 *   cancelled(ud, item): asked for every item still in the batch after layer() returned true;
 *       true drops the item now: its outputs (logits rows / embeddings) are not written and the
 *       rest of the batch goes on, smaller. Items are numbered as the caller numbered them: the
 *       sequences of an LLM batch, the images of a vision batch. A forward whose items are all
 *       dropped returns PRISM_OK with nothing written.
 * On a device with streams the layers are enqueued, not run, so there the check happens once per
 * forward in practice (at launch). A tensor-parallel shard (cfg.tp_size > 1) calls layer() but never
 * cancelled(): its ranks must run the same collectives over the same rows, so a group drops an
 * aborted item only between forwards (the leader leaves it out of the next step plan). */
typedef struct prism_model_hook {
    bool (*layer)(void *ud, int done, int total);
    bool (*cancelled)(void *ud, int item);
    void *ud;
} prism_model_hook_t;

/* ---- tensor parallelism: what one rank of T holds ----
 * Megatron-style sharding of the language model (the vision tower is never sharded: it runs whole in
 * each encoder process, which scale by count, not by TP):
 *  - attention: q/k/v column-parallel by heads (rank r holds query heads [head0, head0 + n_heads)),
 *    o_proj row-parallel, its partial sums all-reduced (the o bias added once, on rank 0);
 *  - KV heads, the rule: with n_kv >= T (n_kv a multiple of T) rank r holds KV heads
 *    [r*n_kv/T, (r+1)*n_kv/T); with n_kv < T (T a multiple of n_kv) rank r holds the ONE KV head
 *    its query heads read, r*n_kv/T, and each KV head is replicated on T/n_kv ranks. Either way a
 *    rank's query heads are the GQA group of its KV heads in HF's order (q head h reads KV head
 *    h / (n_heads / n_kv)), so the local attention needs no mapping table. n_heads must divide by T;
 *  - dense MLP and the shared expert: gate/up column-parallel, down row-parallel + all-reduce;
 *  - routed experts (Llama-4 MoE): EVERY expert's width is split across the ranks (gate/up columns
 *    and down rows [eff0, eff0 + n_eff) of each expert), the router is replicated, so each rank
 *    routes identically and computes 1/T of every chosen expert; the experts' partial sums join the
 *    shared expert's in the MLP's one all-reduce. Why not experts across ranks: with top-1 routing a
 *    popular expert would keep its rank busy while the others wait (the step runs at the slowest
 *    rank), it needs two all-to-all token exchanges per MoE layer, and it needs n_experts to
 *    divide by T (the tiny Llama-4 fixture has 5 experts);
 *  - embedding and lm_head vocab-parallel: rank r holds vocab rows [vocab0, vocab0 + n_vocab) =
 *    [V*r/T, V*(r+1)/T) (vocab_stride = ceil(V/T), the widest part); the embedding lookup gives
 *    zero rows for other ranks' tokens and is all-reduced; logits are all-gathered, so every rank
 *    (the leader samples) has the full [vocab] row — sampling, logprobs, penalties and grammar masks
 *    need the exact whole distribution.
 * Column widths that do not divide by T are split as evenly as possible (lo = n*r/T). */
typedef struct {
    int size, rank;
    int head0, n_heads;           /* query heads of this rank */
    int kv_head0, n_kv_heads;     /* KV heads this rank holds (and caches) */
    int kv_replicas;              /* ranks holding each KV head: T / n_kv when n_kv < T, else 1 */
    int vocab0, n_vocab, vocab_stride;
    int ffn0, n_ffn;              /* columns of dense_intermediate (dense MLP layers) */
    int eff0, n_eff;              /* columns of intermediate (routed experts, shared expert) */
} prism_tp_shard_t;

/* The shard of `rank` in a group of `size` for this model; PRISM_ENOTSUP (message in err) when the
 * shapes cannot be split that way (heads not divisible, KV heads neither a multiple nor a divisor of
 * size, a width smaller than size). size 1 gives the whole model. */
int  prism_tp_shard(const prism_model_config_t *cfg, int size, int rank, prism_tp_shard_t *out,
                    char *err, size_t errlen);
/* Validates and sets cfg->tp_size / tp_rank (every later size and load is the rank's). */
int  prism_model_config_set_tp(prism_model_config_t *cfg, int size, int rank, char *err, size_t errlen);
/* KV heads this rank's cache holds (n_kv_heads at T = 1). */
int  prism_model_local_kv_heads(const prism_model_config_t *cfg);
/* A rank's part of whole-model KV blocks (prism_kv_cache_export's layout with all cfg->n_kv_heads
 * heads, as a prefill of T = 1 sends them): KV heads [head0, head0 + n_heads) of n_blocks blocks
 * into dst, laid out as a cache holding n_heads heads (prism_kv_cache_import's input for that rank).
 * How a decode group's leader gives each rank exactly the heads it holds. */
void prism_kv_slice_heads(const prism_model_config_t *cfg, int block_size, int n_blocks, const void *src,
                          int head0, int n_heads, void *dst);
/* The inverse: a rank's heads (part) written into their place in whole-model blocks (how a prefill
 * group's leader assembles the KV it sends to decode). */
void prism_kv_merge_heads(const prism_model_config_t *cfg, int block_size, int n_blocks, const void *part,
                          int head0, int n_heads, void *whole);

typedef struct prism_llm prism_llm_t;        /* the language model */
typedef struct prism_kv_cache prism_kv_cache_t;  /* paged K/V storage: per layer [n_blocks][block_size][n_kv_heads][head_dim] for K and V */

/* weights from model.safetensors or the sharded index; key prefixes language_model.model. /
 * model.language_model. / model. accepted; bf16/f16/f32 → backend dtype; progress logged for big
 * loads; activation arena for max_batch_tokens allocated here, once */
int  prism_llm_load(prism_backend_t *be, const prism_model_config_t *cfg, const char *model_dir,
                    int max_batch_tokens, int max_seqs, prism_llm_t **out, char *err, size_t errlen);
void prism_llm_free(prism_llm_t *m);
/* Tensor parallelism (cfg->tp_size > 1): the collectives the forward uses (common/comm/comm.h; the
 * group owns them, the model only calls them). A sharded model refuses to run without one.
 * Every rank must call prism_llm_forward (or begin, and end unless every rank skips it) with the
 * same batch in the same order: end has a collective of its own (the logits' all-gather). */
struct prism_comm;
int  prism_llm_set_comm(prism_llm_t *m, struct prism_comm *comm);
const prism_tp_shard_t *prism_llm_shard(const prism_llm_t *m);
/* Bytes read from the checkpoint at load (the rank's slices, in the checkpoint's dtype): a rank
 * never reads, or materialises, another rank's part of a tensor. */
size_t prism_llm_read_bytes(const prism_llm_t *m);
size_t prism_llm_weight_bytes(const prism_llm_t *m);
size_t prism_llm_arena_bytes(const prism_model_config_t *cfg, int max_batch_tokens, int max_seqs); /* for budget planning before load */
/* Host memory prism_llm_load keeps besides weights and arena (the model's record and layer table,
 * the metadata staged for each forward): a worker's memory plan counts it. */
size_t prism_llm_host_bytes(const prism_model_config_t *cfg, int max_batch_tokens, int max_seqs);
const prism_model_config_t *prism_llm_config(const prism_llm_t *m);

size_t prism_kv_cache_block_bytes(const prism_model_config_t *cfg, int block_size);  /* K+V, all layers, one block (this rank's KV heads) */
int  prism_kv_cache_create(prism_backend_t *be, const prism_model_config_t *cfg, int n_blocks, int block_size, prism_kv_cache_t **out);
void prism_kv_cache_free(prism_kv_cache_t *kv);
int  prism_kv_cache_n_blocks(const prism_kv_cache_t *kv);
int  prism_kv_cache_block_size(const prism_kv_cache_t *kv);

/* Chunked attention (PRISM_LAYER_CHUNKED, Llama-4's RoPE layers) never reads keys before the start
 * of the query's chunk (pos / chunk * chunk). A split cache gives those layers their own pool: each
 * sequence holds a ring of prism_kv_local_ring blocks there (logical block j in ring slot
 * j % ring, reused as the sequence moves on), while the other layers (PRISM_KV_CLASS_FULL) keep
 * every block in the usual pool. At Scout's config (8192-token chunks, 3 of 4 layers chunked) a
 * sequence's KV beyond 8K tokens grows at a quarter of the rate. The forward takes the rings in
 * prism_llm_batch_t.local_tables. prism_kv_cache_create's cache is not split: every layer uses the
 * block tables (prefill, tools, models without chunked layers). */
enum { PRISM_KV_CLASS_FULL = 0, PRISM_KV_CLASS_LOCAL = 1 };
/* Blocks a ring needs for steps of up to max_q tokens per sequence; 0 when the model has no
 * chunked layers. */
int  prism_kv_local_ring(const prism_model_config_t *cfg, int block_size, int max_q);
/* K+V bytes of one block for the layers of one class. */
size_t prism_kv_cache_class_block_bytes(const prism_model_config_t *cfg, int block_size, int cls);
/* First block whose chunked-layer K/V a sequence of n_tokens cached tokens still needs to go on
 * (the block of its current chunk's start); the block count when the model has no chunked layers. */
int  prism_kv_local_first_block(const prism_model_config_t *cfg, int block_size, int n_tokens);
/* n_local_blocks > 0: the chunked layers' pool (the model must have some); 0: as prism_kv_cache_create. */
int  prism_kv_cache_create_split(prism_backend_t *be, const prism_model_config_t *cfg, int n_blocks, int n_local_blocks,
                                 int block_size, prism_kv_cache_t **out);
int  prism_kv_cache_n_local_blocks(const prism_kv_cache_t *kv);
/* Export/import whole blocks as host bytes, layout per block:
 * [n_layers][2 (K,V)][block_size][n_kv_heads][head_dim] float32 (little endian), n_kv_heads being the
 * cache's own (the rank's under tensor parallelism). Export writes
 * n_blocks*block_bytes to dst; import reads it into the given block ids. PRISM_EINVAL for block
 * ids out of range. */
int  prism_kv_cache_export(prism_kv_cache_t *kv, const int32_t *blocks, int n_blocks, void *dst);
int  prism_kv_cache_import(prism_kv_cache_t *kv, const int32_t *blocks, int n_blocks, const void *src);
/* The same for the layers of one class only ([those layers][2][block_size][n_kv][head_dim] per
 * block, layers in order); block ids of the class's pool (a split cache's local pool for
 * PRISM_KV_CLASS_LOCAL). On a split cache export/import of all layers is PRISM_EINVAL. */
int  prism_kv_cache_export_class(prism_kv_cache_t *kv, int cls, const int32_t *blocks, int n_blocks, void *dst);
int  prism_kv_cache_import_class(prism_kv_cache_t *kv, int cls, const int32_t *blocks, int n_blocks, const void *src);

/* One forward over a flattened batch of sequences (prefill chunks and decode steps mix freely). */
typedef struct {
    int n_seqs;
    int n_tokens;                       /* total new tokens */
    const int32_t *tokens;              /* [n_tokens] */
    const int32_t *seq_start;           /* [n_seqs+1] offsets into tokens */
    const int32_t *pos0;                /* [n_seqs] tokens already in the cache = position of first new token */
    const int32_t *const *block_tables; /* [n_seqs][ceil((pos0+n)/block_size)] block ids */
    const float *embeds;                /* optional [n_tokens][hidden] host; row i replaces token i's embedding where embed_mask[i] */
    const uint8_t *embed_mask;          /* optional [n_tokens] */
    const float *const *embed_rows;     /* optional [n_tokens] host rows, instead of embeds/embed_mask: row i
                                         * (when non-NULL) replaces token i's embedding, read in place; with
                                         * DeepStack (cfg.n_deepstack > 0) a row holds
                                         * prism_model_embed_row_floats floats: the embedding, then the features
                                         * added after layers 0 .. n_deepstack-1 */
    bool all_logits;                    /* false: logits of each sequence's last token [n_seqs][vocab]; true: every token [n_tokens][vocab] */
    const int32_t *const *local_tables; /* split caches: [n_seqs][local_ring] local-pool blocks of the chunked
                                         * layers; logical block j is local_tables[s][j % local_ring] */
    int local_ring;
    /* M-RoPE models (cfg.mrope_section): the rotary positions, which differ from the cache positions
     * once a prompt holds images (image/qwenvl_proc.h, prism_mrope_positions). rope_pos: optional
     * host [3][n_tokens] (t, h, w rows) of the new tokens; without it every token turns by its cache
     * position + rope_delta[s] in all three (text after the prompt: decode steps). rope_delta:
     * optional [n_seqs], 0 when NULL. Ignored by other models. */
    const int32_t *rope_pos;
    const int32_t *rope_delta;
} prism_llm_batch_t;
/* PRISM_ELIMIT if n_tokens > max_batch_tokens or n_seqs > max_seqs; PRISM_EINVAL for token ids
 * out of range, bad offsets, block ids out of range, positions beyond max_pos, or (split cache) a
 * step whose chunked-layer blocks do not fit its ring. */
int  prism_llm_forward(prism_llm_t *m, prism_kv_cache_t *kv, const prism_llm_batch_t *b, float *logits /* host */);
/* The same forward in two halves, so the host can prepare the next step while a device runs this
 * one: begin validates and uploads the batch and enqueues the embeddings and every layer (the CPU
 * backend computes them there); end computes the logits and copies them to the host (it waits for
 * the device). Between the two the caller may do anything except use this model or the KV blocks
 * of the batch; b need not outlive begin. prism_llm_forward = begin + end. A begin that is never
 * ended is fine when its logits are not needed (a prompt chunk before the last one): its KV writes
 * are enqueued all the same (under tensor parallelism every rank must skip the same end). */
int  prism_llm_forward_begin(prism_llm_t *m, prism_kv_cache_t *kv, const prism_llm_batch_t *b);
int  prism_llm_forward_end(prism_llm_t *m, float *logits /* host */);
/* hook (may be NULL: none) must outlive its use by the model. */
void prism_llm_set_hook(prism_llm_t *m, const prism_model_hook_t *hook);

typedef struct prism_vision prism_vision_t;  /* CLIP or Llama-4 tower + projector (cfg.vision_arch) */
int  prism_vision_load(prism_backend_t *be, const prism_model_config_t *cfg, const char *model_dir,
                       int max_images, prism_vision_t **out, char *err, size_t errlen);
void prism_vision_free(prism_vision_t *v);
size_t prism_vision_weight_bytes(const prism_vision_t *v);
size_t prism_vision_arena_bytes(const prism_model_config_t *cfg, int max_images);
/* pixels [n][3][image_size][image_size] host float32 (already CLIP-normalised) → out
 * [n][image_seq_length][text hidden] host float32. n_images > max_images: PRISM_ELIMIT (callers
 * split into micro-batches). */
int  prism_vision_encode(prism_vision_t *v, const float *pixels, int n_images, float *out);
void prism_vision_set_hook(prism_vision_t *v, const prism_model_hook_t *hook);

/* ---- native-resolution vision towers (Qwen2.5-VL, Qwen3-VL: cfg.vision_arch PRISM_VISION_QWEN25 / _QWEN3) ----
 * An image is a grid of patches of any size (its processor says which: image/qwenvl_proc.h) and
 * becomes (h / merge) x (w / merge) LM tokens, row-major. A forward takes a batch of images of at
 * most max_patches patches in all: the activation arena is sized for that at load (attention is
 * blockwise: memory is linear in the patches, never quadratic). */
typedef struct {
    int32_t h, w;                    /* patches per column / row (multiples of cfg.v_merge) */
} prism_vgrid_t;

/* An image's embeddings travel to the prefill worker in pieces of at most this many rows, one
 * Embeddings message each (prism.proto): no side holds a second copy of a 16k-token image, and a
 * piece (3.5 MiB at a 3584-wide LM) is the largest data frame a prefill worker accepts. */
#define PRISM_VISION_PIECE_ROWS 256

typedef struct prism_vision_native prism_vision_native_t;
/* max_patches 0: weights only; prism_vision_native_reserve sizes the arena later (a worker that
 * plans its images from what the weights leave of its budget). */
int  prism_vision_native_load(prism_backend_t *be, const prism_model_config_t *cfg, const char *model_dir,
                              int max_patches, prism_vision_native_t **out, char *err, size_t errlen);
/* (Re)allocates the activation arena for batches of up to max_patches patches. */
int  prism_vision_native_reserve(prism_vision_native_t *v, int max_patches, char *err, size_t errlen);
void prism_vision_native_free(prism_vision_native_t *v);
size_t prism_vision_native_weight_bytes(const prism_vision_native_t *v);
/* The arena for max_patches (for budget planning before load); 0 for other towers. */
size_t prism_vision_native_arena_bytes(const prism_model_config_t *cfg, int max_patches);
/* Host memory the tower keeps besides weights and arena (its record and layer table; with max_patches
 * > 0 the metadata staged for each forward): a worker's memory plan counts it. */
size_t prism_vision_native_host_bytes(const prism_model_config_t *cfg, int max_patches);
/* Floats of one LM token's output row: the embedding (cfg.hidden), then Qwen3-VL's DeepStack
 * features (prism_model_embed_row_floats). */
size_t prism_vision_native_row_floats(const prism_model_config_t *cfg);
/* pixels: host float32 [sum of h*w][3][p][p], each image's patches in HF's order, one frame
 * (image/qwenvl_proc.h; the tower repeats it cfg.v_temporal_patch times on the device). out: host
 * [sum of (h/merge)*(w/merge)][row floats], image after image. PRISM_ELIMIT beyond max_patches
 * (callers split into micro-batches of whole images), PRISM_EINVAL for a grid that is not a
 * multiple of the merge size. The hook's items are the images; a dropped image's rows are not
 * written. */
int  prism_vision_native_encode(prism_vision_native_t *v, const float *pixels, const prism_vgrid_t *grids, int n_images,
                                float *out);
void prism_vision_native_set_hook(prism_vision_native_t *v, const prism_model_hook_t *hook);

#endif
