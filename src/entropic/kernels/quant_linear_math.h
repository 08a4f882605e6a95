// The math of quant_linear.cpp (weight-only int4 and int8 linears, bf16 activations, fp32
// sums); included by level.h inside a level's namespace, for the levels with vectors.
// Every output (row m, column n) is summed in the same order whatever M, the tiling and the
// thread count: a row's result does not depend on the other rows of the call.
//
// int4: y = x @ W.T with W in groups of 32 inputs, w = scale * q + offset, q in 0..15. A
// group's codes meet the activations as the numbers 128 + q (exact in bf16), in 16 lanes of
// pairs (elements 2i, 2i + 1); the extra 128 * scale is taken off the offset at load time
// (offset128), and the offsets meet the activations' group sums.
// - avx512bf16: one VDPBF16PS per group (a nibble becomes the bf16 128 + q with one OR);
// - avx512: the same fused multiply-adds one by one in fp32 (a nibble becomes the fp32
//   128 + q with a shift and an OR), in VDPBF16PS's order, so the levels agree where the
//   CPU's VDPBF16PS rounds as Intel documents (and without denormals);
// - avx2: integer dot products against activations rounded to int16 per group of 32
//   (below), so it differs from the others by that rounding (at most 2^-16 of a group's
//   largest value).
// int8: w = scale * (c - 128), c in 0..255.
// - avx512bf16: bytes split into nibbles lo + 16 hi, each an exact bf16 128 + nibble, the
//   high one against 16 x (exact): acc = sum c x + 2176 sum x, y = scale (acc - 2304 sum x);
// - avx512: c in fp32 (exact) against x in fp32, element j in lane j % 16:
//   y = scale (sum c x - 128 sum x). (Emulating the nibble split would cost twice the work
//   on this level; so int8 rounds differently there, by fp32 sums' rounding.)
// - avx2: integer dot products against activations rounded to int16 per group of 32.

constexpr int64_t kPrefetchBytes = 1024;
#if defined(ENTROPIC_SIMD_AVX2)
constexpr const char* kQuantActivations = "int16";  // rounded per group of 32 (below)
constexpr int kInt4Run = 4;  // runs of 4 codes, 4 columns side by side (below)
#else
constexpr const char* kQuantActivations = "bf16";  // as given
constexpr int kInt4Run = 32;  // each column's 32 codes in one run
#endif

template <int MaxRows, typename Tile>
void over_row_tiles(int64_t m_rows, int64_t n_begin, int64_t n_end, Tile&& tile) {
  for (int64_t m0 = 0; m0 < m_rows; m0 += MaxRows) {
    const int64_t mt = std::min<int64_t>(MaxRows, m_rows - m0);
    for (int64_t n0 = n_begin; n0 < n_end; n0 += kColTile) {
      switch (mt) {
        case 4: if constexpr (MaxRows >= 4) tile(std::integral_constant<int, 4>{}, m0, n0); break;
        case 3: if constexpr (MaxRows >= 3) tile(std::integral_constant<int, 3>{}, m0, n0); break;
        case 2: tile(std::integral_constant<int, 2>{}, m0, n0); break;
        default: tile(std::integral_constant<int, 1>{}, m0, n0); break;
      }
    }
  }
}

// An int4 tile streams from memory: ask for the codes and scales (float or fp16 bits) of
// the group pair at g a few pairs ahead (as many groups ahead for both: a group's codes are
// 64 bytes, its scales 4 * sizeof(S)).
template <typename S>
inline void prefetch_int4_pair(const uint8_t* cb, const S* sb, int64_t g) {
  const char* codes = reinterpret_cast<const char*>(cb + (g / 2 * kColTile) * 32);
  _mm_prefetch(codes + kPrefetchBytes, _MM_HINT_T0);
  _mm_prefetch(codes + kPrefetchBytes + 64, _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(sb + g * kColTile) +
                   kPrefetchBytes * int64_t(sizeof(S)) / 16,
               _MM_HINT_T0);
}

// The offsets against the group sums, 16 groups at a time (a scalar chain of one fma per
// group cost ~as much as the codes' dot products at batch 1).
inline float offsets_dot(const float* on, const float* xs, int64_t groups) {
  F16 o = f16_zero();
  int64_t g = 0;
  for (; g + 16 <= groups; g += 16) o = fmadd(load16(on + g), load16(xs + g), o);
  if (g < groups) {
    const M16 rest = first16(groups - g);
    o = fmadd(load16_masked(on + g, rest), load16_masked(xs + g, rest), o);
  }
  return reduce_add16(o);
}

// int4, shared: the group sums of each activation row, xsum[m][g] (the first m * groups
// floats of the workspace).
inline void int4_group_sums(const Int4Args& a, float* xsum) {
  for (int64_t m = 0; m < a.m_rows; ++m) {
    const bf16_bits* xr = a.x + m * a.x_stride;
    for (int64_t g = 0; g < a.groups; ++g)
      xsum[m * a.groups + g] = reduce_add16(add(load16(xr + g * 32), load16(xr + g * 32 + 16)));
  }
}

#if defined(ENTROPIC_LEVEL_BF16)

constexpr int kQuantRowTile = 4;

void int4_prepare(const Int4Args& a, float* ws) { int4_group_sums(a, ws); }

// One tile of MT rows x kColTile columns, accumulators in registers (compile-time sizes).
// The tile's codes and scales are contiguous, read front to back.
template <int MT>
void int4_tile(const Int4Args& a, const float* xsum, int64_t m0, int64_t n0) {
  constexpr int NT = kColTile;
  const __m512i low4 = _mm512_set1_epi16(0x000f), bias = _mm512_set1_epi16(0x4300);
  __m512 acc[NT][MT];
  for (int c = 0; c < NT; ++c)
    for (int t = 0; t < MT; ++t) acc[c][t] = _mm512_setzero_ps();
  const int64_t tile = n0 / NT;
  const uint8_t* cb = a.codes + tile * a.row_bytes * NT;
  const float* sb = a.scale + tile * a.groups * NT;
  for (int64_t g = 0; g < a.groups; g += 2) {
    prefetch_int4_pair(cb, sb, g);
    __m512bh w0[NT], w1[NT];
    for (int c = 0; c < NT; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(cb + (g / 2 * NT + c) * 32)));
      w0[c] = (__m512bh)_mm512_ternarylogic_epi32(v, low4, bias, 0xEA);  // (v & 15) | bias
      w1[c] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
    }
    for (int t = 0; t < MT; ++t) {
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(a.x + (m0 + t) * a.x_stride + g * 32);
      for (int c = 0; c < NT; ++c)
        acc[c][t] = _mm512_fmadd_ps(_mm512_set1_ps(sb[g * NT + c]),
                                    _mm512_dpbf16_ps(_mm512_setzero_ps(), w0[c], x0), acc[c][t]);
    }
    if (g + 1 < a.groups) {
      for (int t = 0; t < MT; ++t) {
        const __m512bh x1 =
            (__m512bh)_mm512_loadu_si512(a.x + (m0 + t) * a.x_stride + g * 32 + 32);
        for (int c = 0; c < NT; ++c)
          acc[c][t] = _mm512_fmadd_ps(_mm512_set1_ps(sb[(g + 1) * NT + c]),
                                      _mm512_dpbf16_ps(_mm512_setzero_ps(), w1[c], x1),
                                      acc[c][t]);
      }
    }
  }
  for (int c = 0; c < NT && n0 + c < a.n_cols; ++c) {  // padding columns are not stored
    for (int t = 0; t < MT; ++t) {
      const float v = vreduce16(&acc[c][t]) +
                      offsets_dot(a.offset + (n0 + c) * a.groups, xsum + (m0 + t) * a.groups,
                                  a.groups);
      bf16_bits* out = a.y + (m0 + t) * a.n_cols + n0 + c;
      store(out, round_to(v, out));
    }
  }
}

void int4_cols(const Int4Args& a, const float* ws, int64_t n_begin, int64_t n_end) {
  over_row_tiles<kQuantRowTile>(a.m_rows, n_begin, n_end, [&](auto mt, int64_t m0, int64_t n0) {
    int4_tile<decltype(mt)::value>(a, ws, m0, n0);
  });
}

// int8: contiguous copies of x and 16 x (exact: a power of two), and each row's sum;
// ws = [xsum: m][x: m * k bf16][16 x: m * k bf16].
void int8_prepare(const Int8Args& a, float* ws) {
  const int64_t k = a.k;
  bf16_bits* xc = reinterpret_cast<bf16_bits*>(ws + a.m_rows);
  bf16_bits* x16 = xc + a.m_rows * k;
  for (int64_t m = 0; m < a.m_rows; ++m) {
    F16 total = f16_zero();
    for (int64_t i = 0; i < k; i += 16) {
      const F16 v = load16(a.x + m * a.x_stride + i);
      total = add(total, v);
      store16(xc + m * k + i, v);
      store16(x16 + m * k + i, mul(v, f16_set(16.f)));
    }
    ws[m] = reduce_add16(total);
  }
}

template <int MT>
void int8_tile(const Int8Args& a, const float* ws, int64_t m0, int64_t n0) {
  constexpr int NT = kColTile;
  const int64_t k = a.k;
  const bf16_bits* x = reinterpret_cast<const bf16_bits*>(ws + a.m_rows);
  const bf16_bits* x16 = x + a.m_rows * k;
  const __m512i low4 = _mm512_set1_epi16(0x000f), bias = _mm512_set1_epi16(0x4300);
  __m512 acc[NT][MT];
  for (int c = 0; c < NT; ++c)
    for (int t = 0; t < MT; ++t) acc[c][t] = _mm512_setzero_ps();
  const uint8_t* cb = a.codes + (n0 / NT) * NT * k;
  for (int64_t g = 0; g < k / 32; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(cb + g * NT * 32 + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cb + g * NT * 32 + kPrefetchBytes + 64),
                 _MM_HINT_T0);
    __m512bh lo[NT], hi[NT];
    for (int c = 0; c < NT; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + (g * NT + c) * 32)));
      lo[c] = (__m512bh)_mm512_ternarylogic_epi32(v, low4, bias, 0xEA);
      hi[c] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
    }
    for (int t = 0; t < MT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + t) * k + g * 32);
      const __m512bh xv16 = (__m512bh)_mm512_loadu_si512(x16 + (m0 + t) * k + g * 32);
      for (int c = 0; c < NT; ++c)
        acc[c][t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[c][t], lo[c], xv), hi[c], xv16);
    }
  }
  for (int c = 0; c < NT && n0 + c < a.n_cols; ++c) {
    for (int t = 0; t < MT; ++t) {
      const float v = a.scale[n0 + c] * (vreduce16(&acc[c][t]) - 2304.f * ws[m0 + t]);
      bf16_bits* out = a.y + (m0 + t) * a.n_cols + n0 + c;
      store(out, round_to(v, out));
    }
  }
}

void int8_cols(const Int8Args& a, const float* ws, int64_t n_begin, int64_t n_end) {
  over_row_tiles<kQuantRowTile>(a.m_rows, n_begin, n_end, [&](auto mt, int64_t m0, int64_t n0) {
    int8_tile<decltype(mt)::value>(a, ws, m0, n0);
  });
}

#else  // fp32 fused multiply-adds

// Rows per register tile: 4 x 4 accumulators on AVX-512 (32 registers), 2 x 4 on AVX2 (16).
constexpr int kQuantRowTile = W == 16 ? 4 : 2;

#if defined(ENTROPIC_SIMD_AVX2)

// int4 at AVX2: integer dot products. Each activation group of 32 is rounded to int16 with
// its own scale (dx = max|x| / 32767, xq = round-half-even(x / dx): an error of at most
// 2^-16 of the group's largest value); the 4-bit codes, widened to 16 bits, meet xq through
// VPMADDWD (16 products and pair sums an instruction, exact in int32), and each group's
// int32 sums are scaled by scale * dx in fp32. The offsets meet the exact fp32 group sums
// of x, as at the other levels. fp32 FMA on 8 lanes (the avx512 code at half width) was
// bound by its arithmetic here, not by the bytes of the codes: by count ~25 instructions
// for 32 products, this ~8; measured, a fifth off the time (docs/performance.md).
// 8-bit activations (VPMADDUBSW, as llama.cpp's Q8 dot products) halve the instructions a
// product again but cost fidelity: with the int8 lm_head's at 8 bits too, top-1 agreement
// with fp32 0.92 instead of 0.97; for the int4 projections alone, KL 0.0048 instead of
// 0.0025, for a tile 0.8x the time at one row and no gain a decode step could show
// (docs/performance.md, "Decode and prefill attention at AVX2").
// A group whose sum is not finite gets dx = NaN, so a NaN or an infinity in x reaches y.
// int8 rounds its activations the same way (below).
//
// ws = [xsum: m * groups][dx: m * groups][xq: m * groups * 128 int16]: each group's 32
// rounded activations as 8 chunks of 4, each chunk 4 times over (what int4_tile multiplies
// the 4 columns of a chunk of codes with, read from memory instead of broadcast per tile)

// (F: float or const float, the workspace as the caller holds it)
template <typename F>
F* int4_dx(const Int4Args& a, F* ws) { return ws + a.m_rows * a.groups; }
template <typename F>
auto int4_xq(const Int4Args& a, F* ws) {
  using I = std::conditional_t<std::is_const_v<F>, const int16_t, int16_t>;
  return reinterpret_cast<I*>(ws + 2 * a.m_rows * a.groups);
}

// Keeps v in a register as it is at this point: GCC re-associates a chain of integer adds
// into a tree whose partial sums spill to the stack (exact either way: only the registers
// differ).
inline void pin(__m256i& v) { asm("" : "+x"(v)); }
// 4 int16 activations (8 bytes) in every 64-bit lane
inline __m256i broadcast4(const int16_t* x) {
  return _mm256_broadcastq_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
}
inline __m256i load_i16(const int16_t* x) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
}
// the 4 floats at s as [s0, s0, s1, s1, s2, s2, s3, s3]
inline __m256 scale_pairs(const float* s, __m256i halves) {
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(s)), halves);
}

// One group of 32 activations to int16: dx = max|x| / 32767 and xq = round-half-even(x / dx),
// in order; dx = 0 (xq = 0) for a group of zeros, NaN where the group's sum is not finite.
inline void quantize_group32(const bf16_bits* x, float* dx, int16_t* xq) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  V v[4];
  for (int i = 0; i < 4; ++i) v[i] = vload(x + i * 8);
  const V amax = vmax(vmax(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                      vmax(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  alignas(32) float lanes[8];
  vstore(lanes, amax);
  float mx = lanes[0];
  for (int i = 1; i < 8; ++i) mx = std::max(mx, lanes[i]);
  __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
  // (max drops NaNs, a sum keeps them and infinities)
  if (!std::isfinite(reduce8(vadd(vadd(v[0], v[1]), vadd(v[2], v[3]))))) {
    *dx = std::numeric_limits<float>::quiet_NaN();
  } else if (mx == 0.f) {
    *dx = 0.f;
  } else {
    const float d = mx / 32767.f;
    *dx = d;
    const V dv = vset(d);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(vround(vdiv(v[i], dv)));
    // packs work within 128-bit halves; the permutation puts the 16 numbers back in order
    lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
    hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq), lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 16), hi);
}

// The same, each chunk of 4 written 4 times over (128 int16: what the 4-column tiles
// multiply a chunk of codes with)
inline void quantize_group32_x4(const bf16_bits* x, float* dx, int16_t* out) {
  alignas(32) int16_t group[32];
  quantize_group32(x, dx, group);
  for (int i = 0; i < 8; ++i)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i * 16), broadcast4(group + i * 4));
}

void int4_prepare(const Int4Args& a, float* ws) {
  int4_group_sums(a, ws);
  float* dx = int4_dx(a, ws);
  int16_t* xq = int4_xq(a, ws);
  for (int64_t m = 0; m < a.m_rows; ++m)
    for (int64_t g = 0; g < a.groups; ++g)
      quantize_group32_x4(a.x + m * a.x_stride + g * 32, dx + m * a.groups + g,
                          xq + (m * a.groups + g) * 128);
}

// the 4 fp16 numbers at s as [s0, s0, s1, s1, s2, s2, s3, s3]
inline __m256 half_pairs(const uint16_t* s, __m256i halves) {
  return _mm256_permutevar8x32_ps(
      _mm256_castps128_ps256(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s)))),
      halves);
}
// The fp16 offsets (themselves, not offset128) against the group sums
inline float offsets_dot_half(const uint16_t* on, const float* xs, int64_t groups) {
  __m256 o = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8)
    o = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(on + g))),
                        _mm256_loadu_ps(xs + g), o);
  float r = reduce8(o);
  for (; g < groups; ++g) r = std::fma(_cvtsh_ss(on[g]), xs[g], r);
  return r;
}

// The codes of a tile's pair of groups come in 8 chunks of 16 bytes (int4_run 4): chunk i
// holds elements 4i..4i+3 of each of the 4 columns, column after column. Widened to 16 bits,
// a chunk meets the 4 activations 4i..4i+3 broadcast 4 times, so one VPMADDWD serves all
// 4 columns: int32 lane 2c + h sums column c's elements 4i + 2h and 4i + 2h + 1. Over the 8
// chunks a lane sums 16 of the group's 32 products, exactly; each group then costs one
// conversion, one scaling and one FMA for the whole tile (per column, as the 32-byte column
// runs needed, 4 of each), and an accumulator lane holds one half of one column.
//
// Half: fp16 scales [tiles, groups, 4] and offsets [n, groups] (a.scale16, a.offset16), where
// a GGUF's Q4_0/Q4_1 values are exact: 5 bytes of weights a group of 32 and column instead of
// 6. The sum is then scale * dx * (codes . xq) + offset * sum(x), without the offset128 form.
template <int MT, bool Half>
void int4_tile_as(const Int4Args& a, const float* ws, int64_t m0, int64_t n0) {
  constexpr int NT = kColTile;
  const int64_t groups = a.groups;
  // each row's activations, scales and group sums, hoisted: read through `a` in the loop,
  // they would be reloaded for every chunk (the compiler cannot tell that the stores of the
  // accumulators leave `a` alone)
  const int16_t* xr[MT];
  const float* dr[MT];
  const float* sr[MT];
  for (int t = 0; t < MT; ++t) {
    xr[t] = int4_xq(a, ws) + (m0 + t) * groups * 128;
    dr[t] = int4_dx(a, ws) + (m0 + t) * groups;
    sr[t] = ws + (m0 + t) * groups;  // xsum
  }
  const __m256i low4 = _mm256_set1_epi16(0x000f);
  const __m256i halves = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);  // lane 2c + h: column c
  __m256 acc[MT];
  __m128 off[MT];  // the 4 columns' sum over groups of scale * xsum (times 128 at the end)
  for (int t = 0; t < MT; ++t) {
    acc[t] = _mm256_setzero_ps();
    off[t] = _mm_setzero_ps();
  }
  const int64_t tile = n0 / NT;
  const uint8_t* cb = a.codes + tile * a.row_bytes * NT;
  const float* sb = Half ? nullptr : a.scale + tile * a.groups * NT;
  const uint16_t* hs = Half ? a.scale16 + tile * a.groups * NT : nullptr;
  // One pair of groups (g, g + 1), or the last group alone (Pair false): no branch inside,
  // so that the accumulators stay in registers.
  const auto step = [&](int64_t g, auto pair_tag) {
    constexpr bool kPair = decltype(pair_tag)::value;
    const uint8_t* run = cb + g / 2 * NT * 32;
    __m256i lo[MT], hi[MT];
    for (int t = 0; t < MT; ++t) lo[t] = hi[t] = _mm256_setzero_si256();
#pragma GCC unroll 8  // the accumulators stay in registers only if i and t are constants
    for (int i = 0; i < 8; ++i) {
      // byte 4c + e of chunk i: element 4i + e of column c, group g in the low nibble,
      // group g + 1 in the high one; widened to 16 bits, (u & 15) and u >> 4
      const __m256i u =
          _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(run + i * 16)));
      const __m256i u0 = _mm256_and_si256(u, low4);
#pragma GCC unroll 4
      for (int t = 0; t < MT; ++t) {
        const int16_t* xg = xr[t] + g * 128 + i * 16;
        lo[t] = _mm256_add_epi32(lo[t], _mm256_madd_epi16(u0, load_i16(xg)));
        if constexpr (kPair)
          hi[t] = _mm256_add_epi32(
              hi[t], _mm256_madd_epi16(_mm256_srli_epi16(u, 4), load_i16(xg + 128)));
        pin(lo[t]);
        pin(hi[t]);
      }
    }
    // each column's scale in both of its lanes
    __m256 s0, s1;
    if constexpr (Half) {
      s0 = half_pairs(hs + g * NT, halves);
      s1 = kPair ? half_pairs(hs + (g + 1) * NT, halves) : s0;
    } else {
      s0 = scale_pairs(sb + g * NT, halves);
      s1 = kPair ? scale_pairs(sb + (g + 1) * NT, halves) : s0;
    }
    for (int t = 0; t < MT; ++t) {
      if constexpr (!Half)
        off[t] = _mm_fmadd_ps(_mm_loadu_ps(sb + g * NT), _mm_set1_ps(sr[t][g]), off[t]);
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[t]),
                               _mm256_mul_ps(s0, _mm256_broadcast_ss(dr[t] + g)), acc[t]);
      if constexpr (kPair) {
        if constexpr (!Half)
          off[t] = _mm_fmadd_ps(_mm_loadu_ps(sb + (g + 1) * NT), _mm_set1_ps(sr[t][g + 1]),
                                off[t]);
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi[t]),
                                 _mm256_mul_ps(s1, _mm256_broadcast_ss(dr[t] + g + 1)), acc[t]);
      }
    }
  };
  const int64_t paired = groups / 2 * 2;
  for (int64_t g = 0; g < paired; g += 2) {
    if constexpr (Half)
      prefetch_int4_pair(cb, hs, g);
    else
      prefetch_int4_pair(cb, sb, g);
    step(g, std::true_type{});
  }
  if (paired < groups) step(paired, std::false_type{});
  for (int t = 0; t < MT; ++t) {
    alignas(32) float h[2 * NT];
    _mm256_store_ps(h, acc[t]);
    alignas(16) float o[NT];
    if constexpr (!Half) _mm_store_ps(o, _mm_mul_ps(off[t], _mm_set1_ps(128.f)));
    for (int c = 0; c < NT && n0 + c < a.n_cols; ++c) {  // padding columns are not stored
      const float v =
          Half ? (h[2 * c] + h[2 * c + 1]) +
                     offsets_dot_half(a.offset16 + (n0 + c) * groups, sr[t], groups)
               : (h[2 * c] + h[2 * c + 1]) + o[c] +
                     offsets_dot(a.offset + (n0 + c) * groups, sr[t], groups);
      bf16_bits* out = a.y + (m0 + t) * a.n_cols + n0 + c;
      store(out, round_to(v, out));
    }
  }
}

template <int MT>
void int4_tile(const Int4Args& a, const float* ws, int64_t m0, int64_t n0) {
  if (a.scale16 != nullptr)
    int4_tile_as<MT, true>(a, ws, m0, n0);
  else
    int4_tile_as<MT, false>(a, ws, m0, n0);
}

#else  // avx512: fp32 FMA, in VDPBF16PS's order

// ws = [xsum: m * groups][x: m * groups * 32 fp32, each group's even elements, then its odd]
void int4_prepare(const Int4Args& a, float* ws) {
  int4_group_sums(a, ws);
  float* xf = ws + a.m_rows * a.groups;
  for (int64_t m = 0; m < a.m_rows; ++m) {
    const bf16_bits* xr = a.x + m * a.x_stride;
    for (int64_t g = 0; g < a.groups; ++g) {
      float* dst = xf + (m * a.groups + g) * 32;
      for (int i = 0; i < 16; ++i) {
        dst[i] = load(xr + g * 32 + 2 * i);
        dst[16 + i] = load(xr + g * 32 + 2 * i + 1);
      }
    }
  }
}

// The group sums of 16 lanes are computed W lanes at a time (16 / W passes over the tile's
// codes, which stay in cache), each pass's sums stored to `part`.
template <int MT>
void int4_tile(const Int4Args& a, const float* ws, int64_t m0, int64_t n0) {
  constexpr int NT = kColTile;
  const float* xsum = ws;
  const float* xf = ws + a.m_rows * a.groups;
  const VI nibble = iset(0x000f0000), bias = iset(0x43000000);  // fp32 128 + q: 0x4300 << 16
  alignas(64) float part[NT][MT][16];
  const int64_t tile = n0 / NT;
  const uint8_t* cb = a.codes + tile * a.row_bytes * NT;
  const float* sb = a.scale + tile * a.groups * NT;
  for (int h = 0; h < 16 / W; ++h) {  // lanes h * W .. (pairs of elements, of bytes)
    V acc[NT][MT];
    for (int c = 0; c < NT; ++c)
      for (int t = 0; t < MT; ++t) acc[c][t] = vzero();
    for (int64_t g = 0; g < a.groups; g += 2) {
      if (h == 0) prefetch_int4_pair(cb, sb, g);
      const bool pair = g + 1 < a.groups;
      for (int c = 0; c < NT; ++c) {
        // lane i: bytes 2i (low) and 2i + 1; low nibbles group g, high nibbles group g + 1
        const VI u = iload_u16(cb + (g / 2 * NT + c) * 32 + h * W * 2);
        const V w0e = vbits(iand_or(ishl<16>(u), nibble, bias));
        const V w0o = vbits(iand_or(ishl<8>(u), nibble, bias));
        const V w1e = vbits(iand_or(ishl<12>(u), nibble, bias));
        const V w1o = vbits(iand_or(ishl<4>(u), nibble, bias));
        const V s0 = vset(sb[g * NT + c]);
        const V s1 = vset(pair ? sb[(g + 1) * NT + c] : 0.f);
        for (int t = 0; t < MT; ++t) {
          const float* xg = xf + ((m0 + t) * a.groups + g) * 32 + h * W;
          const V d0 = vfma(w0e, vload(xg), vfma(w0o, vload(xg + 16), vzero()));
          acc[c][t] = vfma(s0, d0, acc[c][t]);
          if (pair) {
            const V d1 = vfma(w1e, vload(xg + 32), vfma(w1o, vload(xg + 48), vzero()));
            acc[c][t] = vfma(s1, d1, acc[c][t]);
          }
        }
      }
    }
    for (int c = 0; c < NT; ++c)
      for (int t = 0; t < MT; ++t) vstore(part[c][t] + h * W, acc[c][t]);
  }
  for (int c = 0; c < NT && n0 + c < a.n_cols; ++c) {  // padding columns are not stored
    for (int t = 0; t < MT; ++t) {
      const float v = reduce_add16(load16(part[c][t])) +
                      offsets_dot(a.offset + (n0 + c) * a.groups, xsum + (m0 + t) * a.groups,
                                  a.groups);
      bf16_bits* out = a.y + (m0 + t) * a.n_cols + n0 + c;
      store(out, round_to(v, out));
    }
  }
}

#endif

#if defined(ENTROPIC_SIMD_AVX2)
// The 4-column tiles hold 3 registers a row for int4 (4 with fp32 scales' offsets), 2 for
// int8: 4 rows about fit the 16 registers, and every 4 rows read the codes once, not every 2.
constexpr int kIntRowTile = 4;
#else
constexpr int kIntRowTile = kQuantRowTile;
#endif

void int4_cols(const Int4Args& a, const float* ws, int64_t n_begin, int64_t n_end) {
  over_row_tiles<kIntRowTile>(a.m_rows, n_begin, n_end, [&](auto mt, int64_t m0, int64_t n0) {
    int4_tile<decltype(mt)::value>(a, ws, m0, n0);
  });
}

#if defined(ENTROPIC_SIMD_AVX2)

// int8 at AVX2: the activations rounded to int16 per group of 32 as for int4; a code c
// meets them as the 16-bit number c - 128 (VPMADDWD, exact products and int32 sums). The
// codes of a tile's group (128 bytes) come in the int4 tile's order (int4_run 4): 8 chunks
// of 4 bytes a column, the 4 columns side by side, so one VPMADDWD serves the 4 columns
// against the activations prepared 4 times over, and a lane sums 16 of the group's 32
// products (up to 2^26: the conversion to fp32 rounds above 2^24, one rounding like the
// FMA's). 2 registers a row: tiles of up to 4 rows.
// ws = [dx: m * k / 32][xq: m * k / 32 * 128 int16]
void int8_prepare(const Int8Args& a, float* ws) {
  const int64_t groups = a.k / 32;
  int16_t* xq = reinterpret_cast<int16_t*>(ws + a.m_rows * groups);
  for (int64_t m = 0; m < a.m_rows; ++m)
    for (int64_t g = 0; g < groups; ++g)
      quantize_group32_x4(a.x + m * a.x_stride + g * 32, ws + m * groups + g,
                          xq + (m * groups + g) * 128);
}

template <int MT>
void int8_tile(const Int8Args& a, const float* ws, int64_t m0, int64_t n0) {
  constexpr int NT = kColTile;
  const int64_t k = a.k, groups = k / 32;
  const float* dx = ws;
  const int16_t* xq = reinterpret_cast<const int16_t*>(ws + a.m_rows * groups);
  const __m256i bias = _mm256_set1_epi16(128);
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  const uint8_t* cb = a.codes + (n0 / NT) * NT * k;
  for (int64_t g = 0; g < groups; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(cb + g * NT * 32 + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cb + g * NT * 32 + kPrefetchBytes + 64),
                 _MM_HINT_T0);
    __m256i sum[MT];
    for (int t = 0; t < MT; ++t) sum[t] = _mm256_setzero_si256();
#pragma GCC unroll 8  // (as in int4_tile)
    for (int i = 0; i < 8; ++i) {
      const __m256i w = _mm256_sub_epi16(
          _mm256_cvtepu8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(cb + g * NT * 32 + i * 16))),
          bias);
#pragma GCC unroll 4
      for (int t = 0; t < MT; ++t) {
        sum[t] = _mm256_add_epi32(
            sum[t], _mm256_madd_epi16(w, load_i16(xq + ((m0 + t) * groups + g) * 128 + i * 16)));
        pin(sum[t]);
      }
    }
    for (int t = 0; t < MT; ++t)
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[t]),
                               _mm256_broadcast_ss(dx + (m0 + t) * groups + g), acc[t]);
  }
  for (int t = 0; t < MT; ++t) {
    alignas(32) float h[2 * NT];
    _mm256_store_ps(h, acc[t]);
    for (int c = 0; c < NT && n0 + c < a.n_cols; ++c) {
      const float v = a.scale[n0 + c] * (h[2 * c] + h[2 * c + 1]);
      bf16_bits* out = a.y + (m0 + t) * a.n_cols + n0 + c;
      store(out, round_to(v, out));
    }
  }
}

#else  // avx512: fp32 FMA

// ws = [xsum: m][x: m * k fp32]
void int8_prepare(const Int8Args& a, float* ws) {
  const int64_t k = a.k;
  float* xf = ws + a.m_rows;
  for (int64_t m = 0; m < a.m_rows; ++m) {
    F16 total = f16_zero();
    for (int64_t i = 0; i < k; i += 16) {
      const F16 v = load16(a.x + m * a.x_stride + i);
      total = add(total, v);
      store16(xf + m * k + i, v);
    }
    ws[m] = reduce_add16(total);
  }
}

template <int MT>
void int8_tile(const Int8Args& a, const float* ws, int64_t m0, int64_t n0) {
  constexpr int NT = kColTile;
  const int64_t k = a.k;
  const float* xf = ws + a.m_rows;
  alignas(64) float part[NT][MT][16];
  const uint8_t* cb = a.codes + (n0 / NT) * NT * k;
  for (int h = 0; h < 16 / W; ++h) {  // lanes h * W ..: elements h * W + (0 and 16) of a group
    V acc[NT][MT];
    for (int c = 0; c < NT; ++c)
      for (int t = 0; t < MT; ++t) acc[c][t] = vzero();
    for (int64_t g = 0; g < k / 32; ++g) {
      if (h == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(cb + g * NT * 32 + kPrefetchBytes),
                     _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(cb + g * NT * 32 + kPrefetchBytes + 64),
                     _MM_HINT_T0);
      }
      for (int c = 0; c < NT; ++c) {
        const uint8_t* run = cb + (g * NT + c) * 32 + h * W;
        const V lo = vcvt(iload_u8(run)), hi = vcvt(iload_u8(run + 16));
        for (int t = 0; t < MT; ++t) {
          const float* xg = xf + (m0 + t) * k + g * 32 + h * W;
          acc[c][t] = vfma(hi, vload(xg + 16), vfma(lo, vload(xg), acc[c][t]));
        }
      }
    }
    for (int c = 0; c < NT; ++c)
      for (int t = 0; t < MT; ++t) vstore(part[c][t] + h * W, acc[c][t]);
  }
  for (int c = 0; c < NT && n0 + c < a.n_cols; ++c) {
    for (int t = 0; t < MT; ++t) {
      const float v = a.scale[n0 + c] * (reduce_add16(load16(part[c][t])) - 128.f * ws[m0 + t]);
      bf16_bits* out = a.y + (m0 + t) * a.n_cols + n0 + c;
      store(out, round_to(v, out));
    }
  }
}

#endif

void int8_cols(const Int8Args& a, const float* ws, int64_t n_begin, int64_t n_end) {
  over_row_tiles<kIntRowTile>(a.m_rows, n_begin, n_end, [&](auto mt, int64_t m0, int64_t n0) {
    int8_tile<decltype(mt)::value>(a, ws, m0, n0);
  });
}

#endif
