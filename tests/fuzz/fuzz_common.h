/* Shared by the libFuzzer harnesses: quiet logging, and an assert that libFuzzer reports as a crash. */
#ifndef PRISM_FUZZ_COMMON_H
#define PRISM_FUZZ_COMMON_H

#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FUZZ_ASSERT(c)                                                                  \
    do {                                                                                \
        if (!(c)) {                                                                     \
            fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", __FILE__, __LINE__, #c); \
            abort();                                                                    \
        }                                                                               \
    } while (0)

static inline void fuzz_init_once(void)
{
    static int done;
    if (!done) {
        prism_log_init("fuzz", PRISM_LOG_ERROR + 1);  /* silence: errors are expected */
        done = 1;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#endif
