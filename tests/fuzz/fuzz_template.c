/* libFuzzer: the chat-template engine (common/template): lexer, parser, renderer and builtins. The
 * input is a template source, optionally followed by a NUL and a JSON messages array to render with
 * (a fixed conversation when absent or invalid). */
#include "fuzz_common.h"
#include "template/template.h"

#include <jansson.h>

static const char MESSAGES[] =
    "[{\"role\":\"system\",\"content\":\"Be brief.\"},"
    "{\"role\":\"user\",\"content\":[{\"type\":\"image\"},{\"type\":\"text\",\"text\":\"What is it?\"}]},"
    "{\"role\":\"assistant\",\"content\":\"A red circle.\",\"tool_calls\":[{\"function\":{\"name\":\"f\",\"arguments\":{\"a\":1}}}]},"
    "{\"role\":\"tool\",\"content\":\"42\"},{\"role\":\"user\",\"content\":null}]";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_init_once();
    size_t src_len = strnlen((const char *)data, size);
    prism_template_t *t = NULL;
    char err[256];
    if (prism_template_compile((const char *)data, src_len, &t, err, sizeof err) != PRISM_OK) {
        FUZZ_ASSERT(t == NULL);
        return 0;
    }
    json_t *msgs = NULL;
    if (src_len + 1 < size) msgs = json_loadb((const char *)data + src_len + 1, size - src_len - 1, 0, NULL);
    if (!json_is_array(msgs)) {
        json_decref(msgs);
        msgs = json_loads(MESSAGES, 0, NULL);
    }
    json_t *tools = json_loads("[{\"type\":\"function\",\"function\":{\"name\":\"f\",\"parameters\":{}}}]", 0, NULL);
    json_t *ctx = prism_template_chat_context(msgs, (size & 1) ? tools : NULL, size & 2, "<s>", "</s>", NULL);
    if (ctx) {
        prism_buf_t out = {0};
        (void)prism_template_render(t, ctx, &out, err, sizeof err);
        prism_buf_free(&out);
        json_decref(ctx);
    }
    json_decref(tools);
    json_decref(msgs);
    prism_template_free(t);
    return 0;
}
