/* Run-time choice of the CPU kernel table: cpuid for the instruction sets, xgetbv for the OS
 * saving the wide registers, PRISM_CPU_ISA for forcing a lower path. */
#include "backend/cpu/cpu_kern.h"

#include <string.h>

#ifdef PRISM_CPU_X86
#include <cpuid.h>

static uint64_t xgetbv0(void)
{
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}
#endif

prism_cpu_isa_t prism_cpu_isa_detect(void)
{
#ifdef PRISM_CPU_X86
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return PRISM_CPU_ISA_SCALAR;
    bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12);
    if (!osxsave || !avx || !fma) return PRISM_CPU_ISA_SCALAR;
    uint64_t xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return PRISM_CPU_ISA_SCALAR;            /* xmm + ymm state */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return PRISM_CPU_ISA_SCALAR;
    bool avx2 = b & (1u << 5), avx512f = b & (1u << 16);
    if (!avx2) return PRISM_CPU_ISA_SCALAR;
    if (!avx512f || (xcr0 & 0xe6) != 0xe6) return PRISM_CPU_ISA_AVX2;   /* + opmask, zmm state */
    /* the bf16 kernels also use the BW (16-bit masked loads) and VL subsets */
    const unsigned dq_bw_vl = (1u << 17) | (1u << 30) | (1u << 31);
    if ((b & dq_bw_vl) == dq_bw_vl && __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)))
        return PRISM_CPU_ISA_AVX512BF16;
    return PRISM_CPU_ISA_AVX512;
#else
    return PRISM_CPU_ISA_SCALAR;
#endif
}

bool prism_cpu_has_avx512_skx(void)
{
#ifdef PRISM_CPU_X86
    unsigned a, b, c, d;
    if (prism_cpu_isa_detect() < PRISM_CPU_ISA_AVX512 || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const unsigned f_dq_bw_vl = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
    return (b & f_dq_bw_vl) == f_dq_bw_vl;
#else
    return false;
#endif
}

bool prism_cpu_has_avx512_bf16(void)
{
    return prism_cpu_isa_detect() == PRISM_CPU_ISA_AVX512BF16;
}

const char *prism_cpu_isa_name(prism_cpu_isa_t isa)
{
    switch (isa) {
    case PRISM_CPU_ISA_SCALAR: return "scalar";
    case PRISM_CPU_ISA_AVX2: return "avx2";
    case PRISM_CPU_ISA_AVX512: return "avx512";
    case PRISM_CPU_ISA_AVX512BF16: return "avx512bf16";
    }
    return "?";
}

static const prism_cpu_kern_t *table(prism_cpu_isa_t isa)
{
    switch (isa) {
#ifdef PRISM_CPU_X86
    case PRISM_CPU_ISA_AVX512BF16: return &prism_cpu_kern_avx512bf16;
    case PRISM_CPU_ISA_AVX512: return &prism_cpu_kern_avx512;
    case PRISM_CPU_ISA_AVX2: return &prism_cpu_kern_avx2;
#endif
    default: return &prism_cpu_kern_scalar;
    }
}

const prism_cpu_kern_t *prism_cpu_kern_select(const char *force)
{
    prism_cpu_isa_t best = prism_cpu_isa_detect(), want = best;
    if (force && *force) {
        if (!strcmp(force, "scalar")) want = PRISM_CPU_ISA_SCALAR;
        else if (!strcmp(force, "avx2")) want = PRISM_CPU_ISA_AVX2;
        else if (!strcmp(force, "avx512")) want = PRISM_CPU_ISA_AVX512;
        else if (!strcmp(force, "avx512bf16")) want = PRISM_CPU_ISA_AVX512BF16;
        else PRISM_WARN("cpu backend: PRISM_CPU_ISA=%s is not scalar|avx2|avx512|avx512bf16; using %s", force,
                        prism_cpu_isa_name(best));
        if (want > best) {
            PRISM_WARN("cpu backend: PRISM_CPU_ISA=%s but this CPU runs at most %s", force, prism_cpu_isa_name(best));
            want = best;
        }
    }
    return table(want);
}
