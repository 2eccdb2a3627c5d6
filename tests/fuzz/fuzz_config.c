/* libFuzzer: config.json (+ generation_config.json) parsing (common/model/config.c). The input is
 * the config text, optionally followed by a NUL and the generation config text. */
#include "fuzz_common.h"
#include "model/model.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_init_once();
    char *buf = malloc(size + 1);
    memcpy(buf, data, size);
    buf[size] = 0;
    const char *gen = NULL;
    size_t first = strlen(buf);
    if (first < size) gen = buf + first + 1;
    prism_model_config_t cfg;
    char err[512];
    if (prism_model_config_parse(buf, gen, &cfg, err, sizeof err) == PRISM_OK) {
        FUZZ_ASSERT(cfg.hidden > 0 && cfg.n_layers > 0 && cfg.vocab > 0 && cfg.max_pos > 0);
        FUZZ_ASSERT(cfg.head_dim > 0 && cfg.n_heads > 0 && cfg.n_kv_heads > 0);
        float *inv = malloc(sizeof(float) * (size_t)(cfg.head_dim / 2 + 1));
        prism_model_rope_inv_freq(&cfg, inv);
        free(inv);
    } else {
        FUZZ_ASSERT(memchr(err, 0, sizeof err) && err[0]);
    }
    free(buf);
    return 0;
}
