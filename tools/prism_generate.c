/* prism_generate: one process, no sockets — chat template, tokenizer, image decode and
 * preprocessing, vision tower, prefill and greedy decode over a paged KV cache, with the same
 * library code the workers use. The integration tests compare the cluster against it: the
 * disaggregated path (prefill -> KV transfer -> decode) must not change a single token.
 * LLaVA images expand to image_seq_length tokens; Llama-4 images to their processor's tile layout
 * (image/llama4_proc.h), whose <|patch|> positions take the tiles' rows in order.
 *
 *   prism_generate --model-path models/prism-tiny-llava --image cat.jpg --user "What is in the image?"
 * prints {"prompt_tokens":N,"token_ids":[...],"text":"..."}
 */
#include "core/core.h"
#include "core/cli.h"
#include "backend/backend.h"
#include "model/model.h"
#include "kv/kv.h"
#include "sample/sample.h"
#include "tokenizer/tokenizer.h"
#include "template/template.h"
#include "image/image.h"
#include "image/clip.h"
#include "image/llama4_proc.h"

#include <jansson.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char **argv)
{
    const char *model = "models/prism-tiny-llava", *user = "What is in the image?";
    prism_str_list_t images = {0};
    int64_t max_tokens = 32, block_size = 16;
    prism_flag_t flags[] = {
        PRISM_FLAG_STR("model-path", &model, "HF model directory"),
        PRISM_FLAG_STR("user", &user, "User message text"),
        PRISM_FLAG_LIST("image", &images, "Image file(s), placed before the text"),
        PRISM_FLAG_INT("max-tokens", &max_tokens, "Tokens to generate (greedy)"),
        PRISM_FLAG_INT("block-size", &block_size, "KV block size"),
        PRISM_FLAG_END,
    };
    int rc = prism_cli_parse(argc, argv, "prism_generate", "Single-process greedy generation (reference for tests).", flags);
    if (rc) return rc > 0 ? 0 : 2;
    prism_log_init("generate", PRISM_LOG_WARN);
    char err[512] = "", path[1024];
    prism_model_config_t cfg;
    if (prism_model_config_load(model, &cfg, err, sizeof(err))) PRISM_FATAL("config: %s", err);
    prism_tokenizer_t *tok;
    prism_path_join(path, sizeof(path), model, "tokenizer.json");
    if (prism_tokenizer_load(path, &tok, err, sizeof(err))) PRISM_FATAL("tokenizer: %s", err);
    prism_template_t *tmpl;
    char *bos = NULL, *eos = NULL;
    prism_path_join(path, sizeof(path), model, "tokenizer_config.json");
    if (prism_template_load_from_tokenizer_config(path, &tmpl, &bos, &eos, err, sizeof(err))) PRISM_FATAL("template: %s", err);

    /* The context the router builds for content parts [image..., text]. */
    json_t *parts = json_array();
    for (int i = 0; i < images.n; i++) json_array_append_new(parts, json_pack("{s:s}", "type", "image"));
    json_array_append_new(parts, json_pack("{s:s,s:s}", "type", "text", "text", user));
    json_t *msgs = json_pack("[{s:s,s:o}]", "role", "user", "content", parts);
    json_t *ctx = prism_template_chat_context(msgs, NULL, true, bos, eos, NULL);
    prism_buf_t text = {0};
    if (prism_template_render(tmpl, ctx, &text, err, sizeof(err))) PRISM_FATAL("render: %s", err);
    bool has_bos = bos && *bos && !strncmp(text.data, bos, strlen(bos));
    int32_t *ids = NULL;
    size_t n = 0, cap = 0;
    if (prism_tokenizer_encode(tok, text.data, text.len, !has_bos, &ids, &n, &cap)) PRISM_FATAL("encode");

    prism_backend_t *be = prism_backend_cpu_create(1);
    float *emb = NULL;
    uint8_t *mask = NULL;
    size_t H = (size_t)cfg.hidden;
    if (images.n) {
        bool l4 = cfg.vision_arch == PRISM_VISION_LLAMA4;
        prism_llama4_proc_t proc;
        prism_llama4_image_tokens_t it = {0};
        prism_clip_preproc_t pre;
        int32_t placeholder = cfg.image_token_index;
        int max_tiles = 1;
        if (l4) {
            if (prism_llama4_proc_load_dir(model, &proc, err, sizeof(err))) PRISM_FATAL("processor: %s", err);
            it = (prism_llama4_image_tokens_t){
                prism_tokenizer_token_to_id(tok, "<|image_start|>"), prism_tokenizer_token_to_id(tok, "<|image_end|>"),
                prism_tokenizer_token_to_id(tok, "<|tile_x_separator|>"),
                prism_tokenizer_token_to_id(tok, "<|tile_y_separator|>"), prism_tokenizer_token_to_id(tok, "<|image|>"),
                prism_tokenizer_token_to_id(tok, "<|patch|>")};
            placeholder = it.image;
            max_tiles = prism_llama4_max_tiles(&proc);
        } else {
            prism_path_join(path, sizeof(path), model, "preprocessor_config.json");
            if (prism_clip_preproc_load(path, &pre, err, sizeof(err))) PRISM_FATAL("preproc: %s", err);
        }
        prism_vision_t *vis;
        if (prism_vision_load(be, &cfg, model, max_tiles, &vis, err, sizeof(err))) PRISM_FATAL("vision: %s", err);
        size_t S = (size_t)cfg.v_image_size, L = (size_t)cfg.image_seq_length;
        float *pix = prism_xmalloc(sizeof(float) * 3 * S * S * (size_t)max_tiles);
        /* Features of every image, tiles in order: [sum of tiles][L][H]. */
        float *feat = prism_xmalloc(sizeof(float) * L * H * (size_t)max_tiles * (size_t)images.n);
        prism_llama4_grid_t grid[64];
        if (images.n > 64) PRISM_FATAL("at most 64 images");
        size_t rows = 0;
        for (int i = 0; i < images.n; i++) {
            char *data;
            size_t len;
            if (prism_read_file(images.items[i], 256u << 20, &data, &len)) PRISM_FATAL("read %s", images.items[i]);
            prism_image_info_t info;
            if (prism_image_probe((uint8_t *)data, len, &info)) PRISM_FATAL("probe %s", images.items[i]);
            prism_image_decode_opts_t o = {0};  /* full-size decode, as the reference and the encoder's default */
            prism_image_t img;
            if (prism_image_decode((uint8_t *)data, len, &o, &img)) PRISM_FATAL("decode %s", images.items[i]);
            int tiles = 1;
            size_t ws_n;
            void *ws;
            if (l4) {
                if (prism_llama4_grid(&proc, img.w, img.h, &grid[i])) PRISM_FATAL("grid %s", images.items[i]);
                tiles = grid[i].n_tiles;
                ws_n = prism_llama4_preprocess_workspace_bytes(&proc, img.w, img.h);
                ws = prism_xmalloc(ws_n ? ws_n : 1);
                if (prism_llama4_preprocess(&proc, &img, ws, ws_n, pix)) PRISM_FATAL("preprocess");
            } else {
                ws_n = prism_clip_preprocess_workspace_bytes(&pre, img.w, img.h);
                ws = prism_xmalloc(ws_n ? ws_n : 1);
                if (prism_clip_preprocess(&pre, &img, ws, ws_n, pix)) PRISM_FATAL("preprocess");
            }
            if (prism_vision_encode(vis, pix, tiles, feat + rows * H)) PRISM_FATAL("vision encode");
            rows += (size_t)tiles * L;
            prism_free(ws);
            prism_image_free(&img);
            prism_free(data);
        }
        /* Expand placeholders and lay the features over the image tokens, in order. */
        size_t total = n;
        for (int i = 0; i < images.n; i++) total += (l4 ? (size_t)grid[i].n_prompt_tokens : L) - 1;
        int32_t *x = prism_xmalloc(sizeof(int32_t) * total);
        emb = prism_xcalloc(total * H, sizeof(float));
        mask = prism_xcalloc(total, 1);
        size_t o = 0, row = 0;
        int img_i = 0;
        for (size_t i = 0; i < n; i++) {
            if (ids[i] != placeholder || img_i >= images.n) {
                x[o++] = ids[i];
                continue;
            }
            size_t m = L;
            if (l4) {
                if (prism_llama4_expand(&grid[img_i], proc.tokens_per_tile, &it, x + o, total - o, &m)) PRISM_FATAL("expand");
            } else {
                for (size_t k = 0; k < L; k++) x[o + k] = ids[i];
            }
            for (size_t k = o; k < o + m; k++)
                if (x[k] == cfg.image_token_index) {
                    memcpy(emb + k * H, feat + row++ * H, sizeof(float) * H);
                    mask[k] = 1;
                }
            o += m;
            img_i++;
        }
        if (img_i != images.n) PRISM_FATAL("prompt has fewer image placeholders than images");
        if (row != rows) PRISM_FATAL("%zu image rows for %zu image tokens", rows, row);
        prism_free(ids);
        ids = x;
        n = o;
    }

    int max_len = (int)n + (int)max_tokens + 1;
    int n_blocks = (max_len + (int)block_size - 1) / (int)block_size;
    prism_llm_t *llm;
    if (prism_llm_load(be, &cfg, model, (int)n, 1, &llm, err, sizeof(err))) PRISM_FATAL("llm: %s", err);
    prism_kv_cache_t *kv;
    if (prism_kv_cache_create(be, &cfg, n_blocks, (int)block_size, &kv)) PRISM_FATAL("kv");
    int32_t *table = prism_xmalloc(sizeof(int32_t) * (size_t)n_blocks);
    for (int i = 0; i < n_blocks; i++) table[i] = n_blocks - 1 - i;  /* non-trivial block order */
    const int32_t *tables[1] = {table};
    float *logits = prism_xmalloc(sizeof(float) * (size_t)cfg.vocab);
    prism_sampler_t sampler;
    prism_sampler_init(&sampler, cfg.vocab);
    prism_sample_params_t greedy = {0};
    uint64_t rng = 1;

    int32_t seq_start[2] = {0, (int32_t)n}, pos0[1] = {0};
    prism_llm_batch_t b = {.n_seqs = 1, .n_tokens = (int)n, .tokens = ids, .seq_start = seq_start, .pos0 = pos0,
                           .block_tables = tables, .embeds = emb, .embed_mask = mask};
    if (prism_llm_forward(llm, kv, &b, logits)) PRISM_FATAL("prefill");
    json_t *out_ids = json_array();
    prism_detok_t detok;
    prism_detok_init(&detok, tok, true);
    prism_buf_t out = {0};
    int len = (int)n;
    for (int step = 0; step < max_tokens; step++) {
        int32_t t = prism_sample(&sampler, logits, &greedy, &rng);
        json_array_append_new(out_ids, json_integer(t));
        bool eos_hit = false;
        for (int k = 0; k < cfg.n_eos; k++) eos_hit |= t == cfg.eos_token_ids[k];
        if (eos_hit) break;
        prism_detok_push(&detok, t, &out);
        if (step + 1 == max_tokens) break;
        int32_t s2[2] = {0, 1}, p2[1] = {len};
        prism_llm_batch_t d = {.n_seqs = 1, .n_tokens = 1, .tokens = &t, .seq_start = s2, .pos0 = p2, .block_tables = tables};
        if (prism_llm_forward(llm, kv, &d, logits)) PRISM_FATAL("decode");
        len++;
    }
    prism_detok_flush(&detok, &out);
    json_t *res = json_pack("{s:I,s:o,s:s%}", "prompt_tokens", (json_int_t)n, "token_ids", out_ids, "text",
                            out.data ? out.data : "", out.len);
    char *s = json_dumps(res, JSON_COMPACT);
    printf("%s\n", s);
    free(s);
    return 0;
}
