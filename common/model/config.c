/* config.json (+ generation_config.json) -> prism_model_config_t, with transformers' defaults. */
#include "model/model.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define ERR(...) do { if (err && errlen) snprintf(err, errlen, __VA_ARGS__); } while (0)
#define MAX_CONFIG_BYTES (4u << 20)

/* Reads an optional integer field; absent or null leaves *v unchanged. */
static int get_int(json_t *o, const char *k, int *v, long lo, long hi, char *err, size_t errlen)
{
    json_t *j = json_object_get(o, k);
    if (!j || json_is_null(j)) return PRISM_OK;
    if (!json_is_integer(j) || json_integer_value(j) < lo || json_integer_value(j) > hi) {
        ERR("config: '%s' must be an integer in [%ld, %ld]", k, lo, hi);
        return PRISM_ECORRUPT;
    }
    *v = (int)json_integer_value(j);
    return PRISM_OK;
}

static int get_float(json_t *o, const char *k, float *v, double lo, double hi, char *err, size_t errlen)
{
    json_t *j = json_object_get(o, k);
    if (!j || json_is_null(j)) return PRISM_OK;
    if (!json_is_number(j) || !(json_number_value(j) >= lo && json_number_value(j) <= hi)) {
        ERR("config: '%s' must be a number in [%g, %g]", k, lo, hi);
        return PRISM_ECORRUPT;
    }
    *v = (float)json_number_value(j);
    return PRISM_OK;
}

static int get_bool(json_t *o, const char *k, bool *v, char *err, size_t errlen)
{
    json_t *j = json_object_get(o, k);
    if (!j || json_is_null(j)) return PRISM_OK;
    if (!json_is_boolean(j)) {
        ERR("config: '%s' must be a boolean", k);
        return PRISM_ECORRUPT;
    }
    *v = json_is_true(j);
    return PRISM_OK;
}

static const char *get_str(json_t *o, const char *k)
{
    json_t *j = json_object_get(o, k);
    return json_is_string(j) ? json_string_value(j) : NULL;
}

/* eos_token_id: int or list of ints. */
static int get_eos(json_t *o, prism_model_config_t *c, char *err, size_t errlen)
{
    json_t *j = json_object_get(o, "eos_token_id");
    if (!j || json_is_null(j)) return PRISM_OK;
    if (json_is_integer(j)) {
        if (json_integer_value(j) < 0 || json_integer_value(j) > INT32_MAX) goto bad;
        c->eos_token_ids[0] = (int)json_integer_value(j);
        c->n_eos = 1;
        return PRISM_OK;
    }
    if (!json_is_array(j) || json_array_size(j) > PRISM_MODEL_MAX_EOS) goto bad;
    c->n_eos = 0;
    for (size_t i = 0; i < json_array_size(j); i++) {
        json_t *e = json_array_get(j, i);
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > INT32_MAX) goto bad;
        c->eos_token_ids[c->n_eos++] = (int)json_integer_value(e);
    }
    return PRISM_OK;
bad:
    ERR("config: 'eos_token_id' must be an id or a list of at most %d ids", PRISM_MODEL_MAX_EOS);
    return PRISM_ECORRUPT;
}

#define TRY(x) do { int rc_ = (x); if (rc_ != PRISM_OK) return rc_; } while (0)

static int parse_rope(json_t *t, prism_model_config_t *c, char *err, size_t errlen)
{
    /* transformers >= 4.5x: rope_parameters {rope_type, rope_theta, ...}; older: rope_theta at
     * top level plus optional rope_scaling {type|rope_type, factor, ...}. */
    TRY(get_float(t, "rope_theta", &c->rope_theta, 1.0, 1e12, err, errlen));
    json_t *rp = json_object_get(t, "rope_parameters");
    if (!rp || json_is_null(rp)) rp = json_object_get(t, "rope_scaling");
    if (!rp || json_is_null(rp)) return PRISM_OK;
    if (!json_is_object(rp)) {
        ERR("config: rope_parameters/rope_scaling must be an object");
        return PRISM_ECORRUPT;
    }
    if (json_object_get(rp, "full_attention") || json_object_get(rp, "sliding_attention")) {
        ERR("config: per-layer-type rope parameters are not supported");
        return PRISM_ENOTSUP;
    }
    TRY(get_float(rp, "rope_theta", &c->rope_theta, 1.0, 1e12, err, errlen));
    const char *type = get_str(rp, "rope_type");
    if (!type) type = get_str(rp, "type");
    /* M-RoPE (Qwen2/2.5-VL): "mrope" is the default frequencies with the rotary pairs split among
     * the (t, h, w) position rows by mrope_section (transformers maps the type to "default"). */
    json_t *ms = json_object_get(rp, "mrope_section");
    if (ms && !json_is_null(ms)) {
        if (!json_is_array(ms) || json_array_size(ms) != 3) {
            ERR("config: mrope_section must list 3 integers");
            return PRISM_ECORRUPT;
        }
        for (int i = 0; i < 3; i++) {
            json_t *e = json_array_get(ms, (size_t)i);
            if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > 256) {
                ERR("config: mrope_section[%d] must be an integer in [0, 256]", i);
                return PRISM_ECORRUPT;
            }
            c->mrope_section[i] = (int)json_integer_value(e);
        }
    }
    if (!type || strcmp(type, "default") == 0 || strcmp(type, "mrope") == 0) {
        c->rope_scaling_type = 0;
    } else if (strcmp(type, "llama3") == 0) {
        c->rope_scaling_type = 1;
        c->rope_factor = 8.0f;
        c->rope_low_freq_factor = 1.0f;
        c->rope_high_freq_factor = 4.0f;
        c->rope_orig_max_pos = 8192;
        TRY(get_float(rp, "factor", &c->rope_factor, 1e-3, 1e6, err, errlen));
        TRY(get_float(rp, "low_freq_factor", &c->rope_low_freq_factor, 1e-6, 1e6, err, errlen));
        TRY(get_float(rp, "high_freq_factor", &c->rope_high_freq_factor, 1e-6, 1e6, err, errlen));
        TRY(get_int(rp, "original_max_position_embeddings", &c->rope_orig_max_pos, 1, 1 << 26, err, errlen));
        /* Equal factors are legal (Llama-4 Scout ships high = low = 1): the smoothing band is then
         * empty and never divides by zero. */
        if (!(c->rope_high_freq_factor >= c->rope_low_freq_factor)) {
            ERR("config: llama3 rope needs high_freq_factor >= low_freq_factor");
            return PRISM_ECORRUPT;
        }
    } else {
        ERR("config: rope type '%s' is not supported", type);
        return PRISM_ENOTSUP;
    }
    json_t *prf = json_object_get(rp, "partial_rotary_factor");
    if (prf && json_is_number(prf) && json_number_value(prf) != 1.0) {
        ERR("config: partial_rotary_factor != 1 is not supported");
        return PRISM_ENOTSUP;
    }
    return PRISM_OK;
}

static int parse_llama4_text(json_t *t, prism_model_config_t *c, char *err, size_t errlen);

static int parse_text(json_t *t, const char *model_type, prism_model_config_t *c, char *err, size_t errlen)
{
    bool qwen2 = model_type && strcmp(model_type, "qwen2") == 0;
    bool l4 = model_type && strcmp(model_type, "llama4_text") == 0;
    if (model_type && strcmp(model_type, "llama") != 0 && !qwen2 && !l4 && strcmp(model_type, "mistral") != 0) {
        ERR("config: text model_type '%s' is not supported (llama, llama4_text, mistral, qwen2)", model_type);
        return PRISM_ENOTSUP;
    }
    /* Defaults of LlamaConfig / Qwen2Config / Llama4TextConfig. */
    c->vocab = qwen2 ? 151936 : l4 ? 202048 : 32000;
    c->hidden = l4 ? 5120 : 4096;
    c->intermediate = qwen2 ? 22016 : l4 ? 8192 : 11008;
    c->n_layers = l4 ? 48 : 32;
    c->n_heads = l4 ? 40 : 32;
    c->n_kv_heads = l4 ? 8 : -1;
    c->head_dim = l4 ? 128 : -1;
    c->max_pos = qwen2 ? 32768 : l4 ? 131072 : 2048;
    c->rms_eps = l4 ? 1e-5f : 1e-6f;
    c->rope_theta = l4 ? 500000.0f : 10000.0f;
    c->tie_word_embeddings = false;
    c->attention_bias = qwen2;
    c->bos_token_id = qwen2 ? -1 : 1;
    c->n_eos = 0;
    if (!qwen2) {
        c->eos_token_ids[0] = 2;
        c->n_eos = 1;
    }
    c->pad_token_id = -1;
    c->act = PRISM_ACT_SILU;

    TRY(get_int(t, "vocab_size", &c->vocab, 1, 1 << 22, err, errlen));
    TRY(get_int(t, "hidden_size", &c->hidden, 1, 1 << 16, err, errlen));
    TRY(get_int(t, "intermediate_size", &c->intermediate, 1, 1 << 20, err, errlen));
    TRY(get_int(t, "num_hidden_layers", &c->n_layers, 1, 1024, err, errlen));
    TRY(get_int(t, "num_attention_heads", &c->n_heads, 1, 1024, err, errlen));
    TRY(get_int(t, "num_key_value_heads", &c->n_kv_heads, 1, 1024, err, errlen));
    TRY(get_int(t, "head_dim", &c->head_dim, 2, 1024, err, errlen));
    if (json_is_null(json_object_get(t, "head_dim"))) c->head_dim = -1;   /* null: hidden / heads */
    TRY(get_int(t, "max_position_embeddings", &c->max_pos, 1, 1 << 24, err, errlen));
    TRY(get_float(t, "rms_norm_eps", &c->rms_eps, 0.0, 1.0, err, errlen));
    TRY(get_bool(t, "tie_word_embeddings", &c->tie_word_embeddings, err, errlen));
    TRY(get_int(t, "bos_token_id", &c->bos_token_id, -1, INT32_MAX, err, errlen));
    TRY(get_int(t, "pad_token_id", &c->pad_token_id, -1, INT32_MAX, err, errlen));
    TRY(get_eos(t, c, err, errlen));
    if (!qwen2) {
        TRY(get_bool(t, "attention_bias", &c->attention_bias, err, errlen));
        c->o_bias = c->attention_bias;  /* Llama's attention_bias covers o_proj too */
        if (!l4) TRY(get_bool(t, "mlp_bias", &c->mlp_bias, err, errlen));
    }
    const char *act = get_str(t, "hidden_act");
    if (act) {
        c->act = prism_act_parse(act);
        if (c->act != PRISM_ACT_SILU) {
            ERR("config: text hidden_act '%s' is not supported (silu)", act);
            return PRISM_ENOTSUP;
        }
    }
    TRY(parse_rope(t, c, err, errlen));
    if (qwen2) {
        bool sw = false;
        TRY(get_bool(t, "use_sliding_window", &sw, err, errlen));
        if (sw) {
            ERR("config: qwen2 sliding-window attention is not supported");
            return PRISM_ENOTSUP;
        }
    }
    if (c->n_kv_heads < 0) c->n_kv_heads = c->n_heads;
    if (c->head_dim < 0) {
        if (c->hidden % c->n_heads) {
            ERR("config: hidden_size %d is not a multiple of num_attention_heads %d", c->hidden, c->n_heads);
            return PRISM_ECORRUPT;
        }
        c->head_dim = c->hidden / c->n_heads;
    }
    if (c->n_heads % c->n_kv_heads) {
        ERR("config: num_attention_heads %d is not a multiple of num_key_value_heads %d", c->n_heads, c->n_kv_heads);
        return PRISM_ECORRUPT;
    }
    if (c->head_dim % 2 || c->head_dim > 512) {
        ERR("config: head_dim %d must be even and <= 512", c->head_dim);
        return PRISM_ENOTSUP;
    }
    if (c->n_heads / c->n_kv_heads > 64) {
        ERR("config: more than 64 query heads per kv head");
        return PRISM_ENOTSUP;
    }
    c->rope_mode = PRISM_ROPE_NEOX;
    c->dense_intermediate = c->intermediate;
    for (int i = 0; i < c->n_layers; i++) c->layer_flags[i] = PRISM_LAYER_ROPE;
    return l4 ? parse_llama4_text(t, c, err, errlen) : PRISM_OK;
}

/* ---------------------------------------------------------------- Llama-4 */

/* Optional list of n ints in [lo, hi] into out; absent / null / [] -> *present = false. */
static int get_int_list(json_t *o, const char *k, int *out, int n, int lo, int hi, bool exact_len, bool *present,
                        char *err, size_t errlen)
{
    json_t *j = json_object_get(o, k);
    *present = false;
    if (!j || json_is_null(j) || (json_is_array(j) && json_array_size(j) == 0)) return PRISM_OK;
    if (!json_is_array(j) || (exact_len ? (int)json_array_size(j) != n : (int)json_array_size(j) < n) ||
        json_array_size(j) > PRISM_MODEL_MAX_LAYERS) {
        ERR("config: '%s' must be a list of %s%d integers", k, exact_len ? "" : "at least ", n);
        return PRISM_ECORRUPT;
    }
    for (size_t i = 0; i < json_array_size(j); i++) {
        json_t *e = json_array_get(j, i);
        if (!json_is_integer(e) || json_integer_value(e) < lo || json_integer_value(e) > hi) {
            ERR("config: '%s'[%zu] must be an integer in [%d, %d]", k, i, lo, hi);
            return PRISM_ECORRUPT;
        }
        if ((int)i < n) out[i] = (int)json_integer_value(e);
    }
    *present = true;
    return PRISM_OK;
}

/* Llama4TextConfig beyond the Llama keys: the per-layer table and the MoE / attention knobs, with
 * the same derivations transformers makes in Llama4TextConfig.__post_init__. */
static int parse_llama4_text(json_t *t, prism_model_config_t *c, char *err, size_t errlen)
{
    int L = c->n_layers;
    c->rope_mode = PRISM_ROPE_INTERLEAVE;
    c->dense_intermediate = 16384;
    c->n_experts = 16;
    c->top_k = 1;
    c->floor_scale = 8192.0f;
    c->attn_scale = 0.1f;
    int step = 1, interval = 4, chunk = 8192;
    bool qk_norm = true, temp = true;
    TRY(get_int(t, "intermediate_size_mlp", &c->dense_intermediate, 1, 1 << 20, err, errlen));
    TRY(get_int(t, "num_local_experts", &c->n_experts, 1, 1024, err, errlen));
    TRY(get_int(t, "num_experts_per_tok", &c->top_k, 1, PRISM_MOE_MAX_TOPK, err, errlen));
    TRY(get_int(t, "interleave_moe_layer_step", &step, 1, 1024, err, errlen));
    TRY(get_int(t, "no_rope_layer_interval", &interval, 1, 1 << 20, err, errlen));
    TRY(get_bool(t, "use_qk_norm", &qk_norm, err, errlen));
    /* Some released configs write attn_temperature_tuning as an integer (4); transformers only tests
     * its truth value. */
    json_t *jt = json_object_get(t, "attn_temperature_tuning");
    if (json_is_integer(jt)) temp = json_integer_value(jt) != 0;
    else TRY(get_bool(t, "attn_temperature_tuning", &temp, err, errlen));
    TRY(get_float(t, "floor_scale", &c->floor_scale, 1.0, 1e12, err, errlen));
    TRY(get_float(t, "attn_scale", &c->attn_scale, -1e6, 1e6, err, errlen));
    json_t *jc = json_object_get(t, "attention_chunk_size");
    if (jc && json_is_null(jc)) chunk = 0;
    else TRY(get_int(t, "attention_chunk_size", &chunk, 1, 1 << 30, err, errlen));
    if (c->top_k > c->n_experts) {
        ERR("config: num_experts_per_tok %d exceeds num_local_experts %d", c->top_k, c->n_experts);
        return PRISM_ECORRUPT;
    }
    int tmp[PRISM_MODEL_MAX_LAYERS];
    bool present;
    /* no_rope_layers[i]: 1 = RoPE layer, 0 = NoPE layer; default a NoPE layer every `interval`. */
    int rope[PRISM_MODEL_MAX_LAYERS];
    TRY(get_int_list(t, "no_rope_layers", rope, L, 0, 1, false, &present, err, errlen));
    if (!present)
        for (int i = 0; i < L; i++) rope[i] = (i + 1) % interval != 0;
    /* moe_layers overrides interleave_moe_layer_step: MoE layers are range(step-1, L, step). */
    bool moe[PRISM_MODEL_MAX_LAYERS] = {0};
    json_t *ml = json_object_get(t, "moe_layers");
    if (ml && !json_is_null(ml)) {
        if (!json_is_array(ml) || json_array_size(ml) > (size_t)L) {
            ERR("config: 'moe_layers' must be a list of layer indices");
            return PRISM_ECORRUPT;
        }
        int n = (int)json_array_size(ml);
        TRY(get_int_list(t, "moe_layers", tmp, n, 0, L - 1, true, &present, err, errlen));
        for (int i = 0; present && i < n; i++) moe[tmp[i]] = true;
    } else {
        for (int i = step - 1; i < L; i += step) moe[i] = true;
    }
    /* layer_types (when saved) decides the attention mask; else chunked on RoPE layers. */
    bool chunked[PRISM_MODEL_MAX_LAYERS];
    json_t *lt = json_object_get(t, "layer_types");
    if (lt && !json_is_null(lt)) {
        if (!json_is_array(lt) || (int)json_array_size(lt) != L) {
            ERR("config: 'layer_types' must list %d layers", L);
            return PRISM_ECORRUPT;
        }
        for (int i = 0; i < L; i++) {
            const char *s = json_string_value(json_array_get(lt, i));
            if (s && !strcmp(s, "chunked_attention")) chunked[i] = true;
            else if (s && !strcmp(s, "full_attention")) chunked[i] = false;
            else {
                ERR("config: layer_types[%d] must be chunked_attention or full_attention", i);
                return PRISM_ENOTSUP;
            }
            if (chunked[i] && !chunk) {
                ERR("config: layer %d is chunked_attention but attention_chunk_size is null", i);
                return PRISM_ECORRUPT;
            }
        }
    } else {
        for (int i = 0; i < L; i++) chunked[i] = rope[i] && chunk;
    }
    c->attention_chunk = chunk;
    for (int i = 0; i < L; i++) {
        uint8_t f = 0;
        if (rope[i]) f |= PRISM_LAYER_ROPE | (qk_norm ? PRISM_LAYER_QK_NORM : 0);
        else if (temp) f |= PRISM_LAYER_TEMP;
        if (chunked[i]) f |= PRISM_LAYER_CHUNKED;
        if (moe[i]) f |= PRISM_LAYER_MOE;
        c->layer_flags[i] = f;
    }
    return PRISM_OK;
}

/* The vision_config object, or an empty one standing for transformers' defaults when it is absent
 * or null (*empty: that one, the caller's to json_decref; NULL otherwise). */
static int vision_object(json_t **v, json_t **empty, char *err, size_t errlen)
{
    *empty = NULL;
    if (*v && !json_is_null(*v) && !json_is_object(*v)) {
        ERR("config: vision_config must be an object");
        return PRISM_ECORRUPT;
    }
    if (!*v || json_is_null(*v)) *v = *empty = json_object();
    return *v ? PRISM_OK : PRISM_ENOMEM;
}

/* Llama4VisionConfig. transformers' vision tower ignores hidden_act (nn.GELU), norm_eps (nn.LayerNorm's
 * 1e-5), vision_feature_layer and multi_modal_projector_bias; the dimensions must chain the way its
 * modules are built or transformers itself fails, so mismatches are refused here. */
static int parse_llama4_vision(json_t *v, prism_model_config_t *c, char *err, size_t errlen)
{
    json_t *empty;
    int rc = vision_object(&v, &empty, err, errlen);
    if (rc != PRISM_OK) return rc;
    rc = PRISM_ECORRUPT;
    const char *mt = get_str(v, "model_type");
    c->vision_arch = PRISM_VISION_LLAMA4;
    c->v_hidden = 768;
    c->v_layers = 34;
    c->v_heads = 16;
    c->v_num_channels = 3;
    c->v_intermediate = 5632;
    c->v_output_dim = 7680;
    c->v_image_size = 448;
    c->v_patch = 14;
    c->v_adapter_dim = 4096;
    c->v_rope_theta = 10000.0f;
    c->v_eps = 1e-5f;
    c->v_act = PRISM_ACT_GELU_ERF;
    float ratio = 0.5f;
    int proj_in = 4096, proj_out = 4096;
    if (mt && strcmp(mt, "llama4_vision_model") != 0) {
        ERR("config: vision model_type '%s' is not supported with llama4 (llama4_vision_model)", mt);
        rc = PRISM_ENOTSUP;
        goto done;
    }
    if (get_int(v, "hidden_size", &c->v_hidden, 1, 1 << 15, err, errlen) ||
        get_int(v, "num_hidden_layers", &c->v_layers, 1, 1024, err, errlen) ||
        get_int(v, "num_attention_heads", &c->v_heads, 1, 1024, err, errlen) ||
        get_int(v, "num_channels", &c->v_num_channels, 1, 16, err, errlen) ||
        get_int(v, "intermediate_size", &c->v_intermediate, 1, 1 << 18, err, errlen) ||
        get_int(v, "vision_output_dim", &c->v_output_dim, 1, 1 << 18, err, errlen) ||
        get_int(v, "image_size", &c->v_image_size, 1, 8192, err, errlen) ||
        get_int(v, "patch_size", &c->v_patch, 1, 1024, err, errlen) ||
        get_int(v, "projector_input_dim", &proj_in, 1, 1 << 18, err, errlen) ||
        get_int(v, "projector_output_dim", &proj_out, 1, 1 << 18, err, errlen) ||
        get_float(v, "pixel_shuffle_ratio", &ratio, 1e-3, 1.0, err, errlen) ||
        get_float(v, "rope_theta", &c->v_rope_theta, 1.0, 1e12, err, errlen))
        goto done;
    json_t *rp = json_object_get(v, "rope_parameters");
    if (json_is_object(rp) && get_float(rp, "rope_theta", &c->v_rope_theta, 1.0, 1e12, err, errlen)) goto done;
    c->v_shuffle = (int)lroundf(1.0f / ratio);
    int g = c->v_image_size / c->v_patch, hd = c->v_hidden / c->v_heads;
    if (fabsf(1.0f / (float)c->v_shuffle - ratio) > 1e-6f || c->v_image_size % c->v_patch || g % c->v_shuffle) {
        ERR("config: vision image_size %d / patch_size %d / pixel_shuffle_ratio %g do not tile", c->v_image_size,
            c->v_patch, ratio);
        rc = PRISM_ENOTSUP;
        goto done;
    }
    if (c->v_hidden % c->v_heads || hd % 4 || hd > 256) {
        ERR("config: vision head dim %d must be a multiple of 4 (2D RoPE) and <= 256", hd);
        rc = PRISM_ENOTSUP;
        goto done;
    }
    if (c->v_intermediate != c->v_hidden * c->v_shuffle * c->v_shuffle || proj_in != proj_out ||
        c->v_output_dim != proj_out) {
        ERR("config: vision dims do not chain (intermediate_size %d vs hidden*%d = %d, projector_input_dim %d, "
            "projector_output_dim %d, vision_output_dim %d)", c->v_intermediate, c->v_shuffle * c->v_shuffle,
            c->v_hidden * c->v_shuffle * c->v_shuffle, proj_in, proj_out, c->v_output_dim);
        goto done;
    }
    c->v_adapter_dim = proj_out;
    c->v_feature_layer = c->v_layers;   /* every layer runs, then layernorm_post */
    c->v_select_default = true;         /* CLS (last) dropped */
    c->image_seq_length = (g / c->v_shuffle) * (g / c->v_shuffle);
    rc = PRISM_OK;
done:
    json_decref(empty);
    return rc;
}

/* ---------------------------------------------------------------- Qwen-VL (both) */

/* The vision_config keys both Qwen-VL towers read (their transformers defaults already in c). */
static int get_qwenvl_vision_keys(json_t *v, prism_model_config_t *c, int *out_hidden, char *err, size_t errlen)
{
    if (get_int(v, "depth", &c->v_layers, 1, PRISM_MODEL_MAX_VLAYERS, err, errlen) ||
        get_int(v, "hidden_size", &c->v_hidden, 1, 1 << 15, err, errlen) ||
        get_int(v, "intermediate_size", &c->v_intermediate, 1, 1 << 18, err, errlen) ||
        get_int(v, "num_heads", &c->v_heads, 1, 1024, err, errlen) ||
        get_int(v, "in_channels", &c->v_num_channels, 3, 3, err, errlen) ||
        get_int(v, "patch_size", &c->v_patch, 1, 64, err, errlen) ||
        get_int(v, "spatial_merge_size", &c->v_merge, 1, 4, err, errlen) ||
        get_int(v, "temporal_patch_size", &c->v_temporal_patch, 1, 16, err, errlen) ||
        get_int(v, "out_hidden_size", out_hidden, 1, 1 << 16, err, errlen) ||
        get_float(v, "rope_theta", &c->v_rope_theta, 1.0, 1e12, err, errlen))
        return PRISM_ECORRUPT;
    json_t *rp = json_object_get(v, "rope_parameters");
    if (json_is_object(rp) && get_float(rp, "rope_theta", &c->v_rope_theta, 1.0, 1e12, err, errlen))
        return PRISM_ECORRUPT;
    return PRISM_OK;
}

/* What both Qwen-VL configs hold once the text model is read: M-RoPE sections that cover the rotary
 * pairs, no rope scaling, the tower (parse_vision over vision_config), and the special tokens
 * (Qwen2-VL's ids unless config.json names others). */
static int parse_qwenvl_rest(json_t *root, prism_model_config_t *c, const char *model,
                             int (*parse_vision)(json_t *, prism_model_config_t *, char *, size_t), char *err,
                             size_t errlen)
{
    if (c->mrope_section[0] + c->mrope_section[1] + c->mrope_section[2] != c->head_dim / 2) {
        ERR("config: mrope_section %d+%d+%d must cover head_dim/2 = %d rotary pairs", c->mrope_section[0],
            c->mrope_section[1], c->mrope_section[2], c->head_dim / 2);
        return PRISM_ECORRUPT;
    }
    if (c->rope_scaling_type != 0) {
        ERR("config: %s with rope scaling is not supported", model);
        return PRISM_ENOTSUP;
    }
    TRY(parse_vision(json_object_get(root, "vision_config"), c, err, errlen));
    c->has_vision = true;
    c->image_token_index = 151655;
    c->boi_token_id = 151652;
    c->eoi_token_id = 151653;
    bool tie = false;
    TRY(get_int(root, "image_token_id", &c->image_token_index, 0, INT32_MAX, err, errlen));
    TRY(get_int(root, "vision_start_token_id", &c->boi_token_id, 0, INT32_MAX, err, errlen));
    TRY(get_int(root, "vision_end_token_id", &c->eoi_token_id, 0, INT32_MAX, err, errlen));
    TRY(get_bool(root, "tie_word_embeddings", &tie, err, errlen));
    c->tie_word_embeddings = c->tie_word_embeddings || tie;
    if (c->image_token_index >= c->vocab || c->boi_token_id >= c->vocab || c->eoi_token_id >= c->vocab) {
        ERR("config.json: image / vision start / end token ids outside the vocabulary (%d)", c->vocab);
        return PRISM_ECORRUPT;
    }
    return PRISM_OK;
}

/* ---------------------------------------------------------------- Qwen2.5-VL */

/* Qwen2_5_VLVisionConfig (transformers' defaults for absent keys): the layer table from
 * fullatt_block_indexes; the dimensions must chain into the text model. */
static int parse_qwen25_vision(json_t *v, prism_model_config_t *c, char *err, size_t errlen)
{
    json_t *empty;
    int rc = vision_object(&v, &empty, err, errlen);
    if (rc != PRISM_OK) return rc;
    rc = PRISM_ECORRUPT;
    int out_hidden = 3584;
    c->vision_arch = PRISM_VISION_QWEN25;
    c->v_layers = 32;
    c->v_hidden = 3584;
    c->v_intermediate = 3420;
    c->v_heads = 16;
    c->v_num_channels = 3;
    c->v_patch = 14;
    c->v_merge = 2;
    c->v_temporal_patch = 2;
    c->v_window = 112;
    c->v_rope_theta = 10000.0f;
    c->v_eps = 1e-6f;
    c->v_act = PRISM_ACT_SILU;
    int full[PRISM_MODEL_MAX_VLAYERS] = {7, 15, 23, 31}, n_full = 4;
    if (get_qwenvl_vision_keys(v, c, &out_hidden, err, errlen) ||
        get_int(v, "window_size", &c->v_window, 1, 1 << 16, err, errlen))
        goto done;
    const char *act = get_str(v, "hidden_act");
    if (act && prism_act_parse(act) != PRISM_ACT_SILU) {
        ERR("config: Qwen2.5-VL vision hidden_act '%s' is not supported (silu)", act);
        rc = PRISM_ENOTSUP;
        goto done;
    }
    json_t *fl = json_object_get(v, "fullatt_block_indexes");
    if (fl && !json_is_null(fl)) {
        if (!json_is_array(fl) || json_array_size(fl) > (size_t)c->v_layers) {
            ERR("config: fullatt_block_indexes must list layer indices");
            goto done;
        }
        bool present;
        n_full = (int)json_array_size(fl);
        if (n_full && get_int_list(v, "fullatt_block_indexes", full, n_full, 0, c->v_layers - 1, true, &present, err,
                                   errlen))
            goto done;
    }
    memset(c->v_layer_flags, 0, sizeof c->v_layer_flags);
    for (int i = 0; i < n_full; i++)
        if (full[i] < c->v_layers) c->v_layer_flags[full[i]] |= PRISM_VLAYER_FULLATT;
    int hd = c->v_hidden % c->v_heads ? 0 : c->v_hidden / c->v_heads;
    if (!hd || hd % 4 || hd > 512) {
        ERR("config: vision head dim %d/%d must be a multiple of 4 (2D RoPE) and <= 512", c->v_hidden, c->v_heads);
        rc = PRISM_ENOTSUP;
        goto done;
    }
    if (out_hidden != c->hidden) {
        ERR("config: vision out_hidden_size %d differs from the text hidden_size %d", out_hidden, c->hidden);
        goto done;
    }
    if (c->v_window % (c->v_patch * c->v_merge)) {
        ERR("config: window_size %d is not a multiple of patch_size * spatial_merge_size", c->v_window);
        rc = PRISM_ENOTSUP;
        goto done;
    }
    c->v_image_size = 0;               /* native resolution: no fixed input size */
    c->image_seq_length = 0;           /* tokens per image follow its size */
    c->v_feature_layer = c->v_layers;  /* every layer runs, then the merger */
    rc = PRISM_OK;
done:
    json_decref(empty);
    return rc;
}

/* Qwen2_5_VLConfig: the text model (text_config, or the root's keys in the checkpoints' flat
 * layout) with Qwen2_5_VLTextConfig's defaults, M-RoPE, the vision tower and the special tokens. */
static int parse_qwen25_vl(json_t *root, prism_model_config_t *c, char *err, size_t errlen)
{
    json_t *text = json_object_get(root, "text_config");
    if (text && !json_is_null(text) && !json_is_object(text)) {
        ERR("config.json: text_config must be an object");
        return PRISM_ECORRUPT;
    }
    json_t *t = json_is_object(text) ? text : root;
    TRY(parse_text(t, "qwen2", c, err, errlen));
    /* Qwen2_5_VLTextConfig's defaults where they differ from Qwen2Config's */
    json_t *probe;
    if (!json_object_get(t, "vocab_size")) c->vocab = 152064;
    if (!json_object_get(t, "rms_norm_eps")) c->rms_eps = 1e-5f;
    if (!(probe = json_object_get(t, "bos_token_id")) || json_is_null(probe)) c->bos_token_id = 151643;
    if (!c->n_eos) {
        c->eos_token_ids[0] = 151645;
        c->n_eos = 1;
    }
    if (!json_object_get(t, "rope_theta") && !json_object_get(t, "rope_parameters") &&
        !(json_is_object(json_object_get(t, "rope_scaling")) &&
          json_object_get(json_object_get(t, "rope_scaling"), "rope_theta")))
        c->rope_theta = 1000000.0f;
    if (!c->mrope_section[0] && !c->mrope_section[1] && !c->mrope_section[2]) {
        c->mrope_section[0] = 16;   /* Qwen2_5_VLRotaryEmbedding's default */
        c->mrope_section[1] = c->mrope_section[2] = 24;
    }
    return parse_qwenvl_rest(root, c, "Qwen2.5-VL", parse_qwen25_vision, err, errlen);
}

/* ---------------------------------------------------------------- Qwen3-VL */

/* Qwen3VLVisionConfig: every layer attends over the whole image (no windows); DeepStack layers. */
static int parse_qwen3_vision(json_t *v, prism_model_config_t *c, char *err, size_t errlen)
{
    json_t *empty;
    int rc = vision_object(&v, &empty, err, errlen);
    if (rc != PRISM_OK) return rc;
    rc = PRISM_ECORRUPT;
    int out_hidden = 3584;
    c->vision_arch = PRISM_VISION_QWEN3;
    c->v_layers = 27;
    c->v_hidden = 1152;
    c->v_intermediate = 4304;
    c->v_heads = 16;
    c->v_num_channels = 3;
    c->v_patch = 16;
    c->v_merge = 2;
    c->v_temporal_patch = 2;
    c->v_window = 0;
    c->v_num_pos = 2304;
    c->v_rope_theta = 10000.0f;
    c->v_eps = 1e-6f;
    c->v_act = PRISM_ACT_GELU_TANH;
    int ds[PRISM_MODEL_MAX_DEEPSTACK] = {8, 16, 24}, n_ds = 3;
    if (get_qwenvl_vision_keys(v, c, &out_hidden, err, errlen) ||
        get_int(v, "num_position_embeddings", &c->v_num_pos, 1, 1 << 20, err, errlen))
        goto done;
    const char *act = get_str(v, "hidden_act");
    if (act && (c->v_act = prism_act_parse(act)) < 0) {
        ERR("config: Qwen3-VL vision hidden_act '%s' is not supported", act);
        rc = PRISM_ENOTSUP;
        goto done;
    }
    json_t *dl = json_object_get(v, "deepstack_visual_indexes");
    if (dl && !json_is_null(dl)) {
        if (!json_is_array(dl) || json_array_size(dl) > PRISM_MODEL_MAX_DEEPSTACK) {
            ERR("config: deepstack_visual_indexes must list at most %d layers", PRISM_MODEL_MAX_DEEPSTACK);
            goto done;
        }
        bool present;
        n_ds = (int)json_array_size(dl);
        if (n_ds && get_int_list(v, "deepstack_visual_indexes", ds, n_ds, 0, c->v_layers - 1, true, &present, err,
                                 errlen))
            goto done;
    }
    for (int i = 0; i < n_ds; i++) {
        if (ds[i] >= c->v_layers) {
            ERR("config: deepstack layer %d beyond the %d vision layers", ds[i], c->v_layers);
            goto done;
        }
        for (int k = 0; k < i; k++)
            if (ds[k] == ds[i]) {
                ERR("config: deepstack layer %d listed twice", ds[i]);
                goto done;
            }
        c->v_deepstack[i] = ds[i];
    }
    c->n_deepstack = n_ds;
    if (n_ds > c->n_layers) {
        ERR("config: %d DeepStack levels for %d text layers", n_ds, c->n_layers);
        goto done;
    }
    memset(c->v_layer_flags, 0, sizeof c->v_layer_flags);
    for (int L = 0; L < c->v_layers; L++) c->v_layer_flags[L] = PRISM_VLAYER_FULLATT;
    int hd = c->v_hidden % c->v_heads ? 0 : c->v_hidden / c->v_heads;
    int side = (int)lround(sqrt((double)c->v_num_pos));
    if (!hd || hd % 4 || hd > 512 || side * side != c->v_num_pos) {
        ERR("config: vision head dim %d/%d must be a multiple of 4 and num_position_embeddings %d a square",
            c->v_hidden, c->v_heads, c->v_num_pos);
        rc = PRISM_ENOTSUP;
        goto done;
    }
    if (out_hidden != c->hidden) {
        ERR("config: vision out_hidden_size %d differs from the text hidden_size %d", out_hidden, c->hidden);
        goto done;
    }
    c->v_image_size = 0;
    c->image_seq_length = 0;
    c->v_feature_layer = c->v_layers;
    rc = PRISM_OK;
done:
    json_decref(empty);
    return rc;
}

/* Qwen3VLConfig: Qwen3 text (q_norm / k_norm before RoPE, no biases, head_dim of its own) with
 * interleaved M-RoPE, the tower, the special tokens. */
static int parse_qwen3_vl(json_t *root, prism_model_config_t *c, char *err, size_t errlen)
{
    json_t *text = json_object_get(root, "text_config");
    if (text && !json_is_null(text) && !json_is_object(text)) {
        ERR("config.json: text_config must be an object");
        return PRISM_ECORRUPT;
    }
    json_t *empty = json_object();
    json_t *t = json_is_object(text) ? text : empty;
    /* Qwen3VLTextConfig's defaults before the keys */
    int rc = parse_text(t, "qwen2", c, err, errlen);
    if (rc == PRISM_OK) {
        if (!json_object_get(t, "vocab_size")) c->vocab = 151936;
        if (!json_object_get(t, "intermediate_size")) c->intermediate = 22016;
        if (!json_object_get(t, "max_position_embeddings")) c->max_pos = 128000;
        if (!json_object_get(t, "num_key_value_heads")) c->n_kv_heads = c->n_heads;
        if (!json_object_get(t, "head_dim")) c->head_dim = 128;
        c->attention_bias = false;
        rc = get_bool(t, "attention_bias", &c->attention_bias, err, errlen);
        c->o_bias = c->attention_bias;
    }
    if (rc == PRISM_OK && !json_object_get(t, "rope_theta") &&
        !(json_is_object(json_object_get(t, "rope_parameters")) &&
          json_object_get(json_object_get(t, "rope_parameters"), "rope_theta")) &&
        !(json_is_object(json_object_get(t, "rope_scaling")) &&
          json_object_get(json_object_get(t, "rope_scaling"), "rope_theta")))
        c->rope_theta = 500000.0f;
    json_decref(empty);
    if (rc != PRISM_OK) return rc;
    if (c->n_heads % c->n_kv_heads || c->head_dim % 2 || c->head_dim > 512) {
        ERR("config: Qwen3-VL heads %d / %d, head_dim %d unsupported", c->n_heads, c->n_kv_heads, c->head_dim);
        return PRISM_ENOTSUP;
    }
    if (!c->mrope_section[0] && !c->mrope_section[1] && !c->mrope_section[2]) {
        c->mrope_section[0] = 24;   /* Qwen3VLTextRotaryEmbedding's default */
        c->mrope_section[1] = c->mrope_section[2] = 20;
    }
    c->mrope_interleaved = true;    /* Qwen3VLTextRotaryEmbedding interleaves whatever the config says */
    for (int i = 0; i < c->n_layers; i++) c->layer_flags[i] = PRISM_LAYER_ROPE | PRISM_LAYER_QK_RMS;
    return parse_qwenvl_rest(root, c, "Qwen3-VL", parse_qwen3_vision, err, errlen);
}

static int parse_vision(json_t *v, prism_model_config_t *c, char *err, size_t errlen)
{
    /* CLIPVisionConfig defaults when vision_config is a dict; LLaVA's own defaults (ViT-L/14-336)
     * when it is absent. */
    bool absent = !v || json_is_null(v);
    c->v_image_size = absent ? 336 : 224;
    c->v_patch = absent ? 14 : 32;
    c->v_hidden = absent ? 1024 : 768;
    c->v_layers = absent ? 24 : 12;
    c->v_heads = absent ? 16 : 12;
    c->v_intermediate = absent ? 4096 : 3072;
    c->v_eps = 1e-5f;
    c->v_act = PRISM_ACT_QUICK_GELU;
    c->v_num_channels = 3;
    if (absent) return PRISM_OK;
    if (!json_is_object(v)) {
        ERR("config: vision_config must be an object");
        return PRISM_ECORRUPT;
    }
    const char *mt = get_str(v, "model_type");
    if (mt && strcmp(mt, "clip_vision_model") != 0) {
        ERR("config: vision model_type '%s' is not supported (clip_vision_model)", mt);
        return PRISM_ENOTSUP;
    }
    TRY(get_int(v, "image_size", &c->v_image_size, 1, 8192, err, errlen));
    TRY(get_int(v, "patch_size", &c->v_patch, 1, 1024, err, errlen));
    TRY(get_int(v, "hidden_size", &c->v_hidden, 1, 1 << 15, err, errlen));
    TRY(get_int(v, "num_hidden_layers", &c->v_layers, 1, 1024, err, errlen));
    TRY(get_int(v, "num_attention_heads", &c->v_heads, 1, 1024, err, errlen));
    TRY(get_int(v, "intermediate_size", &c->v_intermediate, 1, 1 << 18, err, errlen));
    TRY(get_int(v, "num_channels", &c->v_num_channels, 1, 16, err, errlen));
    TRY(get_float(v, "layer_norm_eps", &c->v_eps, 0.0, 1.0, err, errlen));
    const char *act = get_str(v, "hidden_act");
    if (act && (c->v_act = prism_act_parse(act)) < 0) {
        ERR("config: vision hidden_act '%s' is not supported", act);
        return PRISM_ENOTSUP;
    }
    if (c->v_image_size % c->v_patch) {
        ERR("config: image_size %d is not a multiple of patch_size %d", c->v_image_size, c->v_patch);
        return PRISM_ECORRUPT;
    }
    if (c->v_hidden % c->v_heads || c->v_hidden / c->v_heads > 512) {
        ERR("config: vision hidden_size %d / heads %d unsupported", c->v_hidden, c->v_heads);
        return PRISM_ECORRUPT;
    }
    return PRISM_OK;
}

int prism_model_config_parse(const char *config_json, const char *gen_json, prism_model_config_t *c,
                             char *err, size_t errlen)
{
    json_t *root = NULL, *gen = NULL;
    json_error_t jerr;
    int rc = PRISM_ECORRUPT;
    memset(c, 0, sizeof *c);
    root = json_loads(config_json, JSON_REJECT_DUPLICATES, &jerr);
    if (!root || !json_is_object(root)) {
        ERR("config.json: %s", root ? "not a JSON object" : jerr.text);
        goto fail;
    }
    const char *mt = get_str(root, "model_type");
    json_t *text = json_object_get(root, "text_config");
    bool llama4 = mt && strcmp(mt, "llama4") == 0;
    bool qwen25 = mt && strcmp(mt, "qwen2_5_vl") == 0;
    bool qwen3 = mt && strcmp(mt, "qwen3_vl") == 0;
    bool llava = !llama4 && !qwen25 && !qwen3 && ((mt && strcmp(mt, "llava") == 0) || (text && json_is_object(text)));
    if (mt && !llava && !llama4 && !qwen25 && !qwen3 && strcmp(mt, "llama") != 0 && strcmp(mt, "qwen2") != 0 &&
        strcmp(mt, "mistral") != 0 && strcmp(mt, "llama4_text") != 0) {
        ERR("config.json: model_type '%s' is not supported (llava, llama4, llama4_text, llama, mistral, qwen2, "
            "qwen2_5_vl, qwen3_vl)", mt);
        rc = PRISM_ENOTSUP;
        goto fail;
    }
    snprintf(c->arch, sizeof c->arch, "%s", mt ? mt : (llava ? "llava" : "llama"));
    c->boi_token_id = c->eoi_token_id = -1;
    if (qwen25) {
        if ((rc = parse_qwen25_vl(root, c, err, errlen)) != PRISM_OK) goto fail;
    } else if (qwen3) {
        if ((rc = parse_qwen3_vl(root, c, err, errlen)) != PRISM_OK) goto fail;
    } else if (llama4) {
        if (text && !json_is_null(text) && !json_is_object(text)) {
            ERR("config.json: text_config must be an object");
            goto fail;
        }
        json_t *empty = json_object();
        rc = parse_text(json_is_object(text) ? text : empty, "llama4_text", c, err, errlen);
        json_decref(empty);
        if (rc == PRISM_OK) rc = parse_llama4_vision(json_object_get(root, "vision_config"), c, err, errlen);
        if (rc != PRISM_OK) goto fail;
        c->has_vision = true;
        c->image_token_index = 200092;   /* <|patch|>: image features overwrite these positions */
        c->boi_token_id = 200080;
        c->eoi_token_id = 200081;
        bool tie = false;
        rc = PRISM_ECORRUPT;
        if (get_int(root, "image_token_index", &c->image_token_index, 0, INT32_MAX, err, errlen) ||
            get_int(root, "image_token_id", &c->image_token_index, 0, INT32_MAX, err, errlen) ||
            get_int(root, "boi_token_index", &c->boi_token_id, 0, INT32_MAX, err, errlen) ||
            get_int(root, "eoi_token_index", &c->eoi_token_id, 0, INT32_MAX, err, errlen) ||
            get_bool(root, "tie_word_embeddings", &tie, err, errlen))
            goto fail;
        c->tie_word_embeddings = c->tie_word_embeddings || tie;
        if (c->image_token_index >= c->vocab) {
            ERR("config.json: image_token_index %d outside the vocabulary (%d)", c->image_token_index, c->vocab);
            goto fail;
        }
    } else if (llava) {
        if (text && !json_is_null(text) && !json_is_object(text)) {
            ERR("config.json: text_config must be an object");
            goto fail;
        }
        json_t *t = json_is_object(text) ? text : NULL;
        json_t *empty = json_object();
        rc = parse_text(t ? t : empty, t ? (get_str(t, "model_type") ? get_str(t, "model_type") : "llama") : "llama",
                        c, err, errlen);
        json_decref(empty);
        if (rc != PRISM_OK) goto fail;
        rc = parse_vision(json_object_get(root, "vision_config"), c, err, errlen);
        if (rc != PRISM_OK) goto fail;
        c->has_vision = true;
        c->image_token_index = 32000;
        c->image_seq_length = 576;
        c->v_feature_layer = -2;
        c->v_select_default = true;
        c->proj_act = PRISM_ACT_GELU_ERF;
        c->proj_bias = true;
        rc = PRISM_ECORRUPT;
        if (get_int(root, "image_token_index", &c->image_token_index, 0, INT32_MAX, err, errlen) ||
            get_int(root, "image_token_id", &c->image_token_index, 0, INT32_MAX, err, errlen) ||
            get_int(root, "image_seq_length", &c->image_seq_length, 1, 1 << 20, err, errlen) ||
            get_bool(root, "multimodal_projector_bias", &c->proj_bias, err, errlen))
            goto fail;
        json_t *fl = json_object_get(root, "vision_feature_layer");
        if (fl && !json_is_null(fl)) {
            if (!json_is_integer(fl)) {
                ERR("config.json: vision_feature_layer lists are not supported");
                rc = PRISM_ENOTSUP;
                goto fail;
            }
            json_int_t f = json_integer_value(fl);
            if (f < -c->v_layers - 1 || f > c->v_layers) {
                ERR("config.json: vision_feature_layer %lld out of range", (long long)f);
                goto fail;
            }
            c->v_feature_layer = (int)f;
        }
        const char *strat = get_str(root, "vision_feature_select_strategy");
        if (strat) {
            if (strcmp(strat, "default") == 0) c->v_select_default = true;
            else if (strcmp(strat, "full") == 0) c->v_select_default = false;
            else {
                ERR("config.json: vision_feature_select_strategy '%s' unknown", strat);
                goto fail;
            }
        }
        const char *pa = get_str(root, "projector_hidden_act");
        if (pa && (c->proj_act = prism_act_parse(pa)) < 0) {
            ERR("config.json: projector_hidden_act '%s' is not supported", pa);
            rc = PRISM_ENOTSUP;
            goto fail;
        }
        /* LlavaConfig forwards tie_word_embeddings from either level. */
        bool tie = false;
        if (get_bool(root, "tie_word_embeddings", &tie, err, errlen)) goto fail;
        c->tie_word_embeddings = c->tie_word_embeddings || tie;
        int np = (c->v_image_size / c->v_patch) * (c->v_image_size / c->v_patch);
        int ntok = np + (c->v_select_default ? 0 : 1);
        if (c->image_seq_length != ntok) {
            ERR("config.json: image_seq_length %d does not match %d features per image",
                c->image_seq_length, ntok);
            goto fail;
        }
        if (c->image_token_index >= c->vocab) {
            ERR("config.json: image_token_index %d outside the vocabulary (%d)", c->image_token_index, c->vocab);
            goto fail;
        }
    } else {
        rc = parse_text(root, mt ? mt : "llama", c, err, errlen);
        if (rc != PRISM_OK) goto fail;
        c->image_token_index = -1;
    }
    if (gen_json) {
        gen = json_loads(gen_json, JSON_REJECT_DUPLICATES, &jerr);
        if (!gen || !json_is_object(gen)) {
            ERR("generation_config.json: %s", gen ? "not a JSON object" : jerr.text);
            rc = PRISM_ECORRUPT;
            goto fail;
        }
        rc = get_int(gen, "bos_token_id", &c->bos_token_id, -1, INT32_MAX, err, errlen);
        if (rc == PRISM_OK) rc = get_eos(gen, c, err, errlen);
        if (rc == PRISM_OK) rc = get_int(gen, "pad_token_id", &c->pad_token_id, -1, INT32_MAX, err, errlen);
        if (rc != PRISM_OK) goto fail;
    }
    for (int i = 0; i < c->n_eos; i++)
        if (c->eos_token_ids[i] >= c->vocab) {
            ERR("config: eos id %d outside the vocabulary (%d)", c->eos_token_ids[i], c->vocab);
            rc = PRISM_ECORRUPT;
            goto fail;
        }
    rc = PRISM_OK;
fail:
    json_decref(root);
    json_decref(gen);
    return rc;
}

int prism_model_context_length(const prism_model_config_t *cfg, int64_t requested)
{
    if (requested > 0) return (int)PRISM_MIN(requested, (int64_t)cfg->max_pos);
    return PRISM_MIN(cfg->max_pos, PRISM_MODEL_DEFAULT_CONTEXT);
}

int prism_model_config_load(const char *model_dir, prism_model_config_t *cfg, char *err, size_t errlen)
{
    char path[4096];
    char *text = NULL, *gen = NULL;
    size_t n;
    int rc = prism_path_join(path, sizeof path, model_dir, "config.json");
    if (rc != PRISM_OK) return rc;
    rc = prism_read_file(path, MAX_CONFIG_BYTES, &text, &n);
    if (rc != PRISM_OK) {
        ERR("%s: %s", path, prism_strerror(rc));
        return rc == PRISM_EIO ? PRISM_ENOTFOUND : rc;
    }
    if (strlen(text) != n) {
        ERR("%s: contains NUL bytes", path);
        prism_free(text);
        return PRISM_ECORRUPT;
    }
    if (prism_path_join(path, sizeof path, model_dir, "generation_config.json") == PRISM_OK && prism_file_exists(path)) {
        rc = prism_read_file(path, MAX_CONFIG_BYTES, &gen, &n);
        if (rc != PRISM_OK) {
            ERR("%s: %s", path, prism_strerror(rc));
            prism_free(text);
            return rc;
        }
    }
    rc = prism_model_config_parse(text, gen, cfg, err, errlen);
    prism_free(text);
    prism_free(gen);
    return rc;
}
