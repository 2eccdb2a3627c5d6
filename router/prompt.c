/* What a generation request sends to its workers, built from the parsed request: the images
 * (data URL -> file bytes, header checked against the limits, no pixels decoded), the chat
 * template rendered and tokenized (or the completion prompt), each image placeholder expanded
 * (recording each image's span), and max_tokens checked against the context.
 *
 * Expansion: LLaVA repeats the image token image_seq_length times. Llama-4 replaces <|image|> with
 * its processor's layout for that image's tile grid (prism_llama4_grid from the header's width and
 * height, prism_llama4_expand): <|image_start|>, tokens_per_tile <|patch|> per local tile with
 * tile separators between them, <|image|>, the global tile's patches, <|image_end|>. The span
 * then holds separators too; the prefill worker lays the encoder's rows over the span's
 * <|patch|> positions in order, and checks that their count equals the rows it received.
 * Qwen-VL repeats <|image_pad|> once per LM token of the image at native resolution (smart_resize
 * of the header's width and height: prism_qwenvl_grid); the span is the pads, with the image's
 * LM-token grid, from which the prefill worker derives the M-RoPE positions. */
#include "router.h"
#include "openai_req.h"
#include "image/image.h"
#include "image/data_url.h"
#include "body_lift.h"
#include "fetch.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <xxhash.h>

/* Tool-call arguments in assistant messages arrive as JSON text (OpenAI's format); tool-use chat
 * templates expect objects, so text that parses becomes the object (as vLLM does before it
 * renders). */
void router_prompt_tool_arguments_as_objects(json_t *msg)
{
    json_t *calls = json_object_get(msg, "tool_calls");
    size_t i;
    json_t *call;
    json_array_foreach(calls, i, call) {
        json_t *fn = json_object_get(call, "function");
        json_t *args = json_object_get(fn, "arguments");
        if (!json_is_string(args)) continue;
        json_t *parsed = json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_ANY, NULL);
        if (parsed) json_object_set_new(fn, "arguments", parsed);
    }
}

/* A message as the chat template sees it, in place: tool-call arguments as objects (assistant), and
 * each image part, whatever its form ("image_url", "image"), as {"type":"image"}, what HF
 * processors' templates render as the image placeholder. /tokenize renders raw messages through
 * this; the chat path builds the same parts from the parsed request (template_context). */
void router_prompt_template_message(json_t *msg)
{
    json_t *role = json_object_get(msg, "role");
    if (json_is_string(role) && !strcmp(json_string_value(role), "assistant")) router_prompt_tool_arguments_as_objects(msg);
    json_t *content = json_object_get(msg, "content");
    size_t i;
    json_t *part;
    json_array_foreach(content, i, part) {
        const char *type = json_string_value(json_object_get(part, "type"));
        if (type && (!strcmp(type, "image_url") || !strcmp(type, "image")))
            json_array_set_new(content, i, json_pack("{s:s}", "type", "image"));
    }
}

/* Builds the chat-template context the way transformers does, with image parts as
 * {"type":"image"} (what HF processors' templates expect). */
static json_t *template_context(const router_t *r, const prism_oai_request_t *o)
{
    json_t *msgs = json_array();
    for (int i = 0; i < o->n_messages; i++) {
        const prism_oai_message_t *m = &o->messages[i];
        json_t *c = json_deep_copy(m->raw);
        if (!strcmp(m->role, "assistant")) router_prompt_tool_arguments_as_objects(c);
        if (!m->content_is_string && !m->content_is_null) {
            json_t *parts = json_array();
            for (int k = 0; k < m->n_parts; k++) {
                const prism_oai_part_t *p = &m->parts[k];
                if (p->kind == PRISM_OAI_PART_IMAGE)
                    json_array_append_new(parts, json_pack("{s:s}", "type", "image"));
                else
                    json_array_append_new(parts, json_pack("{s:s,s:s%}", "type", "text", "text", p->text, p->text_len));
            }
            json_object_set_new(c, "content", parts);
        }
        json_array_append_new(msgs, c);
    }
    json_t *kw = json_object_get(o->root, "chat_template_kwargs");
    json_t *ctx = prism_template_chat_context(msgs, json_object_get(o->root, "tools"), o->add_generation_prompt,
                                              r->bos_token, r->eos_token, json_is_object(kw) ? kw : NULL);
    json_decref(msgs);
    return ctx;
}

int router_llama4_init(router_t *r, const char *model_dir)
{
    char err[512] = "";
    if (prism_llama4_proc_load_dir(model_dir, &r->l4proc, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("Llama-4 image processor: %s", err);
        return PRISM_EINVAL;
    }
    if (r->l4proc.tokens_per_tile != r->cfg.image_seq_length) {
        PRISM_ERROR("Llama-4: the processor gives %d tokens per tile, the vision config %d", r->l4proc.tokens_per_tile,
                    r->cfg.image_seq_length);
        return PRISM_EINVAL;
    }
    static const char *const names[] = {"<|image_start|>", "<|image_end|>", "<|tile_x_separator|>",
                                        "<|tile_y_separator|>", "<|image|>", "<|patch|>"};
    int32_t ids[6];
    for (int i = 0; i < 6; i++) {
        ids[i] = prism_tokenizer_token_to_id(r->tok, names[i]);
        if (ids[i] < 0 || ids[i] >= r->cfg.vocab) {
            PRISM_ERROR("Llama-4: the tokenizer has no %s token within the model's vocabulary", names[i]);
            return PRISM_EINVAL;
        }
    }
    r->l4ids = (prism_llama4_image_tokens_t){.image_start = ids[0], .image_end = ids[1], .tile_x = ids[2],
                                             .tile_y = ids[3], .image = ids[4], .patch = ids[5]};
    /* The rows land on config.json's image token; the processor writes <|patch|>: they must agree. */
    if (ids[5] != r->cfg.image_token_index || (r->cfg.boi_token_id >= 0 && ids[0] != r->cfg.boi_token_id) ||
        (r->cfg.eoi_token_id >= 0 && ids[1] != r->cfg.eoi_token_id)) {
        PRISM_ERROR("Llama-4: tokenizer ids <|patch|> %d, <|image_start|> %d, <|image_end|> %d disagree with "
                    "config.json (image_token_index %d, boi %d, eoi %d)", ids[5], ids[0], ids[1],
                    r->cfg.image_token_index, r->cfg.boi_token_id, r->cfg.eoi_token_id);
        return PRISM_EINVAL;
    }
    r->llama4 = true;
    r->image_token_id = ids[4];   /* the chat template writes <|image|> once per image */
    return PRISM_OK;
}

int router_qwenvl_init(router_t *r, const char *model_dir)
{
    char err[512] = "";
    if (prism_qwenvl_proc_load_dir(model_dir, &r->qwproc, err, sizeof(err)) != PRISM_OK) {
        PRISM_ERROR("Qwen-VL image processor: %s", err);
        return PRISM_EINVAL;
    }
    if (r->qwproc.patch != r->cfg.v_patch || r->qwproc.merge != r->cfg.v_merge) {
        PRISM_ERROR("Qwen-VL: the processor's patch %d / merge %d disagree with the vision config (%d / %d)",
                    r->qwproc.patch, r->qwproc.merge, r->cfg.v_patch, r->cfg.v_merge);
        return PRISM_EINVAL;
    }
    static const char *const names[] = {"<|image_pad|>", "<|vision_start|>", "<|vision_end|>"};
    const int want[3] = {r->cfg.image_token_index, r->cfg.boi_token_id, r->cfg.eoi_token_id};
    for (int i = 0; i < 3; i++) {
        int32_t id = prism_tokenizer_token_to_id(r->tok, names[i]);
        if (id < 0 || id != want[i]) {
            PRISM_ERROR("Qwen-VL: the tokenizer's %s is %d, config.json says %d", names[i], id, want[i]);
            return PRISM_EINVAL;
        }
    }
    r->qwenvl = true;
    r->image_token_id = r->cfg.image_token_index;   /* the template writes one pad per image */
    return PRISM_OK;
}

int router_image_check(const router_t *r, int idx, const char *mime, size_t mime_len, bool bad, const uint8_t *data,
                       size_t len, bool complete, prism_image_info_t *info, uint64_t *refused, char *msg, size_t n)
{
    if (mime && !prism_data_url_mime_is_image(mime, mime_len)) {
        snprintf(msg, n, "Image %d: unsupported media type '%.*s'; use image/jpeg or image/png.", idx,
                 (int)PRISM_MIN(mime_len, (size_t)64), mime);
        return 400;
    }
    if (bad) {
        snprintf(msg, n, "Image %d: invalid base64 data.", idx);
        return 400;
    }
    if (len > r->max_image_bytes) {   /* more bytes only make it larger */
        refused[PRISM_REFUSE_IMAGE_TOO_LARGE]++;
        snprintf(msg, n, "Image %d is larger than the limit of %llu bytes per image.", idx,
                 (unsigned long long)r->max_image_bytes);
        return 400;
    }
    if (!complete && len == 0) return ROUTER_IMAGE_MORE;
    int rc = data ? prism_image_probe(data, len, info) : PRISM_ECORRUPT;
    /* On a prefix, ECORRUPT may be a header cut short; every other answer reads only bytes already
     * in, so more bytes cannot change it. */
    if (rc == PRISM_ECORRUPT && !complete) return ROUTER_IMAGE_MORE;
    if (rc != PRISM_OK) {
        snprintf(msg, n, "Image %d: the data is not a valid JPEG or PNG image.", idx);
        return 400;
    }
    if ((uint64_t)info->width * (uint64_t)info->height > r->max_image_pixels) {
        refused[PRISM_REFUSE_IMAGE_TOO_LARGE]++;
        snprintf(msg, n, "Image %d is %dx%d pixels; the limit is %llu pixels per image.", idx, info->width,
                 info->height, (unsigned long long)r->max_image_pixels);
        return 400;
    }
    return complete ? 0 : ROUTER_IMAGE_MORE;   /* the bytes may still run past the limit */
}

/* Whether an image URL is an inline data: URL (scheme compared as URLs compare schemes). */
static bool is_data_url(const char *url, size_t len)
{
    return len >= 5 && !strncasecmp(url, "data:", 5);
}

/* Decodes every image part's data URL and checks it (router_image_check). Returns an HTTP status
 * (0 = ok) and fills msg. A data URL the HTTP server lifted out of the body while it streamed in
 * (body_lift.h) is already decoded: its buffer is read where it is (router_prompt_take_images makes
 * it the prompt's on the loop thread), never copied. Any other URL is noted for url_images.c, which
 * fetches it on the loop: the fetcher's rules (fetch_policy.h) judge it there, with the rule that
 * refused it named in the answer and counted in prism:image_fetch_refused_total. */
int router_prompt_load_images(const router_t *r, router_prompt_t *p, const prism_oai_request_t *o,
                              const prism_http_req_t *h, uint64_t *refused, char *msg, size_t n)
{
    for (int i = 0; i < o->n_messages; i++) {
        const prism_oai_message_t *m = &o->messages[i];
        for (int k = 0; k < m->n_parts; k++) {
            const prism_oai_part_t *part = &m->parts[k];
            if (part->kind != PRISM_OAI_PART_IMAGE) continue;
            int idx = p->n_images;
            const char *mime, *b64;
            size_t mime_len, b64_len, len = 0;
            const uint8_t *data = NULL;
            bool bad = false;
            int lifted = prism_lift_ref(part->image_url, part->image_url_len);
            if (lifted >= 0) {
                if (!h || prism_http_req_peek_image(h, lifted, &data, &len, &mime, &bad) != PRISM_OK) goto not_data_url;
                mime_len = strlen(mime);
                for (int j = 0; j < idx; j++)
                    if (p->img_lift[j] == lifted + 1) goto not_data_url;   /* one lifted image, one part */
                p->img_lift[idx] = lifted + 1;  /* the lifter's until taken */
            } else if (!is_data_url(part->image_url, part->image_url_len) && r->fetch_urls) {
                p->img_url[idx] = part->image_url;
                p->img_url_len[idx] = part->image_url_len;
                p->n_urls++;
                p->n_images++;
                continue;
            } else {
                if (prism_data_url_parse(part->image_url, part->image_url_len, &mime, &mime_len, &b64, &b64_len) != PRISM_OK)
                    goto not_data_url;
                if (prism_data_url_mime_is_image(mime, mime_len)) {  /* else refused below, undecoded */
                    size_t cap = prism_base64_decoded_max(b64_len);
                    uint8_t *buf = prism_malloc(cap ? cap : 1);
                    if (!buf) return 503;
                    bad = prism_base64_decode(b64, b64_len, buf, cap, &len) != PRISM_OK;
                    data = buf;
                }
            }
            p->img[idx] = (uint8_t *)data;  /* the prompt's from here (once taken), even when refused below */
            p->img_len[idx] = len;
            p->n_images++;
            prism_image_info_t info;
            int st = router_image_check(r, idx, mime, mime_len, bad, data, len, true, &info, refused, msg, n);
            if (st) return st;
            p->img_w[idx] = info.width;
            p->img_h[idx] = info.height;
            p->img_hash[idx] = XXH3_64bits_withSecret(data, len, r->img_secret, sizeof(r->img_secret));
            p->image_bytes += len;
            continue;
        not_data_url:
            if (r->fetch_urls)
                snprintf(msg, n, "Image %d: a data URL must be base64 (data:image/jpeg;base64,... or "
                         "data:image/png;base64,...).", idx);
            else
                snprintf(msg, n, "Image %d: only base64 data URLs (data:image/jpeg;base64,... or "
                         "data:image/png;base64,...) are accepted; remote and file URLs are disabled.", idx);
            return 400;
        }
    }
    return 0;
}

void router_prompt_take_images(router_prompt_t *p, prism_http_req_t *h)
{
    for (int i = 0; i < p->n_images; i++) {
        if (!p->img_lift[i]) continue;
        uint8_t *data = NULL;
        size_t len = 0;
        int rc = prism_http_req_take_image(h, p->img_lift[i] - 1, &data, &len, NULL, NULL);
        PRISM_ASSERT(rc == PRISM_OK && data == p->img[i] && len == p->img_len[i]);
        (void)rc;
        p->img_lift[i] = 0;
    }
    /* Held once: the router's copy for a retry and the frames ZeroMQ sends are the same bytes.
     * Without memory for the small record an image stays owned here and is sent as a copy. */
    for (int i = 0; i < p->n_images; i++)   /* a fetched image is shared already (img_blob) */
        if (p->img[i] && !p->img_ref[i] && !p->img_blob[i]) p->img_ref[i] = prism_shared_take(p->img[i], p->img_len[i]);
}

/* The prompt's tokens as the client gave them: the rendered chat template, the completion prompt's
 * text, or its token ids. Returns 0 or an HTTP status with msg filled. */
static int prompt_tokens(const router_t *r, router_prompt_t *p, const prism_oai_request_t *o, bool chat, char *msg,
                         size_t n)
{
    int rc;
    if (chat) {
        json_t *ctx = template_context(r, o);
        prism_buf_t text = {0};
        char err[256] = "";
        rc = ctx ? prism_template_render(r->tmpl, ctx, &text, err, sizeof(err)) : PRISM_EINVAL;
        json_decref(ctx);
        if (rc != PRISM_OK) {
            prism_buf_free(&text);
            snprintf(msg, n, "Chat template error: %s", err[0] ? err : prism_strerror(rc));
            return 400;
        }
        /* Add BOS unless the template already wrote it (HF processors add special tokens). */
        bool has_bos = r->bos_token && *r->bos_token && text.data &&
                       !strncmp(text.data, r->bos_token, strlen(r->bos_token));
        rc = prism_tokenizer_encode(r->tok, text.data ? text.data : "", text.len, !has_bos, &p->tokens, &p->n_tokens,
                                    &p->cap);
        prism_buf_free(&text);
    } else if (o->prompt_token_ids) {
        p->tokens = prism_malloc(sizeof(int32_t) * (size_t)PRISM_MAX(o->n_prompt_token_ids, 1));
        if (!p->tokens) return 503;
        for (int i = 0; i < o->n_prompt_token_ids; i++) {
            if (o->prompt_token_ids[i] < 0 || o->prompt_token_ids[i] >= r->cfg.vocab) {
                snprintf(msg, n, "Token id %d is out of vocabulary.", o->prompt_token_ids[i]);
                return 400;
            }
            p->tokens[i] = o->prompt_token_ids[i];
        }
        p->n_tokens = (size_t)o->n_prompt_token_ids;
        rc = PRISM_OK;
    } else {
        rc = prism_tokenizer_encode(r->tok, o->prompt ? o->prompt : "", o->prompt_len, true, &p->tokens,
                                    &p->n_tokens, &p->cap);
    }
    if (rc != PRISM_OK) {
        snprintf(msg, n, "The prompt could not be tokenized: %s", prism_strerror(rc));
        return 400;
    }
    return 0;
}

/* Expands each image placeholder (router_prompt_tokens counted one per image): its span's length
 * first (LLaVA: image_seq_length; Llama-4: the image's tile layout), then the tokens. Returns 0 or an
 * HTTP status with msg filled. */
static int expand_images(const router_t *r, router_prompt_t *p, char *msg, size_t n)
{
    size_t n_ph = (size_t)p->n_images;
    if (n_ph) {
        prism_llama4_grid_t grid[ROUTER_MAX_IMAGES];
        size_t total = p->n_tokens - n_ph;
        for (int k = 0; k < p->n_images; k++) {
            if (r->llama4) {
                if (prism_llama4_grid(&r->l4proc, p->img_w[k], p->img_h[k], &grid[k]) != PRISM_OK) {
                    snprintf(msg, n, "Image %d: %dx%d pixels cannot be tiled.", k, p->img_w[k], p->img_h[k]);
                    return 400;
                }
                p->img_span[k] = (uint32_t)grid[k].n_prompt_tokens;
            } else if (r->qwenvl) {
                prism_qwenvl_grid_t g;
                int64_t mn = p->max_pixels ? p->min_pixels : r->qwproc.min_pixels;
                int64_t mx = p->max_pixels ? p->max_pixels : r->qwproc.max_pixels;
                if (prism_qwenvl_grid_px(&r->qwproc, mn, mx, p->img_w[k], p->img_h[k], &g) != PRISM_OK) {
                    snprintf(msg, n, "Image %d: %dx%d pixels cannot be resized for the model (aspect ratio above 200).",
                             k, p->img_w[k], p->img_h[k]);
                    return 400;
                }
                p->img_span[k] = (uint32_t)g.n_tokens;
                p->img_rows[k] = (uint32_t)g.tok_h;
                p->img_cols[k] = (uint32_t)g.tok_w;
            } else {
                p->img_span[k] = (uint32_t)r->cfg.image_seq_length;
            }
            total += p->img_span[k];
        }
        if (total >= (size_t)r->max_model_len) {   /* before allocating for it */
            snprintf(msg, n, "Input length (%zu) exceeds model's maximum context length (%d).", total, r->max_model_len);
            return 400;
        }
        int32_t *x = prism_malloc(sizeof(int32_t) * total);
        if (!x) return 503;
        size_t at = 0;
        int img = 0;
        for (size_t i = 0; i < p->n_tokens; i++) {
            if (p->tokens[i] != r->image_token_id) {
                x[at++] = p->tokens[i];
                continue;
            }
            p->img_offset[img] = (uint32_t)at;   /* the span Prefill carries for this image */
            if (r->llama4) {
                size_t m = 0;
                int rc2 = prism_llama4_expand(&grid[img], r->l4proc.tokens_per_tile, &r->l4ids, x + at, total - at, &m);
                PRISM_ASSERT(rc2 == PRISM_OK && m == p->img_span[img]);
                at += m;
            } else {
                for (uint32_t k = 0; k < p->img_span[img]; k++) x[at++] = r->image_token_id;
            }
            img++;
        }
        PRISM_ASSERT(at == total);
        prism_free(p->tokens);
        p->tokens = x;
        p->n_tokens = at;
        p->cap = at;
    }
    return 0;
}

int router_prompt_tokens(const router_t *r, router_prompt_t *p, const prism_oai_request_t *o, bool chat, char *msg,
                         size_t n)
{
    int status = prompt_tokens(r, p, o, chat, msg, n);
    if (status) return status;
    size_t n_ph = 0;
    for (size_t i = 0; i < p->n_tokens; i++) n_ph += p->tokens[i] == r->image_token_id;
    if ((int)n_ph != p->n_images) {   /* before any image by URL is downloaded */
        snprintf(msg, n, "The prompt has %zu image placeholder(s) but the request has %d image(s).", n_ph, p->n_images);
        return 400;
    }
    return 0;
}

int router_prompt_build(const router_t *r, router_prompt_t *p, const prism_oai_request_t *o, bool chat, char *msg, size_t n)
{
    int status = router_prompt_tokens(r, p, o, chat, msg, n);
    return status ? status : router_prompt_finish(r, p, o, msg, n);
}

/* mm_processor_kwargs (Qwen-VL): this request's min_pixels / max_pixels, within the processor's
 * max_pixels (what the encoder's preprocessing and prefill's embedding pool are planned for; the
 * encoder still refuses an image beyond its --max-image-tokens with a 400). Images processed with
 * other limits are other embeddings: their cache key (img_hash, the encoders' cache and early jobs)
 * covers the limits. */
static int mm_kwargs(const router_t *r, router_prompt_t *p, const prism_oai_request_t *o, char *msg, size_t n)
{
    if (o->mm_min_pixels < 0 && o->mm_max_pixels < 0) return 0;
    if (!r->qwenvl) {
        snprintf(msg, n, "mm_processor_kwargs min_pixels / max_pixels apply to Qwen-VL models only.");
        return 400;
    }
    int64_t mn = o->mm_min_pixels >= 0 ? o->mm_min_pixels : r->qwproc.min_pixels;
    int64_t mx = o->mm_max_pixels >= 0 ? o->mm_max_pixels : r->qwproc.max_pixels;
    if (mx > r->qwproc.max_pixels) {
        snprintf(msg, n, "mm_processor_kwargs: max_pixels %lld exceeds the model's max_pixels (%lld).", (long long)mx,
                 (long long)r->qwproc.max_pixels);
        return 400;
    }
    if (mn > mx) {
        snprintf(msg, n, "mm_processor_kwargs: min_pixels %lld exceeds max_pixels %lld.", (long long)mn, (long long)mx);
        return 400;
    }
    p->min_pixels = mn;
    p->max_pixels = mx;
    if (!p->mm_keyed) {
        for (int k = 0; k < p->n_images; k++) {
            uint64_t key[3] = {p->img_hash[k], (uint64_t)mn, (uint64_t)mx};
            p->img_hash[k] = XXH3_64bits_withSecret(key, sizeof key, r->img_secret, sizeof(r->img_secret));
        }
        p->mm_keyed = true;
    }
    return 0;
}

int router_prompt_finish(const router_t *r, router_prompt_t *p, const prism_oai_request_t *o, char *msg, size_t n)
{
    int status = mm_kwargs(r, p, o, msg, n);
    if (!status) status = expand_images(r, p, msg, n);
    if (status) return status;
    if (p->n_tokens == 0) {
        snprintf(msg, n, "The prompt is empty.");
        return 400;
    }
    if (p->n_tokens >= (size_t)r->max_model_len) {
        snprintf(msg, n, "Input length (%zu) exceeds model's maximum context length (%d).", p->n_tokens,
                 r->max_model_len);
        return 400;
    }
    int64_t room = r->max_model_len - (int64_t)p->n_tokens;
    if (o->max_tokens < 0) {
        p->max_tokens = (int)room;
    } else if (o->max_tokens > room) {
        snprintf(msg, n, "This model's maximum context length is %d tokens. However, you requested %lld tokens "
                 "(%zu in the messages, %lld in the completion). Please reduce the length of the messages or completion.",
                 r->max_model_len, (long long)(o->max_tokens + (int64_t)p->n_tokens), p->n_tokens,
                 (long long)o->max_tokens);
        return 400;
    } else {
        p->max_tokens = (int)o->max_tokens;
    }
    return 0;
}

void router_prompt_drop_image(router_prompt_t *p, int i)
{
    if (p->img_blob[i]) prism_fetch_blob_unref(p->img_blob[i]);   /* the fetcher's buffer: our reference */
    else if (p->img_ref[i]) prism_shared_unref(p->img_ref[i]);     /* frames in flight keep theirs */
    else if (!p->img_lift[i]) prism_free(p->img[i]);              /* else still the lifter's */
    p->img_blob[i] = NULL;
    p->img_ref[i] = NULL;
    p->img[i] = NULL;
}

static void release_blob(void *data, void *hint)
{
    (void)data;
    prism_fetch_blob_unref(hint);   /* atomic: ZeroMQ's I/O thread may drop the last reference */
}

static void release_shared(void *data, void *hint)
{
    (void)data;
    prism_shared_unref(hint);       /* the same */
}

prism_frame_t router_prompt_image_frame(const router_prompt_t *p, int i)
{
    prism_frame_t f = {p->img[i], p->img_len[i], NULL, NULL};
    if (p->img_blob[i]) {
        f.release = release_blob;
        f.hint = prism_fetch_blob_ref(p->img_blob[i]);
    } else if (p->img_ref[i]) {
        f.release = release_shared;
        f.hint = prism_shared_ref(p->img_ref[i]);
    }
    return f;
}

void router_prompt_free(router_prompt_t *p)
{
    for (int i = 0; i < p->n_images; i++) router_prompt_drop_image(p, i);
    prism_free(p->tokens);
    memset(p, 0, sizeof(*p));
}
