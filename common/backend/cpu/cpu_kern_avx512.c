/* AVX-512F instantiation of the vector kernels (this file alone is compiled with -mavx512f
 * -mavx2 -mfma; its table is used only when cpuid reports AVX-512F and the OS saves zmm state). */
#include "backend/cpu/cpu_kern_avx512.h"

#define KTABLE prism_cpu_kern_avx512
#define KNAME  "avx512"
#define KISA   PRISM_CPU_ISA_AVX512
#include "backend/cpu/cpu_kern_simd.h"
