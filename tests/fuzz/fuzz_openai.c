/* libFuzzer: OpenAI request parsing (router/openai_req.c) on arbitrary bodies. The first byte picks
 * chat or completions; the rest is the JSON body. A parsed request is also written back out through
 * the response writers the router uses, with the request's own strings. */
#include "fuzz_common.h"
#include "openai_req.h"
#include "openai_write.h"
#include "core/utf8.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1) return 0;
    fuzz_init_once();
    bool chat = data[0] & 1;
    prism_oai_request_t r;
    prism_oai_error_t err;
    prism_oai_parse_opts_t o = {.max_images = (data[0] >> 1) & 7};
    if (prism_oai_parse((const char *)data + 1, size - 1, chat, &o, &r, &err) != PRISM_OK) {
        FUZZ_ASSERT(err.status >= 400 && err.status < 600);
        FUZZ_ASSERT(memchr(err.message, 0, sizeof err.message) != NULL);
        return 0;
    }
    prism_oai_resp_meta_t m;
    prism_buf_t b = {0};
    if (prism_oai_resp_meta_init(&m, chat, r.model ? r.model : "m") == PRISM_OK) {
        const char *text = r.prompt ? r.prompt : "";
        size_t len = r.prompt ? r.prompt_len : 0;
        prism_oai_usage_t u = {.prompt_tokens = 1, .completion_tokens = 2, .cached_tokens = -1};
        if (chat) prism_oai_write_chat_response(&b, &m, text, len, NULL, "stop", &u);
        else prism_oai_write_completion_response(&b, &m, text, len, NULL, "length", &u);
        for (int i = 0; i < r.n_stop; i++) prism_json_string(&b, r.stop[i], r.stop_len[i]);
        prism_oai_resp_meta_free(&m);
    }
    prism_buf_free(&b);
    prism_oai_request_free(&r);
    return 0;
}
