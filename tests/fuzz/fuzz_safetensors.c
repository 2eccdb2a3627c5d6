/* libFuzzer: safetensors parsing (common/model/safetensors.c) from memory: header JSON, dtypes,
 * shapes, offsets; every tensor the parser accepts is read back (small ones whole). */
#include "fuzz_common.h"
#include "model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    fuzz_init_once();
    prism_st_t *st = NULL;
    char err[256];
    if (prism_st_open_memory(data, size, &st, err, sizeof err) != PRISM_OK) {
        FUZZ_ASSERT(st == NULL);
        return 0;
    }
    float buf[256];
    for (int i = 0; i < prism_st_count(st); i++) {
        const prism_st_tensor_t *t = prism_st_get(st, i);
        FUZZ_ASSERT(t && prism_st_find(st, t->name) != NULL);
        FUZZ_ASSERT(t->numel >= 0 && t->nbytes == (size_t)t->numel * prism_st_dtype_size(t->dtype));
        FUZZ_ASSERT((const uint8_t *)t->data >= data && (const uint8_t *)t->data + t->nbytes <= data + size);
        int64_t n = t->numel;
        if (n > 0) {
            (void)prism_st_read_f32(t, 0, n < 256 ? n : 256, buf);
            (void)prism_st_read_f32(t, n - 1, 1, buf);
        }
    }
    prism_st_close(st);
    return 0;
}
