/* OpenAI request parser and response writer tests. Every writer's output is parsed back with
 * jansson (which rejects invalid UTF-8 and bad numbers), so "valid JSON" is checked, not assumed. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "openai_req.h"
#include "openai_write.h"
#include "core/utf8.h"
#include "guide/guide.h"

static int parse(const char *body, bool chat, const prism_oai_parse_opts_t *o, prism_oai_request_t *r,
                 prism_oai_error_t *e)
{
    return prism_oai_parse(body, strlen(body), chat, o, r, e);
}

/* ------------------------------------------------------------------ valid chat */

static void test_chat_minimal_defaults(void **state)
{
    (void)state;
    size_t base = prism_mem_used();
    prism_oai_request_t r;
    prism_oai_error_t e;
    assert_int_equal(parse("{\"model\":\"llava\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}", true, NULL, &r, &e),
                     PRISM_OK);
    assert_true(r.chat);
    assert_string_equal(r.model, "llava");
    assert_int_equal(r.n_messages, 1);
    assert_string_equal(r.messages[0].role, "user");
    assert_true(r.messages[0].content_is_string);
    assert_int_equal(r.messages[0].n_parts, 1);
    assert_int_equal(r.messages[0].parts[0].kind, PRISM_OAI_PART_TEXT);
    assert_int_equal(r.messages[0].parts[0].text_len, 2);
    assert_memory_equal(r.messages[0].parts[0].text, "hi", 2);
    assert_true(json_is_object(r.messages[0].raw));
    assert_false(r.stream);
    assert_false(r.include_usage);
    assert_int_equal(r.max_tokens, -1);
    assert_true(r.temperature == 1.0);
    assert_true(r.top_p == 1.0);
    assert_int_equal(r.top_k, -1);
    assert_false(r.has_seed);
    assert_int_equal(r.priority, 0);
    assert_string_equal(r.cache_salt, "");
    assert_int_equal(r.n_stop, 0);
    assert_int_equal(r.n_stop_token_ids, 0);
    assert_false(r.logprobs);
    assert_int_equal(r.top_logprobs, 0);
    assert_int_equal(r.n, 1);
    assert_false(r.ignore_eos);
    assert_false(r.return_tokens_as_token_ids);
    assert_true(r.add_generation_prompt);
    assert_false(r.add_special_tokens);
    assert_true(r.skip_special_tokens);
    assert_int_equal(r.n_images, 0);
    prism_oai_request_free(&r);
    assert_int_equal(prism_mem_used(), base);
}

static void test_chat_full(void **state)
{
    (void)state;
    const char *body =
        "{\"model\":\"m\",\"messages\":["
        "{\"role\":\"system\",\"content\":\"be nice\"},"
        "{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"what is\"},"
        "  {\"type\":\"image_url\",\"image_url\":{\"url\":\"data:image/png;base64,AAAA\",\"detail\":\"low\"}},"
        "  {\"type\":\"image_url\",\"image_url\":\"http://x/y.jpg\"},{\"type\":\"text\",\"text\":\"this\"}]},"
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[]},"
        "{\"role\":\"tool\",\"content\":\"42\",\"tool_call_id\":\"c1\"},"
        "{\"role\":\"developer\",\"content\":[]}],"
        "\"stream\":true,\"stream_options\":{\"include_usage\":true},"
        "\"max_tokens\":100,\"max_completion_tokens\":50,\"temperature\":0,\"top_p\":0.5,\"top_k\":0,"
        "\"seed\":-9007199254740993,\"stop\":[\"\\n\\n\",\"END\"],\"stop_token_ids\":[2,32000],"
        "\"logprobs\":true,\"top_logprobs\":5,\"n\":1,\"ignore_eos\":true,\"add_generation_prompt\":false,"
        "\"return_tokens_as_token_ids\":true,\"priority\":-3,\"cache_salt\":\"tenant-7\","
        "\"presence_penalty\":1.5,\"frequency_penalty\":-0.5,\"repetition_penalty\":1.1,"
        "\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{\"type\":\"object\"}}}],"
        "\"user\":\"u\",\"logit_bias\":{\"1\":2,\"30\":-100.0},\"metadata\":{\"k\":\"v\"},\"store\":false,"
        "\"service_tier\":\"auto\",\"min_p\":0,\"echo\":false,\"modalities\":[\"text\"],\"some_new_field\":1}";
    prism_oai_request_t r;
    prism_oai_error_t e;
    assert_int_equal(parse(body, true, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.n_messages, 5);
    const prism_oai_message_t *u = &r.messages[1];
    assert_false(u->content_is_string);
    assert_int_equal(u->n_parts, 4);
    assert_int_equal(u->n_images, 2);
    assert_int_equal(u->parts[0].kind, PRISM_OAI_PART_TEXT);
    assert_string_equal(u->parts[0].text, "what is");
    assert_int_equal(u->parts[1].kind, PRISM_OAI_PART_IMAGE);
    assert_string_equal(u->parts[1].image_url, "data:image/png;base64,AAAA");
    assert_int_equal(u->parts[1].image_url_len, strlen("data:image/png;base64,AAAA"));
    assert_int_equal(u->parts[2].kind, PRISM_OAI_PART_IMAGE);
    assert_string_equal(u->parts[2].image_url, "http://x/y.jpg");
    assert_string_equal(u->parts[3].text, "this");
    assert_true(r.messages[2].content_is_null);
    assert_int_equal(r.messages[2].n_parts, 0);
    assert_string_equal(r.messages[3].role, "tool");
    assert_string_equal(r.messages[3].parts[0].text, "42");
    assert_int_equal(r.messages[4].n_parts, 0);
    assert_false(r.messages[4].content_is_null);
    assert_int_equal(r.n_images, 2);
    assert_true(r.stream);
    assert_true(r.include_usage);
    assert_int_equal(r.max_tokens, 50);  /* max_completion_tokens supersedes */
    assert_true(r.temperature == 0.0);
    assert_true(r.top_p == 0.5);
    assert_int_equal(r.top_k, -1);
    assert_true(r.has_seed);
    assert_true(r.seed == -9007199254740993LL);
    assert_int_equal(r.priority, -3);
    assert_string_equal(r.cache_salt, "tenant-7");
    assert_int_equal(r.n_stop, 2);
    assert_string_equal(r.stop[0], "\n\n");
    assert_int_equal(r.stop_len[1], 3);
    assert_int_equal(r.n_stop_token_ids, 2);
    assert_int_equal(r.stop_token_ids[1], 32000);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 5);
    assert_true(r.ignore_eos);
    assert_true(r.return_tokens_as_token_ids);
    assert_false(r.add_generation_prompt);
    assert_true(r.presence_penalty == 1.5);
    assert_true(r.frequency_penalty == -0.5);
    assert_true(r.repetition_penalty == 1.1);
    assert_true(r.greedy);                /* temperature 0 */
    assert_int_equal(r.n_logit_bias, 2);
    int i30 = r.logit_bias_ids[0] == 30 ? 0 : 1;
    assert_int_equal(r.logit_bias_ids[i30], 30);
    assert_true(r.logit_bias_values[i30] == -100.0f);
    assert_true(r.logit_bias_values[1 - i30] == 2.0f);
    assert_int_equal(r.n_tools, 1);
    assert_int_equal(r.tool_choice, PRISM_OAI_TOOL_AUTO);   /* tools present, no tool_choice */
    assert_true(r.parallel_tool_calls);
    assert_non_null(strstr(r.tools_text, "\"get_weather\""));
    assert_int_equal(r.guide_kind, 0);
    prism_oai_request_free(&r);
}

/* Output constraints and tools: what the parser hands the router to compile. */
static void test_guides_and_tools(void **state)
{
    (void)state;
    size_t base = prism_mem_used();
    prism_oai_request_t r;
    prism_oai_error_t e;
    assert_int_equal(parse("{" "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]" ",\"response_format\":"
                           "{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\",\"strict\":true,"
                           "\"schema\":{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}}}}",
                           true, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.guide_kind, PRISM_GUIDE_JSON_SCHEMA);
    assert_string_equal(r.guide_text, "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}");
    assert_int_equal(r.guide_len, strlen(r.guide_text));
    assert_string_equal(r.guide_param, "response_format.json_schema.schema");
    prism_oai_request_free(&r);
    assert_int_equal(parse("{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_object\"}}", false, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.guide_kind, PRISM_GUIDE_JSON_OBJECT);
    prism_oai_request_free(&r);
    assert_int_equal(parse("{\"prompt\":\"x\",\"response_format\":{\"type\":\"text\"},\"guided_choice\":[\"a\",\"b c\"]}",
                           false, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.guide_kind, PRISM_GUIDE_CHOICE);
    assert_string_equal(r.guide_text, "[\"a\",\"b c\"]");
    prism_oai_request_free(&r);
    assert_int_equal(parse("{\"prompt\":\"x\",\"guided_regex\":\"[a-z]+\"}", false, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.guide_kind, PRISM_GUIDE_REGEX);
    assert_string_equal(r.guide_text, "[a-z]+");
    prism_oai_request_free(&r);
    assert_int_equal(parse("{\"prompt\":\"x\",\"guided_json\":\"{\\\"type\\\":\\\"string\\\"}\"}", false, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.guide_kind, PRISM_GUIDE_JSON_SCHEMA);
    assert_string_equal(r.guide_text, "{\"type\":\"string\"}");
    prism_oai_request_free(&r);
    /* tools: a named choice, parallel calls off, n and best_of */
    assert_int_equal(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":["
                           "{\"type\":\"function\",\"function\":{\"name\":\"a\"}},"
                           "{\"type\":\"function\",\"function\":{\"name\":\"b-2\",\"parameters\":{}}}],"
                           "\"tool_choice\":{\"type\":\"function\",\"function\":{\"name\":\"b-2\"}},"
                           "\"parallel_tool_calls\":false,\"n\":3,\"top_p\":0,\"temperature\":1}", true, NULL, &r, &e),
                     PRISM_OK);
    assert_int_equal(r.n_tools, 2);
    assert_int_equal(r.tool_choice, PRISM_OAI_TOOL_NAMED);
    assert_string_equal(r.tool_name, "b-2");
    assert_false(r.parallel_tool_calls);
    assert_int_equal(r.n, 3);
    assert_true(r.greedy);               /* top_p 0 is greedy whatever the temperature */
    prism_oai_request_free(&r);
    assert_int_equal(parse("{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"tools\":["
                           "{\"type\":\"function\",\"function\":{\"name\":\"a\"}}],\"tool_choice\":\"none\"}",
                           true, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.tool_choice, PRISM_OAI_TOOL_NONE);  /* the template still sees the tools */
    assert_int_equal(r.n_tools, 1);
    prism_oai_request_free(&r);
    assert_int_equal(parse("{\"prompt\":\"x\",\"n\":4,\"best_of\":4}", false, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.n, 4);
    prism_oai_request_free(&r);
    assert_int_equal(prism_mem_used(), base);
}

/* logit_bias: at most PRISM_OAI_MAX_LOGIT_BIAS entries, ids inside the vocabulary when it is known. */
static void test_logit_bias_bounds(void **state)
{
    (void)state;
    prism_buf_t b = {0};
    prism_oai_request_t r;
    prism_oai_error_t e;
    for (int n = PRISM_OAI_MAX_LOGIT_BIAS; n <= PRISM_OAI_MAX_LOGIT_BIAS + 1; n++) {
        prism_buf_reset(&b);
        prism_buf_append_str(&b, "{\"prompt\":\"x\",\"logit_bias\":{");
        for (int i = 0; i < n; i++) prism_buf_appendf(&b, "%s\"%d\":%d", i ? "," : "", i, i % 201 - 100);
        prism_buf_append_str(&b, "}}");
        int rc = prism_oai_parse(b.data, b.len, false, NULL, &r, &e);
        if (n == PRISM_OAI_MAX_LOGIT_BIAS) {
            assert_int_equal(rc, PRISM_OK);
            assert_int_equal(r.n_logit_bias, n);
        } else {
            assert_int_equal(rc, PRISM_EINVAL);
            assert_string_equal(e.param, "logit_bias");
            assert_non_null(strstr(e.message, "at most 300"));
        }
        prism_oai_request_free(&r);
    }
    /* tools travel to the workers as text: bounded */
    prism_buf_reset(&b);
    prism_buf_append_str(&b, "{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"tools\":[");
    for (int i = 0; i < 100; i++)
        prism_buf_appendf(&b, "%s{\"type\":\"function\",\"function\":{\"name\":\"f%d\",\"description\":\"%0*d\"}}",
                          i ? "," : "", i, 11000, 0);
    prism_buf_append_str(&b, "]}");
    assert_int_equal(prism_oai_parse(b.data, b.len, true, NULL, &r, &e), PRISM_EINVAL);
    assert_string_equal(e.param, "tools");
    assert_non_null(strstr(e.message, "limit"));
    prism_oai_parse_opts_t o = {.vocab = 4096};
    const char *in = "{\"prompt\":\"x\",\"logit_bias\":{\"4095\":1}}", *out = "{\"prompt\":\"x\",\"logit_bias\":{\"4096\":1}}";
    assert_int_equal(prism_oai_parse(in, strlen(in), false, &o, &r, &e), PRISM_OK);
    prism_oai_request_free(&r);
    assert_int_equal(prism_oai_parse(out, strlen(out), false, &o, &r, &e), PRISM_EINVAL);
    assert_non_null(strstr(e.message, "out of vocabulary"));
    assert_string_equal(e.param, "logit_bias");
    prism_buf_free(&b);
}

static void test_chat_nul_in_text_and_integral_float(void **state)
{
    (void)state;
    const char *body = "{\"messages\":[{\"role\":\"user\",\"content\":\"a\\u0000b\"}],\"max_tokens\":10.0,\"top_k\":5,"
                       "\"stop\":\"###\",\"temperature\":2}";
    prism_oai_request_t r;
    prism_oai_error_t e;
    assert_int_equal(parse(body, true, NULL, &r, &e), PRISM_OK);
    assert_null(r.model);
    assert_int_equal(r.messages[0].parts[0].text_len, 3);
    assert_memory_equal(r.messages[0].parts[0].text, "a\0b", 3);
    assert_int_equal(r.max_tokens, 10);
    assert_int_equal(r.top_k, 5);
    assert_int_equal(r.n_stop, 1);
    assert_string_equal(r.stop[0], "###");
    assert_true(r.temperature == 2.0);
    prism_oai_request_free(&r);
}

/* ------------------------------------------------------------------ invalid requests */

typedef struct {
    bool chat;
    const char *body;
    const char *msg;    /* substring of the message */
    const char *param;  /* exact param, "" for none */
} bad_case_t;

#define M1 "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"

static const bad_case_t k_bad[] = {
    {true, "{\"messages\": [", "Invalid JSON", ""},
    {true, "", "Invalid JSON", ""},
    {true, "[1,2]", "must be a JSON object", ""},
    {true, "{}", "'messages' is a required property", "messages"},
    {true, "{\"messages\":null}", "'messages' is a required property", "messages"},
    {true, "{\"messages\":\"hi\"}", "'messages' must be a list", "messages"},
    {true, "{\"messages\":[]}", "too short", "messages"},
    {true, "{\"messages\":[1]}", "must be an object", "messages[0]"},
    {true, "{\"messages\":[{\"content\":\"x\"}]}", "'role' is a required property", "messages[0].role"},
    {true, "{\"messages\":[{\"role\":5,\"content\":\"x\"}]}", "must be a string", "messages[0].role"},
    {true, "{\"messages\":[{\"role\":\"robot\",\"content\":\"x\"}]}", "Unsupported role 'robot'", "messages[0].role"},
    {true, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "must be a string or a list", "messages[0].content"},
    {true, "{\"messages\":[{\"role\":\"user\",\"content\":[\"x\"]}]}", "must be an object", "messages[0].content[0]"},
    {true, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"text\":\"x\"}]}]}", "missing a string 'type'",
     "messages[0].content[0].type"},
    {true, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"audio_url\",\"audio_url\":{}}]}]}",
     "Content part type 'audio_url' is not supported: this server takes text and images (image_url) only.",
     "messages[0].content[0].type"},
    {true, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"video_url\",\"video_url\":{\"url\":\"http://a/v.mp4\"}}]}]}",
     "Content part type 'video_url' is not supported", "messages[0].content[0].type"},
    {true, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"input_audio\",\"input_audio\":{}}]}]}",
     "Content part type 'input_audio' is not supported", "messages[0].content[0].type"},
    {true, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"hologram\"}]}]}",
     "Unsupported content part type 'hologram'", "messages[0].content[0].type"},
    {true, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":1}]}]}", "needs a string 'text'",
     "messages[0].content[0].text"},
    {true, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{}}]}]}",
     "image_url.url", "messages[0].content[0].image_url"},
    {true, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":{\"url\":\"\"}}]}]}",
     "non-empty", "messages[0].content[0].image_url"},
    {true, "{" M1 ",\"model\":5}", "'model' must be a string", "model"},
    {true, "{" M1 ",\"max_tokens\":-5}", "max_tokens must be at least 1, got -5.", "max_tokens"},
    {true, "{" M1 ",\"max_tokens\":0}", "max_tokens must be at least 1, got 0.", "max_tokens"},
    {true, "{" M1 ",\"max_tokens\":\"10\"}", "'max_tokens' must be an integer", "max_tokens"},
    {true, "{" M1 ",\"max_tokens\":1.5}", "'max_tokens' must be an integer", "max_tokens"},
    {true, "{" M1 ",\"max_completion_tokens\":-1}", "max_completion_tokens must be at least 1", "max_completion_tokens"},
    {true, "{" M1 ",\"temperature\":-0.1}", "temperature must be non-negative", "temperature"},
    {true, "{" M1 ",\"temperature\":\"hot\"}", "'temperature' must be a number, got string.", "temperature"},
    {true, "{" M1 ",\"top_p\":-0.1}", "top_p must be in [0, 1]", "top_p"},
    {true, "{" M1 ",\"top_p\":1.01}", "top_p must be in [0, 1]", "top_p"},
    {true, "{" M1 ",\"top_k\":-2}", "top_k must be", "top_k"},
    {true, "{" M1 ",\"top_k\":true}", "'top_k' must be an integer", "top_k"},
    {true, "{" M1 ",\"seed\":\"x\"}", "'seed' must be an integer", "seed"},
    {true, "{" M1 ",\"priority\":1.5}", "'priority' must be an integer", "priority"},
    {true, "{" M1 ",\"priority\":1000001}", "priority must be in", "priority"},
    {true, "{" M1 ",\"cache_salt\":1}", "cache_salt must be a string", "cache_salt"},
    {true, "{" M1 ",\"cache_salt\":\"\"}", "cache_salt must be 1 to 256 bytes, got 0", "cache_salt"},
    {true, "{" M1 ",\"cache_salt\":\"a\\u0000b\"}", "must not contain U+0000", "cache_salt"},
    {true, "{" M1 ",\"n\":129}", "n must be between 1 and 128", "n"},
    {true, "{" M1 ",\"n\":0}", "n must be between 1 and 128", "n"},
    /* logit_bias */
    {true, "{" M1 ",\"logit_bias\":[1]}", "must be an object", "logit_bias"},
    {true, "{" M1 ",\"logit_bias\":{\"x\":1}}", "keys must be token ids", "logit_bias"},
    {true, "{" M1 ",\"logit_bias\":{\"-1\":1}}", "keys must be token ids", "logit_bias"},
    {true, "{" M1 ",\"logit_bias\":{\"01\":1}}", "keys must be token ids", "logit_bias"},
    {true, "{" M1 ",\"logit_bias\":{\"5\":100.5}}", "in [-100, 100]", "logit_bias"},
    {true, "{" M1 ",\"logit_bias\":{\"5\":-101}}", "in [-100, 100]", "logit_bias"},
    {true, "{" M1 ",\"logit_bias\":{\"5\":\"1\"}}", "must be numbers", "logit_bias"},
    /* the field rule: refused unless null or the default */
    {true, "{" M1 ",\"min_p\":0.1}", "'min_p' is not supported", "min_p"},
    {true, "{" M1 ",\"min_tokens\":3}", "'min_tokens' is not supported", "min_tokens"},
    {true, "{" M1 ",\"audio\":{\"voice\":\"alloy\",\"format\":\"wav\"}}", "'audio' is not supported", "audio"},
    {true, "{" M1 ",\"modalities\":[\"text\",\"audio\"]}", "'modalities' is not supported", "modalities"},
    {true, "{" M1 ",\"web_search_options\":{}}", "'web_search_options' is not supported", "web_search_options"},
    {true, "{" M1 ",\"functions\":[{\"name\":\"f\"}]}", "'functions' is not supported", "functions"},
    {true, "{" M1 ",\"function_call\":\"auto\"}", "'function_call' is not supported", "function_call"},
    {true, "{" M1 ",\"reasoning_effort\":\"low\"}", "'reasoning_effort' is not supported", "reasoning_effort"},
    {true, "{" M1 ",\"use_beam_search\":true}", "'use_beam_search' is not supported", "use_beam_search"},
    {true, "{" M1 ",\"echo\":true}", "'echo' is not supported", "echo"},
    {true, "{" M1 ",\"stream\":true,\"stream_options\":{\"continuous_usage_stats\":true}}", "not supported",
     "stream_options.continuous_usage_stats"},
    /* output constraints */
    {true, "{" M1 ",\"response_format\":\"json\"}", "must be an object", "response_format"},
    {true, "{" M1 ",\"response_format\":{\"type\":\"grammar\"}}", "Unsupported response_format type", "response_format.type"},
    {true, "{" M1 ",\"response_format\":{\"type\":\"json_schema\"}}", "must be an object", "response_format.json_schema"},
    {true, "{" M1 ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"schema\":{}}}}", "name",
     "response_format.json_schema.name"},
    {true, "{" M1 ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"n\",\"schema\":[]}}}",
     "must be a JSON Schema object", "response_format.json_schema.schema"},
    {true, "{" M1 ",\"guided_json\":5}", "must be a JSON Schema", "guided_json"},
    {true, "{" M1 ",\"guided_regex\":\"\"}", "non-empty string", "guided_regex"},
    {true, "{" M1 ",\"guided_choice\":[]}", "list of 1 to", "guided_choice"},
    {true, "{" M1 ",\"guided_choice\":[\"a\",1]}", "only strings", "guided_choice"},
    {true, "{" M1 ",\"response_format\":{\"type\":\"json_object\"},\"guided_regex\":\"a\"}", "Only one of",
     "guided_regex"},
    /* tools */
    {true, "{" M1 ",\"tools\":{}}", "must be a list", "tools"},
    {true, "{" M1 ",\"tools\":[{\"type\":\"custom\",\"custom\":{\"name\":\"x\"}}]}", "custom tools", "tools[0].type"},
    {true, "{" M1 ",\"tools\":[{\"type\":\"function\"}]}", "must be an object", "tools[0].function"},
    {true, "{" M1 ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a b\"}}]}", "1 to 64 characters",
     "tools[0].function.name"},
    {true, "{" M1 ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a\",\"parameters\":5}}]}",
     "must be a JSON Schema object", "tools[0].function.parameters"},
    {true, "{" M1 ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a\"}}],\"tool_choice\":"
     "{\"type\":\"function\",\"function\":{\"name\":\"zzz\"}}}", "'zzz', which is not in 'tools'", "tool_choice"},
    {true, "{" M1 ",\"tool_choice\":\"required\"}", "needs at least one tool", "tool_choice"},
    {true, "{" M1 ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a\"}}],\"tool_choice\":\"sometimes\"}",
     "must be none, auto, required", "tool_choice"},
    {true, "{" M1 ",\"tools\":[{\"type\":\"function\",\"function\":{\"name\":\"a\"}}],\"guided_regex\":\"a\"}",
     "cannot be combined with tool calling", "tool_choice"},
    {true, "{" M1 ",\"parallel_tool_calls\":1}", "must be a boolean", "parallel_tool_calls"},
    {true, "{" M1 ",\"stream\":\"yes\"}", "'stream' must be a boolean", "stream"},
    {true, "{" M1 ",\"stream_options\":{\"include_usage\":true}}", "only be defined when `stream=True`", "stream_options"},
    {true, "{" M1 ",\"stream\":true,\"stream_options\":[]}", "must be an object", "stream_options"},
    {true, "{" M1 ",\"stream\":true,\"stream_options\":{\"include_usage\":1}}", "must be a boolean", "include_usage"},
    {true, "{" M1 ",\"stop\":5}", "'stop' must be a string or a list of strings", "stop"},
    {true, "{" M1 ",\"stop\":[\"a\",5]}", "'stop' must be a string or a list of strings", "stop"},
    {true, "{" M1 ",\"stop\":[\"a\",\"b\",\"c\",\"d\",\"e\",\"f\",\"g\",\"h\",\"i\"]}", "at most 8", "stop"},
    {true, "{" M1 ",\"stop\":[\"\"]}", "stop cannot contain an empty string", "stop"},
    {true, "{" M1 ",\"stop_token_ids\":[-1]}", "non-negative", "stop_token_ids"},
    {true, "{" M1 ",\"stop_token_ids\":5}", "must be a list", "stop_token_ids"},
    {true, "{" M1 ",\"stop_token_ids\":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}", "at most 16", "stop_token_ids"},
    {true, "{" M1 ",\"logprobs\":1}", "'logprobs' must be a boolean", "logprobs"},
    {true, "{" M1 ",\"top_logprobs\":3}", "`logprobs` must be set to true", "top_logprobs"},
    {true, "{" M1 ",\"logprobs\":true,\"top_logprobs\":21}", "at most 20", "top_logprobs"},
    {true, "{" M1 ",\"logprobs\":true,\"top_logprobs\":-1}", "must be a positive value", "top_logprobs"},
    {true, "{" M1 ",\"ignore_eos\":\"no\"}", "must be a boolean", "ignore_eos"},
    {true, "{" M1 ",\"return_tokens_as_token_ids\":1}", "must be a boolean", "return_tokens_as_token_ids"},
    {true, "{" M1 ",\"add_generation_prompt\":0}", "must be a boolean", "add_generation_prompt"},
    {true, "{" M1 ",\"presence_penalty\":3}", "presence_penalty must be in [-2, 2]", "presence_penalty"},
    {true, "{" M1 ",\"frequency_penalty\":-2.5}", "frequency_penalty must be in [-2, 2]", "frequency_penalty"},
    {true, "{" M1 ",\"repetition_penalty\":0}", "repetition_penalty must be greater than zero", "repetition_penalty"},
    /* completions */
    {false, "{}", "'prompt' is a required property", "prompt"},
    {false, "{\"prompt\":5}", "'prompt' must be a string", "prompt"},
    {false, "{\"prompt\":[]}", "Prompt cannot be empty", "prompt"},
    {false, "{\"prompt\":[[]]}", "Prompt cannot be empty", "prompt"},
    {false, "{\"prompt\":[\"a\",\"b\"]}", "Batched prompts", "prompt"},
    {false, "{\"prompt\":[1,\"a\"]}", "token ids must be integers", "prompt"},
    {false, "{\"prompt\":[1,-3]}", "out of range", "prompt"},
    {false, "{\"prompt\":[1,4294967296]}", "out of range", "prompt"},
    {false, "{\"prompt\":\"x\",\"logprobs\":true}", "'logprobs' must be an integer", "logprobs"},
    {false, "{\"prompt\":\"x\",\"logprobs\":21}", "at most 20", "logprobs"},
    {false, "{\"prompt\":\"x\",\"logprobs\":-1}", "must be a positive value", "logprobs"},
    {false, "{\"prompt\":\"x\",\"echo\":true}", "'echo' is not supported", "echo"},
    {false, "{\"prompt\":\"x\",\"suffix\":\"y\"}", "'suffix' is not supported", "suffix"},
    {false, "{\"prompt\":\"x\",\"best_of\":3}", "best_of must equal n (1)", "best_of"},
    {false, "{\"prompt\":\"x\",\"n\":2,\"best_of\":4}", "best_of must equal n (2)", "best_of"},
    {false, "{\"prompt\":\"x\",\"n\":200}", "n must be between 1 and 128", "n"},
    {false, "{\"prompt\":\"x\",\"max_tokens\":-5}", "max_tokens must be at least 1, got -5.", "max_tokens"},
};

static void test_invalid_requests(void **state)
{
    (void)state;
    size_t base = prism_mem_used();
    for (size_t i = 0; i < PRISM_ARRAY_LEN(k_bad); i++) {
        const bad_case_t *c = &k_bad[i];
        prism_oai_request_t r;
        prism_oai_error_t e;
        int rc = parse(c->body, c->chat, NULL, &r, &e);
        if (rc != PRISM_EINVAL || !strstr(e.message, c->msg) || strcmp(e.param, c->param) != 0) {
            print_error("case %zu (%s): rc=%d message='%s' param='%s'\n", i, c->body, rc, e.message, e.param);
            fail();
        }
        assert_int_equal(e.status, 400);
        assert_string_equal(e.type, "BadRequestError");
        assert_null(r.root);
        assert_null(r.messages);
        prism_oai_request_free(&r);  /* harmless after a failure */
    }
    assert_int_equal(prism_mem_used(), base);
}

static void test_stop_length_limit(void **state)
{
    (void)state;
    char *body = malloc(4096);
    char s[PRISM_OAI_MAX_STOP_LEN + 2];
    memset(s, 'z', sizeof s - 1);
    s[sizeof s - 1] = 0;  /* 1025 bytes */
    snprintf(body, 4096, "{" M1 ",\"stop\":\"%s\"}", s);
    prism_oai_request_t r;
    prism_oai_error_t e;
    assert_int_equal(parse(body, true, NULL, &r, &e), PRISM_EINVAL);
    assert_non_null(strstr(e.message, "at most 1024 bytes"));
    s[PRISM_OAI_MAX_STOP_LEN] = 0;  /* exactly 1024 */
    snprintf(body, 4096, "{" M1 ",\"stop\":[\"%s\",\"a\",\"b\",\"c\",\"d\",\"e\",\"f\",\"g\"]}", s);
    assert_int_equal(parse(body, true, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.n_stop, 8);
    assert_int_equal(r.stop_len[0], 1024);
    prism_oai_request_free(&r);
    free(body);
}

static void test_image_limits(void **state)
{
    (void)state;
    const char *img = "{\"type\":\"image_url\",\"image_url\":{\"url\":\"data:image/png;base64,AA\"}}";
    char body[2048];
    snprintf(body, sizeof body, "{\"messages\":[{\"role\":\"user\",\"content\":[%s,%s]},{\"role\":\"user\",\"content\":[%s]}]}",
             img, img, img);
    prism_oai_request_t r;
    prism_oai_error_t e;
    prism_oai_parse_opts_t o = {.max_images = 2};
    assert_int_equal(parse(body, true, &o, &r, &e), PRISM_EINVAL);
    assert_string_equal(e.message, "At most 2 image(s) may be provided in one prompt.");
    o.max_images = 3;
    assert_int_equal(parse(body, true, &o, &r, &e), PRISM_OK);
    assert_int_equal(r.n_images, 3);
    assert_int_equal(r.messages[0].n_images, 2);
    assert_int_equal(r.messages[1].n_images, 1);
    assert_int_equal(r.messages[1].parts[0].kind, PRISM_OAI_PART_IMAGE);
    prism_oai_request_free(&r);
    o.max_images = -1;  /* no images at all */
    assert_int_equal(parse(body, true, &o, &r, &e), PRISM_EINVAL);
    assert_string_equal(e.message, "At most 0 image(s) may be provided in one prompt.");
    /* default limit (8) */
    prism_buf_t b = {0};
    prism_buf_append_str(&b, "{\"messages\":[{\"role\":\"user\",\"content\":[");
    for (int i = 0; i < 9; i++) prism_buf_appendf(&b, "%s%s", i ? "," : "", img);
    prism_buf_append_str(&b, "]}]}");
    assert_int_equal(prism_oai_parse(b.data, b.len, true, NULL, &r, &e), PRISM_EINVAL);
    assert_non_null(strstr(e.message, "At most 8 image(s)"));
    prism_buf_free(&b);
}

static void test_bounds_messages_depth(void **state)
{
    (void)state;
    prism_oai_request_t r;
    prism_oai_error_t e;
    prism_oai_parse_opts_t o = {.max_messages = 3, .max_depth = 8};
    prism_buf_t b = {0};
    prism_buf_append_str(&b, "{\"messages\":[");
    for (int i = 0; i < 4; i++) prism_buf_appendf(&b, "%s{\"role\":\"user\",\"content\":\"m%d\"}", i ? "," : "", i);
    prism_buf_append_str(&b, "]}");
    assert_int_equal(prism_oai_parse(b.data, b.len, true, &o, &r, &e), PRISM_EINVAL);
    assert_non_null(strstr(e.message, "Too many messages"));
    prism_buf_free(&b);

    /* an unknown field nested deeper than the limit */
    prism_buf_append_str(&b, "{" M1 ",\"junk\":");
    for (int i = 0; i < 10; i++) prism_buf_append_str(&b, "[");
    for (int i = 0; i < 10; i++) prism_buf_append_str(&b, "]");
    prism_buf_append_str(&b, "}");
    assert_int_equal(prism_oai_parse(b.data, b.len, true, &o, &r, &e), PRISM_EINVAL);
    assert_non_null(strstr(e.message, "nesting is too deep"));
    o.max_depth = 0;  /* default 64 accepts it */
    assert_int_equal(prism_oai_parse(b.data, b.len, true, &o, &r, &e), PRISM_OK);
    prism_oai_request_free(&r);
    prism_buf_free(&b);

    /* past jansson's own limit: refused before jansson sees it */
    for (int i = 0; i < 5000; i++) prism_buf_append_str(&b, "[");
    assert_int_equal(prism_oai_parse(b.data, b.len, true, NULL, &r, &e), PRISM_EINVAL);
    assert_non_null(strstr(e.message, "nesting is too deep"));
    prism_buf_free(&b);

    /* prompt token id count */
    o.max_prompt_token_ids = 3;
    assert_int_equal(parse("{\"prompt\":[1,2,3,4]}", false, &o, &r, &e), PRISM_EINVAL);
    assert_non_null(strstr(e.message, "Too many prompt token ids"));
}

/* The parse budget (issue 26 finding 2): what the tree would cost is bounded before jansson
 * builds any of it. A body of "{}," in a field the server does not read cost 75 times its size. */
static size_t g_json_allocs;
static void *count_malloc(size_t n) { g_json_allocs++; return malloc(n); }

static void test_parse_budget(void **state)
{
    (void)state;
    prism_oai_request_t r;
    prism_oai_error_t e;
    prism_buf_t b = {0};
    json_malloc_t m0;
    json_free_t f0;
    json_get_alloc_funcs(&m0, &f0);
    json_set_alloc_funcs(count_malloc, free);
    /* unknown bulk: refused naming the field, nothing built */
    prism_buf_append_str(&b, "{" M1 ",\"metadata\":{\"a\":[");
    for (int i = 0; i < 20000; i++) prism_buf_append_str(&b, i ? ",{}" : "{}");
    prism_buf_append_str(&b, "]}}");
    g_json_allocs = 0;
    assert_int_equal(prism_oai_parse(b.data, b.len, true, NULL, &r, &e), PRISM_EINVAL);
    assert_string_equal(e.param, "metadata");
    assert_non_null(strstr(e.message, "too large"));
    assert_int_equal(g_json_allocs, 0);
    prism_buf_reset(&b);
    /* a field it reads: the whole tree's budget */
    prism_oai_parse_opts_t o = {.max_parse_bytes = 1 << 20};
    prism_buf_append_str(&b, "{" M1 ",\"response_format\":{\"type\":\"json_schema\",\"json_schema\":{\"name\":\"x\","
                             "\"schema\":{\"enum\":[");
    for (int i = 0; i < 20000; i++) prism_buf_append_str(&b, i ? ",[]" : "[]");
    prism_buf_append_str(&b, "]}}}}");
    g_json_allocs = 0;
    assert_int_equal(prism_oai_parse(b.data, b.len, true, &o, &r, &e), PRISM_EINVAL);
    assert_non_null(strstr(e.message, "too large to parse"));
    assert_int_equal(g_json_allocs, 0);
    json_set_alloc_funcs(m0, f0);
    prism_buf_reset(&b);
    /* what costs about its bytes passes: 2 MiB strings, read or not, and the estimate is close */
    prism_buf_append_str(&b, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    for (int i = 0; i < (2 << 20); i++) prism_buf_append(&b, "x", 1);
    prism_buf_append_str(&b, "\"}],\"user\":\"someone\",\"metadata\":{\"k\":\"v\"},\"prediction\":{\"type\":\"content\",\"content\":\"");
    for (int i = 0; i < (2 << 20); i++) prism_buf_append(&b, "y", 1);   /* unread text: costs its bytes */
    prism_buf_append_str(&b, "\"}}");
    assert_int_equal(prism_oai_parse(b.data, b.len, true, NULL, &r, &e), PRISM_OK);
    assert_true(r.parse_bytes >= (4u << 20) && r.parse_bytes < (4u << 20) + 4096);
    prism_oai_request_free(&r);
    prism_buf_reset(&b);
    /* 100,000 prompt token ids (completions) pass the default budget */
    prism_buf_append_str(&b, "{\"prompt\":[");
    for (int i = 0; i < 100000; i++) prism_buf_appendf(&b, i ? ",%d" : "%d", i % 1000);
    prism_buf_append_str(&b, "]}");
    assert_int_equal(prism_oai_parse(b.data, b.len, false, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.n_prompt_token_ids, 100000);
    prism_oai_request_free(&r);
    prism_buf_free(&b);
    /* the bound a memory plan counts */
    assert_int_equal(prism_oai_parse_bound(&o), 1 << 20);
    assert_true(prism_oai_parse_bound(NULL) >= (64u << 20));
}

/* Client errors a worker would refuse are 400s here, not 500s from prefill (issue 26 finding 13),
 * and chat_template_kwargs cannot replace what the router sets (finding 12). */
static void test_worker_limits_and_template_kwargs(void **state)
{
    (void)state;
    prism_oai_request_t r;
    prism_oai_error_t e;
    prism_oai_parse_opts_t o = {.vocab = 1000};
    static const struct { const char *extra, *param; } BAD[] = {
        {"\"temperature\":1e308", "temperature"},
        {"\"repetition_penalty\":1e300", "repetition_penalty"},
        {"\"stop_token_ids\":[5,1000]", "stop_token_ids"},
        {"\"chat_template_kwargs\":{\"messages\":[{\"role\":\"evil\",\"content\":\"x\"}]}", "chat_template_kwargs.messages"},
        {"\"chat_template_kwargs\":{\"add_generation_prompt\":false}", "chat_template_kwargs.add_generation_prompt"},
        {"\"chat_template_kwargs\":{\"bos_token\":\"<s>\"}", "chat_template_kwargs.bos_token"},
        {"\"chat_template_kwargs\":{\"tools\":[]}", "chat_template_kwargs.tools"},
        {"\"chat_template_kwargs\":\"x\"", "chat_template_kwargs"},
    };
    char body[512];
    for (size_t i = 0; i < PRISM_ARRAY_LEN(BAD); i++) {
        snprintf(body, sizeof body, "{" M1 ",%s}", BAD[i].extra);
        if (parse(body, true, &o, &r, &e) != PRISM_EINVAL || e.status != 400 || strcmp(e.param, BAD[i].param))
            fail_msg("%s: want a 400 naming %s, got status %d param '%s' (%s)", body, BAD[i].param, e.status, e.param,
                     e.message);
    }
    static const char *const GOOD[] = {
        "\"temperature\":3e38", "\"repetition_penalty\":1e30", "\"stop_token_ids\":[0,999]",
        "\"chat_template_kwargs\":{\"enable_thinking\":false}", "\"chat_template_kwargs\":null",
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(GOOD); i++) {
        snprintf(body, sizeof body, "{" M1 ",%s}", GOOD[i]);
        if (parse(body, true, &o, &r, &e) != PRISM_OK) fail_msg("%s: %s", body, e.message);
        prism_oai_request_free(&r);
    }
}

/* mm_processor_kwargs (vLLM's): min_pixels / max_pixels kept (unset -1), anything else a 400 naming
 * the key; the model's own bounds are the router's (router_prompt). */
static void test_mm_processor_kwargs(void **state)
{
    (void)state;
    prism_oai_request_t r;
    prism_oai_error_t e;
    char body[512];
    static const struct { const char *extra, *param; } BAD[] = {
        {"\"mm_processor_kwargs\":[]", "mm_processor_kwargs"},
        {"\"mm_processor_kwargs\":{\"fps\":2}", "mm_processor_kwargs.fps"},
        {"\"mm_processor_kwargs\":{\"max_pixels\":0}", "mm_processor_kwargs.max_pixels"},
        {"\"mm_processor_kwargs\":{\"min_pixels\":-1}", "mm_processor_kwargs.min_pixels"},
        {"\"mm_processor_kwargs\":{\"max_pixels\":1.5}", "mm_processor_kwargs.max_pixels"},
        {"\"mm_processor_kwargs\":{\"max_pixels\":\"3136\"}", "mm_processor_kwargs.max_pixels"},
        {"\"mm_processor_kwargs\":{\"max_pixels\":2000000000000}", "mm_processor_kwargs.max_pixels"},
        {"\"mm_processor_kwargs\":{\"min_pixels\":5000,\"max_pixels\":4000}", "mm_processor_kwargs.min_pixels"},
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(BAD); i++) {
        snprintf(body, sizeof body, "{" M1 ",%s}", BAD[i].extra);
        if (parse(body, true, NULL, &r, &e) != PRISM_EINVAL || e.status != 400 || strcmp(e.param, BAD[i].param))
            fail_msg("%s: want a 400 naming %s, got status %d param '%s' (%s)", body, BAD[i].param, e.status, e.param,
                     e.message);
    }
    assert_int_equal(parse("{" M1 "}", true, NULL, &r, &e), PRISM_OK);
    assert_true(r.mm_min_pixels == -1 && r.mm_max_pixels == -1);
    prism_oai_request_free(&r);
    assert_int_equal(parse("{" M1 ",\"mm_processor_kwargs\":{\"max_pixels\":50176}}", true, NULL, &r, &e), PRISM_OK);
    assert_true(r.mm_min_pixels == -1 && r.mm_max_pixels == 50176);
    prism_oai_request_free(&r);
    assert_int_equal(parse("{\"prompt\":\"x\",\"mm_processor_kwargs\":{\"min_pixels\":3136,\"max_pixels\":null}}",
                           false, NULL, &r, &e), PRISM_OK);
    assert_true(r.mm_min_pixels == 3136 && r.mm_max_pixels == -1);
    prism_oai_request_free(&r);
}

/* ------------------------------------------------------------------ completions */

static void test_completions_prompts(void **state)
{
    (void)state;
    prism_oai_request_t r;
    prism_oai_error_t e;
    assert_int_equal(parse("{\"model\":\"m\",\"prompt\":\"Once upon\"}", false, NULL, &r, &e), PRISM_OK);
    assert_false(r.chat);
    assert_string_equal(r.prompt, "Once upon");
    assert_int_equal(r.prompt_len, 9);
    assert_null(r.prompt_token_ids);
    assert_int_equal(r.max_tokens, 16);  /* completions default */
    assert_false(r.logprobs);
    assert_true(r.add_special_tokens);
    assert_null(r.messages);
    prism_oai_request_free(&r);

    assert_int_equal(parse("{\"prompt\":[\"one\"],\"max_tokens\":7,\"logprobs\":3,\"echo\":false}", false, NULL, &r, &e),
                     PRISM_OK);
    assert_string_equal(r.prompt, "one");
    assert_int_equal(r.max_tokens, 7);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 3);
    prism_oai_request_free(&r);

    assert_int_equal(parse("{\"prompt\":[1,15043,2147483647],\"logprobs\":0}", false, NULL, &r, &e), PRISM_OK);
    assert_null(r.prompt);
    assert_int_equal(r.n_prompt_token_ids, 3);
    assert_int_equal(r.prompt_token_ids[1], 15043);
    assert_int_equal(r.prompt_token_ids[2], 2147483647);
    assert_true(r.logprobs);
    assert_int_equal(r.top_logprobs, 0);
    prism_oai_request_free(&r);

    assert_int_equal(parse("{\"prompt\":[[5,6]],\"messages\":\"ignored\"}", false, NULL, &r, &e), PRISM_OK);
    assert_int_equal(r.n_prompt_token_ids, 2);
    assert_int_equal(r.prompt_token_ids[0], 5);
    prism_oai_request_free(&r);

    /* chat-only fields are unknown (ignored) for completions */
    assert_int_equal(parse("{\"prompt\":\"\",\"top_logprobs\":\"x\",\"add_generation_prompt\":5}", false, NULL, &r, &e),
                     PRISM_OK);
    assert_int_equal(r.prompt_len, 0);
    prism_oai_request_free(&r);
}

/* ------------------------------------------------------------------ writers */

/* Strips "data: " and "\n\n" from one SSE event and parses it. */
static json_t *parse_sse(const char *s, size_t len)
{
    assert_true(len > 8);
    assert_memory_equal(s, "data: ", 6);
    assert_memory_equal(s + len - 2, "\n\n", 2);
    assert_null(memchr(s + 6, '\n', len - 8));  /* one line per event */
    json_error_t je;
    json_t *j = json_loadb(s + 6, len - 8, JSON_ALLOW_NUL, &je);  /* \u0000 is valid JSON */
    if (!j) print_error("bad JSON (%s): %.*s\n", je.text, (int)len, s);
    assert_non_null(j);
    return j;
}

static json_t *parse_json(const prism_buf_t *b)
{
    json_error_t je;
    json_t *j = json_loadb(b->data, b->len, JSON_ALLOW_NUL, &je);
    if (!j) print_error("bad JSON (%s): %s\n", je.text, b->data);
    assert_non_null(j);
    return j;
}

static void test_json_string_escaping(void **state)
{
    (void)state;
    static const struct {
        const char *in;
        size_t len;
        const char *want;  /* after a jansson round trip */
        size_t want_len;
    } cases[] = {
        {"plain", 5, "plain", 5},
        {"q\"b\\s/", 6, "q\"b\\s/", 6},
        {"\n\r\t\b\f\x01\x1f\x7f", 8, "\n\r\t\b\f\x01\x1f\x7f", 8},
        {"a\0b", 3, "a\0b", 3},
        {"\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80", 9, "\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80", 9},
        {"x\xFFy", 3, "x\xEF\xBF\xBDy", 5},
        {"\xE2\x82", 2, "\xEF\xBF\xBD", 3},              /* truncated: one U+FFFD (maximal subpart) */
        {"\xE2\x82" "A", 3, "\xEF\xBF\xBD" "A", 4},
        {"\xED\xA0\x80", 3, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD", 9},  /* surrogate: three */
        {"\xC0\xAF", 2, "\xEF\xBF\xBD\xEF\xBF\xBD", 6},  /* overlong */
        {"\xF4\x90\x80\x80", 4, "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD", 12},  /* > U+10FFFF */
        {"\x80", 1, "\xEF\xBF\xBD", 3},
        {"\xE2\x80\xA8", 3, "\xE2\x80\xA8", 3},  /* U+2028 is fine in JSON */
    };
    for (size_t i = 0; i < PRISM_ARRAY_LEN(cases); i++) {
        prism_buf_t b = {0};
        prism_buf_append_str(&b, "[");
        assert_int_equal(prism_json_string(&b, cases[i].in, cases[i].len), PRISM_OK);
        prism_buf_append_str(&b, "]");
        json_error_t je;
        json_t *j = json_loadb(b.data, b.len, JSON_ALLOW_NUL, &je);
        if (!j) print_error("case %zu: %s -> %s\n", i, je.text, b.data);
        assert_non_null(j);
        json_t *s = json_array_get(j, 0);
        assert_int_equal(json_string_length(s), cases[i].want_len);
        assert_memory_equal(json_string_value(s), cases[i].want, cases[i].want_len);
        json_decref(j);
        prism_buf_free(&b);
    }
}

static void test_logprob_numbers(void **state)
{
    (void)state;
    const double in[] = {-0.5, 0.0, -1e-7, -INFINITY, NAN, -12345.0, -3.0, INFINITY, -0.123456789};
    const double want[] = {-0.5, 0.0, -1e-7, -9999.0, -9999.0, -9999.0, -3.0, 0.0, -0.123456789};
    for (size_t i = 0; i < PRISM_ARRAY_LEN(in); i++) {
        prism_buf_t b = {0};
        prism_buf_append_str(&b, "[");
        assert_int_equal(prism_oai_json_logprob(&b, in[i]), PRISM_OK);
        prism_buf_append_str(&b, "]");
        json_t *j = parse_json(&b);
        json_t *v = json_array_get(j, 0);
        assert_true(json_is_real(v));  /* always written as a float, like Python */
        assert_true(fabs(json_real_value(v) - want[i]) <= 1e-9 * fabs(want[i]) + 1e-15);
        json_decref(j);
        prism_buf_free(&b);
    }
}

static void test_utf8_complete_prefix(void **state)
{
    (void)state;
    assert_int_equal(prism_utf8_complete_prefix("abc", 3), 3);
    assert_int_equal(prism_utf8_complete_prefix("abc\xE2\x82", 5), 3);
    assert_int_equal(prism_utf8_complete_prefix("abc\xE2\x82\xAC", 6), 6);
    assert_int_equal(prism_utf8_complete_prefix("\xF0\x9F\x98", 3), 0);
    assert_int_equal(prism_utf8_complete_prefix("a\xF0", 2), 1);
    assert_int_equal(prism_utf8_complete_prefix("abc\xFF", 4), 4);      /* invalid: nothing to wait for */
    assert_int_equal(prism_utf8_complete_prefix("ab\xE2\x28", 4), 4);   /* ill-formed already */
    assert_int_equal(prism_utf8_complete_prefix("", 0), 0);
}

static void test_ids_and_meta(void **state)
{
    (void)state;
    char a[64], b[64];
    prism_oai_make_id(a, sizeof a, "chatcmpl-");
    prism_oai_make_id(b, sizeof b, "chatcmpl-");
    assert_int_equal(strlen(a), 9 + 32);
    assert_int_equal(strspn(a + 9, "0123456789abcdef"), 32);
    assert_string_not_equal(a, b);
    prism_oai_resp_meta_t m;
    assert_int_equal(prism_oai_resp_meta_init(&m, false, "we\"ird/\x01model"), PRISM_OK);
    assert_memory_equal(m.id, "cmpl-", 5);
    assert_true(m.created > 1600000000);
    prism_buf_t buf = {0};
    assert_int_equal(prism_oai_write_completion_chunk(&buf, &m, "x", 1, NULL, NULL), PRISM_OK);
    json_t *j = parse_sse(buf.data, buf.len);
    assert_string_equal(json_string_value(json_object_get(j, "model")), "we\"ird/\x01model");
    json_decref(j);
    prism_buf_free(&buf);
    prism_oai_resp_meta_free(&m);
}

static void test_chat_stream_chunks(void **state)
{
    (void)state;
    size_t base = prism_mem_used();
    prism_oai_resp_meta_t m;
    prism_oai_resp_meta_init(&m, true, "llava-1.5");
    prism_buf_t b = {0};

    /* role chunk */
    assert_int_equal(prism_oai_write_chat_chunk(&b, &m, true, "", 0, NULL, NULL), PRISM_OK);
    json_t *j = parse_sse(b.data, b.len);
    assert_string_equal(json_string_value(json_object_get(j, "id")), m.id);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion.chunk");
    assert_int_equal(json_integer_value(json_object_get(j, "created")), m.created);
    assert_string_equal(json_string_value(json_object_get(j, "model")), "llava-1.5");
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    assert_int_equal(json_integer_value(json_object_get(ch, "index")), 0);
    json_t *d = json_object_get(ch, "delta");
    assert_string_equal(json_string_value(json_object_get(d, "role")), "assistant");
    assert_string_equal(json_string_value(json_object_get(d, "content")), "");
    assert_true(json_is_null(json_object_get(ch, "logprobs")));
    assert_true(json_is_null(json_object_get(ch, "finish_reason")));
    json_decref(j);

    /* content chunk with nasty text and logprobs */
    prism_buf_reset(&b);
    prism_oai_logprobs_t lp;
    prism_oai_logprobs_init(&lp, true);
    prism_oai_top_logprob_t top[2] = {{"\xE2\x82", 2, -0.25}, {"\"q\"", 3, -INFINITY}};
    prism_oai_token_logprob_t t = {"\xE2\x82", 2, -0.25, top, 2};
    assert_int_equal(prism_oai_logprobs_add(&lp, &t), PRISM_OK);
    prism_oai_token_logprob_t t2 = {"\xAC!", 2, -1.5, NULL, 0};
    assert_int_equal(prism_oai_logprobs_add(&lp, &t2), PRISM_OK);
    assert_int_equal(prism_oai_write_chat_chunk(&b, &m, false, "line\n\"x\"\xFF", 9, &lp, NULL), PRISM_OK);
    j = parse_sse(b.data, b.len);
    ch = json_array_get(json_object_get(j, "choices"), 0);
    d = json_object_get(ch, "delta");
    assert_null(json_object_get(d, "role"));
    assert_string_equal(json_string_value(json_object_get(d, "content")), "line\n\"x\"\xEF\xBF\xBD");
    json_t *content = json_object_get(json_object_get(ch, "logprobs"), "content");
    assert_int_equal(json_array_size(content), 2);
    json_t *e0 = json_array_get(content, 0);
    assert_string_equal(json_string_value(json_object_get(e0, "token")), "\xEF\xBF\xBD");
    assert_true(json_real_value(json_object_get(e0, "logprob")) == -0.25);
    json_t *bytes = json_object_get(e0, "bytes");  /* raw bytes, so clients can rejoin split characters */
    assert_int_equal(json_array_size(bytes), 2);
    assert_int_equal(json_integer_value(json_array_get(bytes, 0)), 0xE2);
    assert_int_equal(json_integer_value(json_array_get(bytes, 1)), 0x82);
    json_t *tl = json_object_get(e0, "top_logprobs");
    assert_int_equal(json_array_size(tl), 2);
    assert_string_equal(json_string_value(json_object_get(json_array_get(tl, 1), "token")), "\"q\"");
    assert_true(json_real_value(json_object_get(json_array_get(tl, 1), "logprob")) == -9999.0);
    assert_int_equal(json_array_size(json_object_get(json_array_get(tl, 1), "bytes")), 3);
    json_t *e1 = json_array_get(content, 1);
    assert_int_equal(json_array_size(json_object_get(e1, "top_logprobs")), 0);
    json_decref(j);

    /* clear keeps the object usable for the next chunk */
    prism_oai_logprobs_clear(&lp);
    prism_buf_reset(&b);
    assert_int_equal(prism_oai_write_chat_chunk(&b, &m, false, NULL, 0, &lp, "stop"), PRISM_OK);
    j = parse_sse(b.data, b.len);
    ch = json_array_get(json_object_get(j, "choices"), 0);
    assert_int_equal(json_object_size(json_object_get(ch, "delta")), 0);
    assert_int_equal(json_array_size(json_object_get(json_object_get(ch, "logprobs"), "content")), 0);
    assert_string_equal(json_string_value(json_object_get(ch, "finish_reason")), "stop");
    json_decref(j);

    /* usage chunk */
    prism_buf_reset(&b);
    prism_oai_usage_t u = {.prompt_tokens = 600, .completion_tokens = 12, .cached_tokens = -1};
    assert_int_equal(prism_oai_write_usage_chunk(&b, &m, &u), PRISM_OK);
    j = parse_sse(b.data, b.len);
    assert_int_equal(json_array_size(json_object_get(j, "choices")), 0);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion.chunk");
    json_t *us = json_object_get(j, "usage");
    assert_int_equal(json_integer_value(json_object_get(us, "prompt_tokens")), 600);
    assert_int_equal(json_integer_value(json_object_get(us, "completion_tokens")), 12);
    assert_int_equal(json_integer_value(json_object_get(us, "total_tokens")), 612);
    assert_null(json_object_get(us, "prompt_tokens_details"));
    json_decref(j);

    /* error event and DONE */
    prism_buf_reset(&b);
    assert_int_equal(prism_oai_write_sse_error(&b, "InternalServerError", "worker \"d0\" died\n", NULL, "500"), PRISM_OK);
    j = parse_sse(b.data, b.len);
    json_t *err = json_object_get(j, "error");
    assert_string_equal(json_string_value(json_object_get(err, "message")), "worker \"d0\" died\n");
    assert_string_equal(json_string_value(json_object_get(err, "type")), "InternalServerError");
    assert_true(json_is_null(json_object_get(err, "param")));
    assert_string_equal(json_string_value(json_object_get(err, "code")), "500");
    json_decref(j);
    prism_buf_reset(&b);
    assert_int_equal(prism_oai_write_sse_done(&b), PRISM_OK);
    assert_string_equal(b.data, "data: [DONE]\n\n");

    prism_oai_logprobs_free(&lp);
    prism_buf_free(&b);
    prism_oai_resp_meta_free(&m);
    assert_int_equal(prism_mem_used(), base);
}

static void test_chat_response(void **state)
{
    (void)state;
    prism_oai_resp_meta_t m;
    prism_oai_resp_meta_init(&m, true, "m");
    prism_buf_t b = {0};
    prism_oai_usage_t u = {.prompt_tokens = 5, .completion_tokens = 2, .cached_tokens = 3};
    assert_int_equal(prism_oai_write_chat_response(&b, &m, "Hi \xF0\x9F\x98\x80\x01", 8, NULL, "length", &u), PRISM_OK);
    json_t *j = parse_json(&b);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "chat.completion");
    assert_memory_equal(json_string_value(json_object_get(j, "id")), "chatcmpl-", 9);
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    json_t *msg = json_object_get(ch, "message");
    assert_string_equal(json_string_value(json_object_get(msg, "role")), "assistant");
    assert_string_equal(json_string_value(json_object_get(msg, "content")), "Hi \xF0\x9F\x98\x80\x01");
    assert_true(json_is_null(json_object_get(msg, "refusal")));   /* required by the spec, null */
    assert_null(json_object_get(msg, "tool_calls"));
    assert_string_equal(json_string_value(json_object_get(ch, "finish_reason")), "length");
    assert_true(json_is_null(json_object_get(ch, "logprobs")));
    json_t *us = json_object_get(j, "usage");
    assert_int_equal(json_integer_value(json_object_get(us, "total_tokens")), 7);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(us, "prompt_tokens_details"), "cached_tokens")), 3);
    json_decref(j);

    /* with logprobs accumulated over the whole response */
    prism_buf_reset(&b);
    prism_oai_logprobs_t lp;
    prism_oai_logprobs_init(&lp, true);
    for (int i = 0; i < 3; i++) {
        prism_oai_token_logprob_t t = {"ab", 2, -0.1 * i, NULL, 0};
        prism_oai_logprobs_add(&lp, &t);
    }
    assert_int_equal(prism_oai_write_chat_response(&b, &m, "ababab", 6, &lp, "stop", &u), PRISM_OK);
    j = parse_json(&b);
    ch = json_array_get(json_object_get(j, "choices"), 0);
    assert_int_equal(json_array_size(json_object_get(json_object_get(ch, "logprobs"), "content")), 3);
    json_t *lpo = json_object_get(ch, "logprobs");
    assert_true(json_is_null(json_object_get(lpo, "refusal")) && json_object_get(lpo, "refusal"));
    json_decref(j);

    /* several choices, one answering with tool calls only (content null) */
    prism_buf_reset(&b);
    prism_oai_tool_call_t calls[2] = {{"call_1", "get_weather", "{\"city\": \"Paris\"}", 18}, {"call_2", "f", "{}", 2}};
    prism_oai_choice_t c0 = {.index = 0, .content = "plain", .len = 5, .finish_reason = "stop"};
    prism_oai_choice_t c1 = {.index = 1, .content = NULL, .tool_calls = calls, .n_tool_calls = 2, .lp = &lp,
                             .finish_reason = "tool_calls"};
    assert_int_equal(prism_oai_write_response_begin(&b, &m), PRISM_OK);
    assert_int_equal(prism_oai_write_chat_choice(&b, &c0), PRISM_OK);
    assert_int_equal(prism_oai_write_chat_choice(&b, &c1), PRISM_OK);
    assert_int_equal(prism_oai_write_response_end(&b, &u), PRISM_OK);
    j = parse_json(&b);
    json_t *chs = json_object_get(j, "choices");
    assert_int_equal(json_array_size(chs), 2);
    assert_int_equal(json_integer_value(json_object_get(json_array_get(chs, 1), "index")), 1);
    msg = json_object_get(json_array_get(chs, 1), "message");
    assert_true(json_is_null(json_object_get(msg, "content")) && json_object_get(msg, "content"));
    assert_true(json_is_null(json_object_get(msg, "refusal")));
    json_t *tcs = json_object_get(msg, "tool_calls");
    assert_int_equal(json_array_size(tcs), 2);
    json_t *tc0 = json_array_get(tcs, 0);
    assert_string_equal(json_string_value(json_object_get(tc0, "id")), "call_1");
    assert_string_equal(json_string_value(json_object_get(tc0, "type")), "function");
    assert_string_equal(json_string_value(json_object_get(json_object_get(tc0, "function"), "name")), "get_weather");
    assert_string_equal(json_string_value(json_object_get(json_object_get(tc0, "function"), "arguments")),
                        "{\"city\": \"Paris\"}");
    assert_string_equal(json_string_value(json_object_get(json_array_get(chs, 1), "finish_reason")), "tool_calls");
    json_decref(j);

    /* stream deltas: choice index, tool-call entries (first with id / type / name, then arguments) */
    prism_buf_reset(&b);
    prism_oai_tool_delta_t td[2] = {{.index = 0, .id = "call_9", .name = "f", .arguments = "", .arguments_len = 0},
                                    {.index = 0, .arguments = "{\"a\"", .arguments_len = 4}};
    prism_oai_delta_t dd = {.index = 3, .tool_calls = td, .n_tool_calls = 2, .lp = &lp};
    assert_int_equal(prism_oai_write_chat_delta(&b, &m, &dd), PRISM_OK);
    j = parse_sse(b.data, b.len);
    ch = json_array_get(json_object_get(j, "choices"), 0);
    assert_int_equal(json_integer_value(json_object_get(ch, "index")), 3);
    json_t *dl = json_object_get(ch, "delta");
    assert_null(json_object_get(dl, "content"));
    tcs = json_object_get(dl, "tool_calls");
    assert_int_equal(json_array_size(tcs), 2);
    assert_string_equal(json_string_value(json_object_get(json_array_get(tcs, 0), "id")), "call_9");
    assert_string_equal(json_string_value(json_object_get(json_array_get(tcs, 0), "type")), "function");
    assert_null(json_object_get(json_array_get(tcs, 1), "id"));
    assert_null(json_object_get(json_object_get(json_array_get(tcs, 1), "function"), "name"));
    assert_string_equal(json_string_value(json_object_get(json_object_get(json_array_get(tcs, 1), "function"),
                                                          "arguments")), "{\"a\"");
    assert_true(json_is_null(json_object_get(json_object_get(ch, "logprobs"), "refusal")));
    json_decref(j);
    prism_oai_logprobs_free(&lp);

    /* plain error body */
    prism_buf_reset(&b);
    assert_int_equal(prism_oai_write_error(&b, "NotFoundError", "The model `x` does not exist.", "model", NULL), PRISM_OK);
    j = parse_json(&b);
    assert_string_equal(json_string_value(json_object_get(json_object_get(j, "error"), "param")), "model");
    assert_true(json_is_null(json_object_get(json_object_get(j, "error"), "code")));
    json_decref(j);
    prism_buf_free(&b);
    prism_oai_resp_meta_free(&m);
}

static void test_completion_logprobs(void **state)
{
    (void)state;
    size_t base = prism_mem_used();
    prism_oai_resp_meta_t m;
    prism_oai_resp_meta_init(&m, false, "m");
    prism_oai_logprobs_t lp;
    prism_oai_logprobs_init(&lp, false);
    /* "Hé" is 2 code points / 3 bytes; a lone 0xFF counts as one (U+FFFD) */
    prism_oai_top_logprob_t top0[3] = {{"H\xC3\xA9", 3, -0.1}, {"Ha", 2, -2.5}, {"H\xC3\xA9", 3, -7.0}};
    prism_oai_token_logprob_t t0 = {"H\xC3\xA9", 3, -0.1, top0, 3};
    prism_oai_top_logprob_t top1[2] = {{"\xFF", 1, -0.3}, {"\xFE", 1, -0.4}};  /* both become U+FFFD: dedupe */
    prism_oai_token_logprob_t t1 = {"\xFF", 1, -0.3, top1, 2};
    prism_oai_token_logprob_t t2 = {"llo", 3, -INFINITY, NULL, 0};
    assert_int_equal(prism_oai_logprobs_add(&lp, &t0), PRISM_OK);
    assert_int_equal(prism_oai_logprobs_add(&lp, &t1), PRISM_OK);

    /* streamed: first chunk has two tokens */
    prism_buf_t b = {0};
    assert_int_equal(prism_oai_write_completion_chunk(&b, &m, "H\xC3\xA9\xFF", 4, &lp, NULL), PRISM_OK);
    json_t *j = parse_sse(b.data, b.len);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "text_completion");
    json_t *ch = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(ch, "text")), "H\xC3\xA9\xEF\xBF\xBD");
    json_t *l = json_object_get(ch, "logprobs");
    json_t *tokens = json_object_get(l, "tokens");
    assert_int_equal(json_array_size(tokens), 2);
    assert_string_equal(json_string_value(json_array_get(tokens, 0)), "H\xC3\xA9");
    assert_true(json_real_value(json_array_get(json_object_get(l, "token_logprobs"), 1)) == -0.3);
    json_t *tops = json_object_get(l, "top_logprobs");
    assert_int_equal(json_object_size(json_array_get(tops, 0)), 2);  /* duplicate key dropped, first kept */
    assert_true(json_real_value(json_object_get(json_array_get(tops, 0), "H\xC3\xA9")) == -0.1);
    assert_true(json_real_value(json_object_get(json_array_get(tops, 0), "Ha")) == -2.5);
    assert_int_equal(json_object_size(json_array_get(tops, 1)), 1);
    json_t *off = json_object_get(l, "text_offset");
    assert_int_equal(json_integer_value(json_array_get(off, 0)), 0);
    assert_int_equal(json_integer_value(json_array_get(off, 1)), 2);
    json_decref(j);

    /* next chunk: offsets keep counting */
    prism_oai_logprobs_clear(&lp);
    assert_int_equal(prism_oai_logprobs_add(&lp, &t2), PRISM_OK);
    prism_buf_reset(&b);
    assert_int_equal(prism_oai_write_completion_chunk(&b, &m, "llo", 3, &lp, "length"), PRISM_OK);
    j = parse_sse(b.data, b.len);
    ch = json_array_get(json_object_get(j, "choices"), 0);
    l = json_object_get(ch, "logprobs");
    assert_int_equal(json_integer_value(json_array_get(json_object_get(l, "text_offset"), 0)), 3);
    assert_true(json_real_value(json_array_get(json_object_get(l, "token_logprobs"), 0)) == -9999.0);
    assert_int_equal(json_object_size(json_array_get(json_object_get(l, "top_logprobs"), 0)), 0);
    assert_string_equal(json_string_value(json_object_get(ch, "finish_reason")), "length");
    json_decref(j);

    /* whole response */
    prism_buf_reset(&b);
    prism_oai_usage_t u = {.prompt_tokens = 1, .completion_tokens = 3, .cached_tokens = -1};
    assert_int_equal(prism_oai_write_completion_response(&b, &m, "x", 1, &lp, "stop", &u), PRISM_OK);
    j = parse_json(&b);
    assert_string_equal(json_string_value(json_object_get(j, "object")), "text_completion");
    assert_memory_equal(json_string_value(json_object_get(j, "id")), "cmpl-", 5);
    ch = json_array_get(json_object_get(j, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(ch, "text")), "x");
    assert_int_equal(json_integer_value(json_object_get(json_object_get(j, "usage"), "total_tokens")), 4);
    json_decref(j);
    prism_buf_reset(&b);
    assert_int_equal(prism_oai_write_completion_response(&b, &m, NULL, 0, NULL, NULL, NULL), PRISM_OK);
    j = parse_json(&b);
    assert_true(json_is_null(json_object_get(j, "usage")));
    json_decref(j);

    prism_oai_logprobs_free(&lp);
    prism_buf_free(&b);
    prism_oai_resp_meta_free(&m);
    assert_int_equal(prism_mem_used(), base);
}

/* Random bytes through every writer: the output must always be valid JSON. */
static void test_writers_random_bytes(void **state)
{
    (void)state;
    uint64_t s = 0x9E3779B97F4A7C15ull;
    prism_oai_resp_meta_t m;
    prism_oai_resp_meta_init(&m, true, "m");
    for (int it = 0; it < 300; it++) {
        char txt[64];
        size_t n = (size_t)(it % 64);
        for (size_t i = 0; i < n; i++) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            txt[i] = (char)(s & 0xFF);
            if (!txt[i]) txt[i] = 2;  /* jansson cannot load NUL inside object keys (NUL is covered above) */
        }
        prism_oai_logprobs_t lpc, lpx;
        prism_oai_logprobs_init(&lpc, true);
        prism_oai_logprobs_init(&lpx, false);
        prism_oai_top_logprob_t top[3] = {{txt, n / 2, -1.0}, {txt + n / 2, n - n / 2, -2.0}, {txt, n, NAN}};
        prism_oai_token_logprob_t t = {txt, n, -0.5, top, 3};
        assert_int_equal(prism_oai_logprobs_add(&lpc, &t), PRISM_OK);
        assert_int_equal(prism_oai_logprobs_add(&lpx, &t), PRISM_OK);
        prism_buf_t b = {0};
        prism_oai_write_chat_chunk(&b, &m, it % 2, txt, n, &lpc, NULL);
        json_decref(parse_sse(b.data, b.len));
        prism_buf_reset(&b);
        prism_oai_write_completion_chunk(&b, &m, txt, n, &lpx, "stop");
        json_decref(parse_sse(b.data, b.len));
        prism_buf_reset(&b);
        prism_oai_write_chat_response(&b, &m, txt, n, &lpc, "stop", NULL);
        json_decref(parse_json(&b));
        prism_buf_reset(&b);
        prism_oai_write_sse_error(&b, "BadRequestError", "x", NULL, NULL);
        json_decref(parse_sse(b.data, b.len));
        prism_buf_free(&b);
        prism_oai_logprobs_free(&lpc);
        prism_oai_logprobs_free(&lpx);
    }
    prism_oai_resp_meta_free(&m);
}

/* Random mutations of a valid body: parse must return OK or EINVAL, never crash or leak. */
static void test_parse_mutations(void **state)
{
    (void)state;
    const char *seed =
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"hi\"},"
        "{\"type\":\"image_url\",\"image_url\":{\"url\":\"data:x\"}}]}],\"max_tokens\":5,\"stop\":[\"a\"],"
        "\"temperature\":0.7,\"logprobs\":true,\"top_logprobs\":2,\"stream\":true,\"stream_options\":{\"include_usage\":true}}";
    size_t len = strlen(seed);
    char *buf = malloc(len + 1);
    size_t base = prism_mem_used();
    uint64_t s = 12345;
    int ok = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(buf, seed, len + 1);
        for (int k = 0; k < 1 + it % 4; k++) {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            size_t pos = (s >> 8) % len;
            const char alphabet[] = "{}[]\",:0-9.e ntfalsexyz\\";
            buf[pos] = alphabet[(s >> 40) % (sizeof alphabet - 1)];
        }
        prism_oai_request_t r;
        prism_oai_error_t e;
        int rc = prism_oai_parse(buf, len, (it & 1) == 0, NULL, &r, &e);
        assert_true(rc == PRISM_OK || rc == PRISM_EINVAL);
        if (rc == PRISM_OK) ok++;
        else assert_true(e.message[0] != 0);
        prism_oai_request_free(&r);
    }
    assert_true(ok > 0);
    assert_int_equal(prism_mem_used(), base);
    free(buf);
}

int main(void)
{
    prism_log_init("test_openai_req", PRISM_LOG_WARN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_minimal_defaults),
        cmocka_unit_test(test_chat_full),
        cmocka_unit_test(test_guides_and_tools),
        cmocka_unit_test(test_logit_bias_bounds),
        cmocka_unit_test(test_chat_nul_in_text_and_integral_float),
        cmocka_unit_test(test_invalid_requests),
        cmocka_unit_test(test_stop_length_limit),
        cmocka_unit_test(test_image_limits),
        cmocka_unit_test(test_bounds_messages_depth),
        cmocka_unit_test(test_parse_budget),
        cmocka_unit_test(test_worker_limits_and_template_kwargs),
        cmocka_unit_test(test_completions_prompts),
        cmocka_unit_test(test_json_string_escaping),
        cmocka_unit_test(test_logprob_numbers),
        cmocka_unit_test(test_utf8_complete_prefix),
        cmocka_unit_test(test_ids_and_meta),
        cmocka_unit_test(test_chat_stream_chunks),
        cmocka_unit_test(test_chat_response),
        cmocka_unit_test(test_completion_logprobs),
        cmocka_unit_test(test_writers_random_bytes),
        cmocka_unit_test(test_parse_mutations),
        cmocka_unit_test(test_mm_processor_kwargs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
