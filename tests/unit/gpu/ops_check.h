/* ops_check: backend-consistency checks (ggml test-backend-ops style). Every op of
 * prism_backend_i runs on a reference backend (the CPU backend) and on the backend under test
 * over seeded random inputs, with odd and non-multiple-of-tile shapes, and the outputs are
 * compared with per-op tolerances (see docs/CUDA.md for why each is what it is).
 *
 * Plain C, no test framework: the cmocka test (tests/unit/gpu) and the standalone tools/gpu
 * gpu_check binary both drive it.
 *
 *   prism_opcheck_t t = {.out = stdout};
 *   prism_opcheck_run(&t, cpu, cuda, NULL);       // all ops; or an op name
 *   return t.n_fail ? 1 : 0;
 */
#ifndef PRISM_OPS_CHECK_H
#define PRISM_OPS_CHECK_H

#include <stdio.h>

#include "backend/backend.h"

typedef struct {
    FILE *out;          /* PASS/FAIL lines (NULL: quiet) */
    bool verbose;       /* a line per case, not only per op */
    bool big;           /* add model-sized cases (slow on a naive CPU reference) */
    int n_pass, n_fail; /* cases */
    int ops_pass, ops_fail;
    char first_fail[256];
} prism_opcheck_t;

/* Names of the op groups, in run order (NULL-terminated). */
extern const char *const prism_opcheck_ops[];

/* Runs the op group `only` (NULL: all). Ops the backend under test leaves NULL are skipped;
 * "sample" and "scatter_rows" run only when dev is a CUDA backend. */
void prism_opcheck_run(prism_opcheck_t *t, prism_backend_t *ref, prism_backend_t *dev, const char *only);

#endif
