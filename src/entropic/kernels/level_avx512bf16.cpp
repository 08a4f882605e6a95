// The avx512bf16 level: AVX-512 F/BW/VL/DQ with BF16 (Cooper Lake, Sapphire Rapids, Zen 4).
#if defined(ENTROPIC_BUILD_AVX512BF16) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
#define ENTROPIC_LEVEL_BUILT 1
#endif
#define ENTROPIC_LEVEL_NAME "avx512bf16"
#define ENTROPIC_LEVEL_GETTER kernels_avx512bf16
#define ENTROPIC_LEVEL_BF16 1
#define ENTROPIC_SIMD_AVX512 1
#include "level.h"
