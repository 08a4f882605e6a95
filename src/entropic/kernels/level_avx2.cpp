// The avx2 level: AVX2 with FMA and F16C, nothing of AVX-512 (Haswell and later, Zen).
#if defined(ENTROPIC_BUILD_AVX2) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c")
#define ENTROPIC_LEVEL_BUILT 1
#endif
#define ENTROPIC_LEVEL_NAME "avx2"
#define ENTROPIC_LEVEL_GETTER kernels_avx2
#define ENTROPIC_SIMD_AVX2 1
#include "level.h"
