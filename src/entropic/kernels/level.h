// One ISA level's kernels: included by level_<name>.cpp, which names the level
// (ENTROPIC_LEVEL_NAME, its getter ENTROPIC_LEVEL_GETTER, and ENTROPIC_SIMD_AVX512 /
// ENTROPIC_SIMD_AVX2 / neither for the vectors) and, when the build includes the level
// (ENTROPIC_LEVEL_BUILT), sets the target instruction set first. No ATen here: the math
// is on raw pointers; the op files own arguments, allocation and threads.
//
// Everything is in an anonymous namespace, so that no inline function of one level can be
// merged by the linker with another level's copy (the only external symbol is the getter).
// The build includes only the levels this CPU runs (kernels/__init__.py), so no code of
// another level, shared or not, can run on a CPU that lacks its instructions.

#include "isa.h"

#if defined(ENTROPIC_LEVEL_BUILT)

#if defined(ENTROPIC_SIMD_AVX512) || defined(ENTROPIC_SIMD_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace entropic_kernels {
namespace {

#include "scalar.h"
#include "simd.h"
#include "layer_ops_math.h"
#include "logit_stats_math.h"
#include "decode_attention_math.h"
#if defined(ENTROPIC_SIMD)
#include "prefill_attention_math.h"
#include "quant_linear_math.h"
#endif

template <typename T>
TypedKernels<T> typed_kernels() {
  return {&rms_norm_rows<T>, &rope_kv_rows<T>, &silu_mul_rows<T>, &attend<T>, &key_bounds<T>};
}

}  // namespace

const Kernels* ENTROPIC_LEVEL_GETTER() {
  static const Kernels k = {
      ENTROPIC_LEVEL_NAME,
      typed_kernels<float>(),
      typed_kernels<bf16_bits>(),
      &logit_stats_row,
      &tempered_entropy_row,
#if defined(ENTROPIC_SIMD)
      &int4_prepare, &int4_cols, &int8_prepare, &int8_cols, kQuantActivations, kInt4Run,
      {kPfElemBytes, &pf_pack_block, &pf_item<bf16_bits, !kPfDotLevel>},
      {int64_t(sizeof(float)), &pf32_pack_block<float>, &pf_item<float, true>},
#else
      nullptr, nullptr, nullptr, nullptr, nullptr, 0, {0, nullptr, nullptr},
      {0, nullptr, nullptr},
#endif
  };
  return &k;
}

}  // namespace entropic_kernels

#else

namespace entropic_kernels {
const Kernels* ENTROPIC_LEVEL_GETTER() { return nullptr; }
}  // namespace entropic_kernels

#endif
