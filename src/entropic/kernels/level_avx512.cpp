// The avx512 level: AVX-512 F/BW/VL/DQ, no BF16 (Skylake-SP, Cascade Lake, Ice Lake).
#if defined(ENTROPIC_BUILD_AVX512) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#define ENTROPIC_LEVEL_BUILT 1
#endif
#define ENTROPIC_LEVEL_NAME "avx512"
#define ENTROPIC_LEVEL_GETTER kernels_avx512
#define ENTROPIC_SIMD_AVX512 1
#include "level.h"
