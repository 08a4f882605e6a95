// Shared helpers of entropic's native CPU kernels: storage types, bf16 rounding exactly as
// c10::BFloat16 rounds, 16-lane loads and stores, exp on 16 lanes
// (each file defines and registers its own ops).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace entropic_kernels {

using bf16_bits = uint16_t;  // a bfloat16 number's bits

inline float load(const float* p) { return *p; }
inline float load(const bf16_bits* p) {
  uint32_t u = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to the storage type: round-to-nearest-even for bf16, as c10::BFloat16 does.
inline float round_to(float f, const float*) { return f; }
inline float round_to(float f, const bf16_bits*) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) {
    u = 0x7fc00000u;
  } else {
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  }
  float r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

inline void store(float* p, float f) { *p = f; }
inline void store(bf16_bits* p, float f) {  // f must already be rounded (round_to)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  *p = bf16_bits(u >> 16);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_bits* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// 16 lanes rounded as round_to rounds one value
inline __m512 round16(__m512 f, const float*) { return f; }
inline __m512 round16(__m512 f, const bf16_bits*) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(r);
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16_bits* p, __m512 v) {  // v must already be rounded (round16)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
#endif

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

inline void check_cpu_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "entropic kernels: ", name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "entropic kernels: ", name, " must be float32 or bfloat16, got ", t.scalar_type());
}

// Dispatch on the storage type of a float32 / bfloat16 tensor.
template <typename F>
void dispatch(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<bf16_bits*>(nullptr));
  }
}

// Whether this build has the AVX512-BF16 kernels (int4/int8 linear, prefill attention).
inline bool has_avx512_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
// exp on 16 lanes (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3365447505f)),
                    _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#endif

}  // namespace entropic_kernels
