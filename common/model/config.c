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
    if (!type || strcmp(type, "default") == 0) {
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
        if (!(c->rope_high_freq_factor > c->rope_low_freq_factor)) {
            ERR("config: llama3 rope needs high_freq_factor > low_freq_factor");
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

static int parse_text(json_t *t, const char *model_type, prism_model_config_t *c, char *err, size_t errlen)
{
    bool qwen2 = model_type && strcmp(model_type, "qwen2") == 0;
    if (model_type && strcmp(model_type, "llama") != 0 && !qwen2 && strcmp(model_type, "mistral") != 0) {
        ERR("config: text model_type '%s' is not supported (llama, mistral, qwen2)", model_type);
        return PRISM_ENOTSUP;
    }
    /* Defaults of LlamaConfig / Qwen2Config. */
    c->vocab = qwen2 ? 151936 : 32000;
    c->hidden = 4096;
    c->intermediate = qwen2 ? 22016 : 11008;
    c->n_layers = 32;
    c->n_heads = 32;
    c->n_kv_heads = -1;
    c->head_dim = -1;
    c->max_pos = qwen2 ? 32768 : 2048;
    c->rms_eps = 1e-6f;
    c->rope_theta = 10000.0f;
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
    TRY(get_int(t, "max_position_embeddings", &c->max_pos, 1, 1 << 24, err, errlen));
    TRY(get_float(t, "rms_norm_eps", &c->rms_eps, 0.0, 1.0, err, errlen));
    TRY(get_bool(t, "tie_word_embeddings", &c->tie_word_embeddings, err, errlen));
    TRY(get_int(t, "bos_token_id", &c->bos_token_id, -1, INT32_MAX, err, errlen));
    TRY(get_int(t, "pad_token_id", &c->pad_token_id, -1, INT32_MAX, err, errlen));
    TRY(get_eos(t, c, err, errlen));
    if (!qwen2) {
        TRY(get_bool(t, "attention_bias", &c->attention_bias, err, errlen));
        c->o_bias = c->attention_bias;  /* Llama's attention_bias covers o_proj too */
        TRY(get_bool(t, "mlp_bias", &c->mlp_bias, err, errlen));
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
    return PRISM_OK;
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
    bool llava = (mt && strcmp(mt, "llava") == 0) || (text && json_is_object(text));
    if (mt && !llava && strcmp(mt, "llama") != 0 && strcmp(mt, "qwen2") != 0 && strcmp(mt, "mistral") != 0) {
        ERR("config.json: model_type '%s' is not supported (llava, llama, mistral, qwen2)", mt);
        rc = PRISM_ENOTSUP;
        goto fail;
    }
    snprintf(c->arch, sizeof c->arch, "%s", mt ? mt : (llava ? "llava" : "llama"));
    if (llava) {
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
