// The vector vocabulary of the levels' math, for the level being compiled (level.h defines
// ENTROPIC_SIMD_AVX512 or ENTROPIC_SIMD_AVX2 and includes this inside the level's namespace).
//
// Two sizes:
// - V: one native register of W fp32 lanes (16 on AVX-512, 8 on AVX2), for the register-
//   blocked loops (quantized linears, prefill attention), which walk 16 lanes in 16 / W
//   passes where the lane structure matters;
// - F16: 16 fp32 lanes, one or two registers, for everything else.
// Every operation is the same IEEE operation lane by lane at both levels, and reduce_add16
// adds the 16 lanes in one fixed tree (the one GCC's _mm512_reduce_add_ps uses), so a kernel
// written with these gives the same bits at either level.

#if defined(ENTROPIC_SIMD_AVX512)

constexpr int W = 16;
using V = __m512;
using VI = __m512i;
using VM = __mmask16;

inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float f) { return _mm512_set1_ps(f); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V vload(const bf16_bits* p) {  // W bf16 numbers as fp32 (exact)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void vstore(bf16_bits* p, V v) {  // v already rounded to bf16: keep the high halves
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
inline V vfnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b
inline V vround(V x) {  // to the nearest integer, ties to even
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
inline V vscale2(V p, V n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
inline VM vfirst(int64_t n) {  // lanes 0 .. n - 1
  return n <= 0 ? VM(0) : n >= W ? VM(0xffff) : VM((1u << n) - 1);
}
inline VM vgt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline VM vge(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
inline VM vneq(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ); }
inline VM vunord(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
inline VM mor(VM a, VM b) { return VM(a | b); }
inline bool many(VM m) { return m != 0; }
inline V vmaskz(VM m, V a) { return _mm512_maskz_mov_ps(m, a); }
inline V vselect(VM m, V a, V b) { return _mm512_mask_blend_ps(m, b, a); }  // m ? a : b
inline V vload_masked(const float* p, VM m) { return _mm512_maskz_loadu_ps(m, p); }
inline void vstore_masked(float* p, VM m, V v) { _mm512_mask_storeu_ps(p, m, v); }

inline VI iset(int32_t i) { return _mm512_set1_epi32(i); }
inline VI iiota() { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
inline VI iadd(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI iselect(VM m, VI a, VI b) { return _mm512_mask_blend_epi32(m, b, a); }
inline void istore(int32_t* p, VI v) { _mm512_storeu_si512(p, v); }
inline V vbits(VI i) { return _mm512_castsi512_ps(i); }
inline VI ibits(V f) { return _mm512_castps_si512(f); }
template <int N>
inline VI ishl(VI a) { return _mm512_slli_epi32(a, N); }
inline VI iand(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI iand_or(VI a, VI mask, VI bits) {  // (a & mask) | bits
  return _mm512_ternarylogic_epi32(a, mask, bits, 0xEA);
}
inline VI iload_u16(const void* p) {  // W 16-bit numbers, zero-extended
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline VI iload_u8(const void* p) {  // W bytes, zero-extended
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VI iload(const void* p) { return _mm512_loadu_si512(p); }
inline V vcvt(VI i) { return _mm512_cvtepi32_ps(i); }

// lanes 0..15 summed: (hi 8 + lo 8), (hi 4 + lo 4), [0] + [2], [1] + [3], then [0] + [1]
inline float reduce8(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
inline float vreduce16(const V* v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[0]), 1));
  return reduce8(_mm256_add_ps(hi, _mm512_castps512_ps256(v[0])));
}

#elif defined(ENTROPIC_SIMD_AVX2)

constexpr int W = 8;
using V = __m256;
using VI = __m256i;
using VM = __m256;  // lanes of all ones or all zeros

inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float f) { return _mm256_set1_ps(f); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V vload(const bf16_bits* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void vstore(bf16_bits* p, V v) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v), 16);  // 8 x 16 bits
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi),
                                          _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm256_min_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V vfnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
inline V vround(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V vscale2(V p, V n) {
  // p * 2^n for integral n in [-127, 128] (exp16's range) as two exact powers of two, so the
  // product rounds once, as VSCALEFPS rounds it
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const V p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const V p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, p1), p2);
}
inline VM vfirst(int64_t n) {
  const int32_t c = n <= 0 ? 0 : n >= W ? W : int32_t(n);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline VM vgt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline VM vge(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
inline VM vneq(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_NEQ_OQ); }
inline VM vunord(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); }
inline VM mor(VM a, VM b) { return _mm256_or_ps(a, b); }
inline bool many(VM m) { return _mm256_movemask_ps(m) != 0; }
inline V vmaskz(VM m, V a) { return _mm256_and_ps(m, a); }
inline V vselect(VM m, V a, V b) { return _mm256_blendv_ps(b, a, m); }
inline V vload_masked(const float* p, VM m) {
  return _mm256_maskload_ps(p, _mm256_castps_si256(m));
}
inline void vstore_masked(float* p, VM m, V v) {
  _mm256_maskstore_ps(p, _mm256_castps_si256(m), v);
}

inline VI iset(int32_t i) { return _mm256_set1_epi32(i); }
inline VI iiota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline VI iadd(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI iselect(VM m, VI a, VI b) {
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(b), _mm256_castsi256_ps(a), m));
}
inline void istore(int32_t* p, VI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline V vbits(VI i) { return _mm256_castsi256_ps(i); }
inline VI ibits(V f) { return _mm256_castps_si256(f); }
template <int N>
inline VI ishl(VI a) { return _mm256_slli_epi32(a, N); }
inline VI iand(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI iand_or(VI a, VI mask, VI bits) { return _mm256_or_si256(_mm256_and_si256(a, mask), bits); }
inline VI iload_u16(const void* p) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VI iload_u8(const void* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline VI iload(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline V vcvt(VI i) { return _mm256_cvtepi32_ps(i); }

inline float reduce8(__m256 s8) {
  const __m128 s4 = _mm_add_ps(_mm256_extractf128_ps(s8, 1), _mm256_castps256_ps128(s8));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
inline float vreduce16(const V* v) { return reduce8(_mm256_add_ps(v[1], v[0])); }

#endif

#if defined(ENTROPIC_SIMD_AVX512) || defined(ENTROPIC_SIMD_AVX2)
#define ENTROPIC_SIMD 1

// ---- 16 lanes ------------------------------------------------------------------------------

constexpr int kParts = 16 / W;
struct F16 {
  V p[kParts];
};
struct I16 {
  VI p[kParts];
};
struct M16 {
  VM p[kParts];
};

#define ENTROPIC_F16_MAP(expr) \
  F16 r;                       \
  for (int i = 0; i < kParts; ++i) r.p[i] = (expr); \
  return r

inline F16 f16_zero() { ENTROPIC_F16_MAP(vzero()); }
inline F16 f16_set(float f) { ENTROPIC_F16_MAP(vset(f)); }
inline F16 load16(const float* p) { ENTROPIC_F16_MAP(vload(p + i * W)); }
inline F16 load16(const bf16_bits* p) { ENTROPIC_F16_MAP(vload(p + i * W)); }
inline void store16(float* p, F16 v) {
  for (int i = 0; i < kParts; ++i) vstore(p + i * W, v.p[i]);
}
inline void store16(bf16_bits* p, F16 v) {  // v must already be rounded (round16)
  for (int i = 0; i < kParts; ++i) vstore(p + i * W, v.p[i]);
}
inline F16 add(F16 a, F16 b) { ENTROPIC_F16_MAP(vadd(a.p[i], b.p[i])); }
inline F16 sub(F16 a, F16 b) { ENTROPIC_F16_MAP(vsub(a.p[i], b.p[i])); }
inline F16 mul(F16 a, F16 b) { ENTROPIC_F16_MAP(vmul(a.p[i], b.p[i])); }
inline F16 div(F16 a, F16 b) { ENTROPIC_F16_MAP(vdiv(a.p[i], b.p[i])); }
inline F16 max16(F16 a, F16 b) { ENTROPIC_F16_MAP(vmax(a.p[i], b.p[i])); }
inline F16 fmadd(F16 a, F16 b, F16 c) { ENTROPIC_F16_MAP(vfma(a.p[i], b.p[i], c.p[i])); }
inline F16 maskz16(M16 m, F16 a) { ENTROPIC_F16_MAP(vmaskz(m.p[i], a.p[i])); }
inline F16 select16(M16 m, F16 a, F16 b) { ENTROPIC_F16_MAP(vselect(m.p[i], a.p[i], b.p[i])); }
inline F16 load16_masked(const float* p, M16 m) { ENTROPIC_F16_MAP(vload_masked(p + i * W, m.p[i])); }
inline void store16_masked(float* p, M16 m, F16 v) {
  for (int i = 0; i < kParts; ++i) vstore_masked(p + i * W, m.p[i], v.p[i]);
}
#undef ENTROPIC_F16_MAP

#define ENTROPIC_M16_MAP(expr) \
  M16 r;                       \
  for (int i = 0; i < kParts; ++i) r.p[i] = (expr); \
  return r
inline M16 first16(int64_t n) { ENTROPIC_M16_MAP(vfirst(n - i * W)); }
inline M16 gt16(F16 a, F16 b) { ENTROPIC_M16_MAP(vgt(a.p[i], b.p[i])); }
inline M16 ge16(F16 a, F16 b) { ENTROPIC_M16_MAP(vge(a.p[i], b.p[i])); }
inline M16 neq16(F16 a, F16 b) { ENTROPIC_M16_MAP(vneq(a.p[i], b.p[i])); }
inline M16 unord16(F16 a, F16 b) { ENTROPIC_M16_MAP(vunord(a.p[i], b.p[i])); }
inline M16 or16(M16 a, M16 b) { ENTROPIC_M16_MAP(mor(a.p[i], b.p[i])); }
#undef ENTROPIC_M16_MAP
inline bool any16(M16 m) {
  bool r = false;
  for (int i = 0; i < kParts; ++i) r = r || many(m.p[i]);
  return r;
}

inline I16 i16_set(int32_t v) {
  I16 r;
  for (int i = 0; i < kParts; ++i) r.p[i] = iset(v);
  return r;
}
inline I16 i16_iota() {
  I16 r;
  for (int i = 0; i < kParts; ++i) r.p[i] = iadd(iiota(), iset(i * W));
  return r;
}
inline I16 i16_add(I16 a, int32_t b) {
  I16 r;
  for (int i = 0; i < kParts; ++i) r.p[i] = iadd(a.p[i], iset(b));
  return r;
}
inline I16 i16_select(M16 m, I16 a, I16 b) {
  I16 r;
  for (int i = 0; i < kParts; ++i) r.p[i] = iselect(m.p[i], a.p[i], b.p[i]);
  return r;
}
inline void i16_store(int32_t* p, I16 v) {
  for (int i = 0; i < kParts; ++i) istore(p + i * W, v.p[i]);
}

inline float reduce_add16(F16 v) { return vreduce16(v.p); }
inline float reduce_max16(F16 v) {  // max is exact: any order
  alignas(64) float l[16];
  store16(l, v);
  float m = l[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, l[i]);
  return m;
}

// bf16 rounding of 16 lanes, as round_to rounds one value (NaN to the quiet NaN)
inline F16 round16(F16 f, const float*) { return f; }
inline F16 round16(F16 f, const bf16_bits*) {
  F16 r;
  for (int i = 0; i < kParts; ++i) {
    const VI u = ibits(f.p[i]);
    VI t;
#if defined(ENTROPIC_SIMD_AVX512)
    const VI lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), iset(1));
    t = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, iset(0x7fff))),
                         iset(int32_t(0xffff0000u)));
#else
    const VI lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), iset(1));
    t = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, iset(0x7fff))),
                         iset(int32_t(0xffff0000u)));
#endif
    r.p[i] = vselect(vunord(f.p[i], f.p[i]), vbits(iset(0x7fc00000)), vbits(t));
  }
  return r;
}

// exp on 16 lanes (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp)
inline F16 exp16(F16 x) {
  F16 r;
  for (int i = 0; i < kParts; ++i) {
    V v = vmin(vmax(x.p[i], vset(-87.3365447505f)), vset(88.3762626647949f));
    const V n = vround(vmul(v, vset(1.44269504088896341f)));
    V t = vfnma(n, vset(0.693359375f), v);
    t = vfnma(n, vset(-2.12194440e-4f), t);
    V p = vset(1.9875691500e-4f);
    p = vfma(p, t, vset(1.3981999507e-3f));
    p = vfma(p, t, vset(8.3334519073e-3f));
    p = vfma(p, t, vset(4.1665795894e-2f));
    p = vfma(p, t, vset(1.6666665459e-1f));
    p = vfma(p, t, vset(5.0000001201e-1f));
    p = vfma(p, vmul(t, t), vadd(t, vset(1.f)));
    r.p[i] = vscale2(p, n);
  }
  return r;
}

#endif  // ENTROPIC_SIMD
