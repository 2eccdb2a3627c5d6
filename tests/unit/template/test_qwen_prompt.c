/* Qwen2.5-VL and Qwen3-VL prompts on the router's side, against transformers
 * (tests/data/model/qwen25vl_tiny/golden.json, or the fixture named by argv[1]: qwen3vl_tiny for
 * test_qwen3_prompt; tools/gen_qwen_goldens.py): the checkpoint's chat template (tokenizer_config.json,
 * loaded the way the router loads it) renders each conversation byte-identically to HF (text only,
 * one image, two images, multi-turn with an assistant turn); the Qwen2-style tokenizer gives HF's
 * ids; and repeating each <|image_pad|> by the token count computed from the image's width and
 * height alone (prism_qwenvl_grid: smart_resize) gives exactly Qwen2_5_VLProcessor's (Qwen3VLProcessor's)
 * input_ids. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "image/qwenvl_proc.h"
#include "template/template.h"
#include "tokenizer/tokenizer.h"

static const char *fixture = "qwen25vl_tiny";
static char model_dir[1024];
static json_t *goldens;
static prism_tokenizer_t *tok;

static int setup(void **state)
{
    const char *src = getenv("PRISM_SOURCE_DIR");
    if (!src || !*src) src = PRISM_SOURCE_DIR;
    snprintf(model_dir, sizeof model_dir, "%s/tests/data/model/%s", src, fixture);
    char path[1200], err[256];
    snprintf(path, sizeof path, "%s/golden.json", model_dir);
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

static void test_qwen_prompts(void **state)
{
    char path[1200], err[512];
    snprintf(path, sizeof path, "%s/tokenizer_config.json", model_dir);
    prism_template_t *t = NULL;
    char *bos = NULL, *eos = NULL;
    int rc = prism_template_load_from_tokenizer_config(path, &t, &bos, &eos, err, sizeof err);
    if (rc) fail_msg("%s: %s", path, err);
    prism_qwenvl_proc_t proc;
    if (prism_qwenvl_proc_load_dir(model_dir, &proc, err, sizeof err)) fail_msg("%s", err);
    int32_t pad = prism_tokenizer_token_to_id(tok, "<|image_pad|>");
    assert_true(pad >= 0 && prism_tokenizer_is_special(tok, pad));
    int failures = 0, n_images = 0;
    size_t i;
    json_t *cj;
    json_array_foreach(json_object_get(goldens, "cases"), i, cj) {
        const char *name = json_string_value(json_object_get(cj, "name"));
        json_t *ctx = prism_template_chat_context(json_object_get(cj, "messages"), NULL, true, bos, eos, NULL);
        assert_non_null(ctx);
        prism_buf_t out = {0};
        rc = prism_template_render(t, ctx, &out, err, sizeof err);
        json_decref(ctx);
        json_t *exp = json_object_get(cj, "text");
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
        /* expand each <|image_pad|> from (width, height) alone, as the router does */
        json_t *imgs = json_object_get(cj, "images"), *want = json_object_get(cj, "input_ids");
        size_t total = 0, k = 0;
        int32_t *full = prism_malloc(sizeof(int32_t) * (n + 4096));
        for (size_t j = 0; j < n; j++) {
            if (ids[j] != pad) {
                full[total++] = ids[j];
                continue;
            }
            json_t *im = json_array_get(imgs, k++);
            assert_non_null(im);
            prism_qwenvl_grid_t g;
            assert_int_equal(prism_qwenvl_grid(&proc, (int)json_integer_value(json_object_get(im, "w")),
                                               (int)json_integer_value(json_object_get(im, "h")), &g), PRISM_OK);
            assert_int_equal(g.n_tokens, json_integer_value(json_object_get(im, "n_tokens")));
            for (int r = 0; r < g.n_tokens; r++) full[total++] = pad;
            n_images++;
        }
        assert_int_equal(k, json_array_size(imgs));
        bool ok = total == json_array_size(want);
        for (size_t j = 0; ok && j < total; j++) ok = full[j] == (int32_t)json_integer_value(json_array_get(want, j));
        if (!ok) {
            fprintf(stderr, "%s: %zu ids vs HF's %zu\n", name, total, json_array_size(want));
            failures++;
        }
        prism_free(full);
        prism_free(ids);
    }
    assert_true(n_images >= 6);
    prism_template_free(t);
    prism_free(bos);
    prism_free(eos);
    assert_int_equal(failures, 0);
}

int main(int argc, char **argv)
{
    if (argc > 1) fixture = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen_prompts),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
