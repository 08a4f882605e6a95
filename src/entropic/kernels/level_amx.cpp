// The amx level: the avx512bf16 level's kernels, with prefill attention's two products
// (scores and P.V) on AMX-BF16 tiles (Sapphire Rapids and later).
#if defined(ENTROPIC_BUILD_AMX) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")
#define ENTROPIC_LEVEL_BUILT 1
#endif
#define ENTROPIC_LEVEL_NAME "amx"
#define ENTROPIC_LEVEL_GETTER kernels_amx
#define ENTROPIC_LEVEL_BF16 1
#define ENTROPIC_LEVEL_AMX 1
#define ENTROPIC_SIMD_AVX512 1
#include "level.h"
