/* Llama-4 prompts end to end on the router's side, against transformers (tests/data/template/
 * llama4_goldens.json, tools/gen_llama4_goldens.py): Llama-4's chat template (loaded from the tiny
 * checkpoint's tokenizer_config.json the way the router loads it) renders byte-identically for
 * text, system, multi-turn, image, tool and tool-call conversations; the Llama-4 style tokenizer
 * gives HF's ids for the rendered text (o200k split regex, special tokens); and expanding every
 * <|image|> with the tile grid computed from the image's width and height alone
 * (prism_llama4_grid + prism_llama4_expand) gives exactly Llama4Processor's input_ids. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image/llama4_proc.h"
#include "template/template.h"
#include "tokenizer/tokenizer.h"

static char model_dir[1024];
static json_t *goldens;
static prism_tokenizer_t *tok;

static int setup(void **state)
{
    const char *src = getenv("PRISM_SOURCE_DIR");
    if (!src || !*src) src = PRISM_SOURCE_DIR;
    snprintf(model_dir, sizeof model_dir, "%s/tests/data/model/llama4_tiny", src);
    char path[1200], err[256];
    snprintf(path, sizeof path, "%s/tests/data/template/llama4_goldens.json", src);
    json_error_t jerr;
    goldens = json_load_file(path, 0, &jerr);
    if (!goldens) {
        fprintf(stderr, "%s: %s\n", path, jerr.text);
        return -1;
    }
    snprintf(path, sizeof path, "%s/tokenizer.json", model_dir);
    if (prism_tokenizer_load(path, &tok, err, sizeof err) != PRISM_OK) {
        fprintf(stderr, "%s: %s\n", path, err);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    prism_tokenizer_free(tok);
    json_decref(goldens);
    return 0;
}

static bool ids_equal(const char *what, const char *name, const int32_t *got, size_t n, json_t *want)
{
    bool ok = n == json_array_size(want);
    size_t i = 0;
    for (; ok && i < n; i++) ok = got[i] == (int32_t)json_integer_value(json_array_get(want, i));
    if (!ok) {
        size_t k = 0;
        while (k < n && k < json_array_size(want) && got[k] == (int32_t)json_integer_value(json_array_get(want, k))) k++;
        fprintf(stderr, "%s %s: %zu ids vs HF %zu, first difference at %zu\n", name, what, n, json_array_size(want), k);
    }
    return ok;
}

static void test_llama4_prompts(void **state)
{
    char path[1200], err[512];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", model_dir);
    prism_template_t *t = NULL;
    char *bos = NULL, *eos = NULL;
    int rc = prism_template_load_from_tokenizer_config(path, &t, &bos, &eos, err, sizeof err);
    if (rc) fail_msg("%s: %s", path, err);
    json_t *tj = json_array_get(json_object_get(goldens, "templates"), 0);
    /* The checkpoint's template is the one the goldens were rendered from. */
    assert_string_equal(json_string_value(json_object_get(tj, "bos_token")), bos);
    assert_string_equal(json_string_value(json_object_get(tj, "eos_token")), eos);

    prism_llama4_proc_t proc;
    rc = prism_llama4_proc_load_dir(model_dir, &proc, err, sizeof err);
    if (rc) fail_msg("%s", err);
    json_t *sp = json_object_get(goldens, "special_tokens");
    prism_llama4_image_tokens_t it = {
        .image_start = prism_tokenizer_token_to_id(tok, "<|image_start|>"),
        .image_end = prism_tokenizer_token_to_id(tok, "<|image_end|>"),
        .tile_x = prism_tokenizer_token_to_id(tok, "<|tile_x_separator|>"),
        .tile_y = prism_tokenizer_token_to_id(tok, "<|tile_y_separator|>"),
        .image = prism_tokenizer_token_to_id(tok, "<|image|>"),
        .patch = prism_tokenizer_token_to_id(tok, "<|patch|>"),
    };
    assert_int_equal(it.patch, json_integer_value(json_object_get(sp, "<|patch|>")));
    assert_int_equal(it.image, json_integer_value(json_object_get(sp, "<|image|>")));
    assert_true(prism_tokenizer_is_special(tok, it.image_start));

    int failures = 0, n_images = 0;
    size_t i;
    json_t *cj;
    json_array_foreach(json_object_get(tj, "cases"), i, cj) {
        const char *name = json_string_value(json_object_get(cj, "name"));
        json_t *tools = json_object_get(cj, "tools");
        json_t *ctx = prism_template_chat_context(json_object_get(cj, "messages"), json_is_null(tools) ? NULL : tools,
                                                  json_is_true(json_object_get(cj, "add_generation_prompt")), bos, eos,
                                                  json_object_get(cj, "extra"));
        assert_non_null(ctx);
        prism_buf_t out = {0};
        rc = prism_template_render(t, ctx, &out, err, sizeof err);
        json_decref(ctx);
        json_t *exp = json_object_get(cj, "expected");
        if (rc || out.len != json_string_length(exp) || memcmp(out.data, json_string_value(exp), out.len)) {
            fprintf(stderr, "%s: render %s\n", name, rc ? err : "differs from transformers");
            failures++;
            prism_buf_free(&out);
            continue;
        }
        int32_t *ids = NULL;
        size_t n = 0, cap = 0;
        assert_int_equal(prism_tokenizer_encode(tok, out.data, out.len, false, &ids, &n, &cap), PRISM_OK);
        prism_buf_free(&out);
        failures += !ids_equal("token ids", name, ids, n, json_object_get(cj, "token_ids"));
        json_t *imgs = json_object_get(cj, "images");
        if (json_array_size(imgs)) {
            /* Expand each <|image|> in order from (width, height) alone, as the router will. */
            size_t total = 0, k = 0;
            int32_t *full = prism_malloc(sizeof(int32_t) * (n + 8192));
            assert_non_null(full);
            for (size_t j = 0; j < n; j++) {
                if (ids[j] != it.image) {
                    full[total++] = ids[j];
                    continue;
                }
                json_t *im = json_array_get(imgs, k);
                assert_non_null(im);
                prism_llama4_grid_t g;
                int w = (int)json_integer_value(json_object_get(im, "w")), h = (int)json_integer_value(json_object_get(im, "h"));
                assert_int_equal(prism_llama4_grid(&proc, w, h, &g), PRISM_OK);
                json_t *grid = json_array_get(json_object_get(cj, "image_grids"), k);
                assert_int_equal(g.rows, json_integer_value(json_array_get(grid, 0)));
                assert_int_equal(g.cols, json_integer_value(json_array_get(grid, 1)));
                size_t m = 0;
                assert_int_equal(prism_llama4_expand(&g, proc.tokens_per_tile, &it, full + total, n + 8192 - total, &m),
                                 PRISM_OK);
                total += m;
                k++;
                n_images++;
            }
            assert_int_equal(k, json_array_size(imgs));
            failures += !ids_equal("processor input_ids", name, full, total, json_object_get(cj, "input_ids"));
            prism_free(full);
        }
        prism_free(ids);
    }
    assert_true(n_images >= 5);
    prism_template_free(t);
    prism_free(bos);
    prism_free(eos);
    assert_int_equal(failures, 0);
}

/* Detokenizing what the model would stream back: special tokens are skipped, text round-trips. */
static void test_roundtrip(void **state)
{
    static const char *const texts[] = {"Hello world!", "  leading spaces and\ttabs\n\nnew lines",
                                        "émoji 🎨 and 数字 123456", "<|header_start|>user<|header_end|>\n\nhi<|eot|>"};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(texts); i++) {
        int32_t *ids = NULL;
        size_t n = 0, cap = 0;
        assert_int_equal(prism_tokenizer_encode(tok, texts[i], strlen(texts[i]), true, &ids, &n, &cap), PRISM_OK);
        assert_int_equal(ids[0], prism_tokenizer_token_to_id(tok, "<|begin_of_text|>"));
        prism_buf_t s = {0};
        assert_int_equal(prism_tokenizer_decode(tok, ids, n, false, &s), PRISM_OK);
        char want[256];
        snprintf(want, sizeof want, "<|begin_of_text|>%s", texts[i]);
        assert_int_equal(s.len, strlen(want));
        assert_memory_equal(s.data, want, s.len);
        prism_buf_free(&s);
        prism_free(ids);
    }
    assert_int_equal(prism_tokenizer_vocab_size(tok), 512);
}

int main(void)
{
    setenv("PRISM_TEMPLATE_FIXED_TIME", "1721995200", 1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_llama4_prompts),
        cmocka_unit_test(test_roundtrip),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
