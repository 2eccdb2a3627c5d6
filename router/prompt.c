/* What a generation request sends to its workers, built from the parsed request: the images
 * (data URL -> file bytes, header checked against the limits, no pixels decoded), the chat
 * template rendered and tokenized (or the completion prompt), each image placeholder expanded to
 * the model's image-token count (recording where each image's span starts), and max_tokens
 * checked against the context. */
#include "router.h"
#include "openai_req.h"
#include "image/image.h"
#include "image/data_url.h"
#include "body_lift.h"

#include <stdio.h>
#include <string.h>
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

/* Builds the chat-template context the way transformers does, with image parts as
 * {"type":"image"} (what HF processors' templates expect). */
static json_t *template_context(router_t *r, const prism_oai_request_t *o)
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

/* Decodes every image part's data URL and checks its header against the limits. Returns an HTTP
 * status (0 = ok) and fills msg. A data URL the HTTP server lifted out of the body while it streamed
 * in (body_lift.h) is already decoded: its buffer is taken as it is (no copy), with the same checks
 * in the same order as for a whole string. */
int router_prompt_load_images(router_t *r, router_prompt_t *p, const prism_oai_request_t *o, prism_http_req_t *h,
                              char *msg, size_t n)
{
    for (int i = 0; i < o->n_messages; i++) {
        const prism_oai_message_t *m = &o->messages[i];
        for (int k = 0; k < m->n_parts; k++) {
            const prism_oai_part_t *part = &m->parts[k];
            if (part->kind != PRISM_OAI_PART_IMAGE) continue;
            int idx = p->n_images;
            const char *mime, *b64;
            size_t mime_len, b64_len;
            int lifted = prism_lift_ref(part->image_url, part->image_url_len);
            if (lifted >= 0) {
                uint8_t *data = NULL;
                size_t len = 0;
                bool bad = false;
                if (!h || prism_http_req_take_image(h, lifted, &data, &len, &mime, &bad) != PRISM_OK) {
                    snprintf(msg, n, "Image %d: only base64 data URLs (data:image/jpeg;base64,... or data:image/png;base64,...) "
                             "are accepted; remote and file URLs are disabled.", idx);
                    return 400;
                }
                p->img[idx] = data;  /* owned by the prompt from here, even when refused below */
                p->n_images++;
                if (!prism_data_url_mime_is_image(mime, strlen(mime))) {
                    snprintf(msg, n, "Image %d: unsupported media type '%.64s'; use image/jpeg or image/png.", idx, mime);
                    return 400;
                }
                if (bad) {
                    snprintf(msg, n, "Image %d: invalid base64 data.", idx);
                    return 400;
                }
                p->img_len[idx] = len;
                if (!data) {
                    snprintf(msg, n, "Image %d: the data is not a valid JPEG or PNG image.", idx);
                    return 400;
                }
                goto probe;
            }
            if (prism_data_url_parse(part->image_url, part->image_url_len, &mime, &mime_len, &b64, &b64_len) != PRISM_OK) {
                snprintf(msg, n, "Image %d: only base64 data URLs (data:image/jpeg;base64,... or data:image/png;base64,...) "
                         "are accepted; remote and file URLs are disabled.", idx);
                return 400;
            }
            if (!prism_data_url_mime_is_image(mime, mime_len)) {
                snprintf(msg, n, "Image %d: unsupported media type '%.*s'; use image/jpeg or image/png.", idx,
                         (int)PRISM_MIN(mime_len, (size_t)64), mime);
                return 400;
            }
            size_t cap = prism_base64_decoded_max(b64_len), len = 0;
            uint8_t *buf = prism_malloc(cap ? cap : 1);
            if (!buf) return 503;
            p->img[idx] = buf;
            p->n_images++;
            if (prism_base64_decode(b64, b64_len, buf, cap, &len) != PRISM_OK) {
                snprintf(msg, n, "Image %d: invalid base64 data.", idx);
                return 400;
            }
            p->img_len[idx] = len;
        probe:;
            const uint8_t *buf_ = p->img[idx];
            size_t len_ = p->img_len[idx];
            prism_image_info_t info;
            if (prism_image_probe(buf_, len_, &info) != PRISM_OK) {
                snprintf(msg, n, "Image %d: the data is not a valid JPEG or PNG image.", idx);
                return 400;
            }
            if ((uint64_t)info.width * (uint64_t)info.height > r->max_image_pixels) {
                r->metrics.refused_limit[PRISM_REFUSE_IMAGE_TOO_LARGE]++;
                snprintf(msg, n, "Image %d is %dx%d pixels; the limit is %llu pixels per image.", idx, info.width,
                         info.height, (unsigned long long)r->max_image_pixels);
                return 400;
            }
            p->img_hash[idx] = XXH3_64bits_withSecret(buf_, len_, r->img_secret, sizeof(r->img_secret));
            p->image_bytes += len_;
        }
    }
    return 0;
}

void router_prompt_release_inputs(prism_oai_request_t *o)
{
    for (int i = 0; i < o->n_messages; i++) {
        prism_oai_message_t *m = &o->messages[i];
        json_t *content = json_object_get(m->raw, "content");
        size_t k;
        json_t *part;
        json_array_foreach(content, k, part) {
            if (json_object_get(part, "image_url")) json_object_set_new(part, "image_url", json_null());
        }
        for (int p = 0; p < m->n_parts; p++)
            if (m->parts[p].kind == PRISM_OAI_PART_IMAGE) {
                m->parts[p].image_url = NULL;
                m->parts[p].image_url_len = 0;
            }
    }
}

int router_prompt_build(router_t *r, router_prompt_t *p, const prism_oai_request_t *o, bool chat, char *msg, size_t n)
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
    /* Expand each image placeholder to image_seq_length copies. */
    size_t n_ph = 0;
    for (size_t i = 0; i < p->n_tokens; i++) n_ph += p->tokens[i] == r->image_token_id;
    if ((int)n_ph != p->n_images) {
        snprintf(msg, n, "The prompt has %zu image placeholder(s) but the request has %d image(s).", n_ph, p->n_images);
        return 400;
    }
    if (n_ph) {
        size_t L = (size_t)r->cfg.image_seq_length, total = p->n_tokens + n_ph * (L - 1);
        if (total > (size_t)r->max_model_len + 1) total = (size_t)r->max_model_len + 1;  /* caught below */
        int32_t *x = prism_malloc(sizeof(int32_t) * (p->n_tokens + n_ph * (L - 1)));
        if (!x) return 503;
        size_t at = 0;
        int img = 0;
        for (size_t i = 0; i < p->n_tokens; i++) {
            if (p->tokens[i] == r->image_token_id) {
                p->img_offset[img++] = (uint32_t)at;   /* the span Prefill carries for this image */
                for (size_t k = 0; k < L; k++) x[at++] = r->image_token_id;
            } else {
                x[at++] = p->tokens[i];
            }
        }
        prism_free(p->tokens);
        p->tokens = x;
        p->n_tokens = at;
        p->cap = at;
    }
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

void router_prompt_free(router_prompt_t *p)
{
    for (int i = 0; i < p->n_images; i++) prism_free(p->img[i]);
    prism_free(p->tokens);
    memset(p, 0, sizeof(*p));
}
