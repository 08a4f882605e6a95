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
// - avx512, avx2: the same fused multiply-adds one by one in fp32 (a nibble becomes the
//   fp32 128 + q with a shift and an OR), in VDPBF16PS's order, so the three levels agree
//   where the CPU's VDPBF16PS rounds as Intel documents (and without denormals).
// int8: w = scale * (c - 128), c in 0..255.
// - avx512bf16: bytes split into nibbles lo + 16 hi, each an exact bf16 128 + nibble, the
//   high one against 16 x (exact): acc = sum c x + 2176 sum x, y = scale (acc - 2304 sum x);
// - avx512, avx2: c in fp32 (exact) against x in fp32, element j in lane j % 16:
//   y = scale (sum c x - 128 sum x). (Emulating the nibble split would cost twice the work
//   on these levels; so int8 rounds differently there, by fp32 sums' rounding.)

constexpr int64_t kPrefetchBytes = 1024;

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
    // the tile streams from memory: ask for its data a few pairs ahead
    _mm_prefetch(reinterpret_cast<const char*>(cb + (g / 2 * NT) * 32 + kPrefetchBytes),
                 _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cb + (g / 2 * NT) * 32 + kPrefetchBytes + 64),
                 _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sb + g * NT) + kPrefetchBytes / 4, _MM_HINT_T0);
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
      if (h == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(cb + (g / 2 * NT) * 32 + kPrefetchBytes),
                     _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(cb + (g / 2 * NT) * 32 + kPrefetchBytes + 64),
                     _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(sb + g * NT) + kPrefetchBytes / 4,
                     _MM_HINT_T0);
      }
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

void int4_cols(const Int4Args& a, const float* ws, int64_t n_begin, int64_t n_end) {
  over_row_tiles<kQuantRowTile>(a.m_rows, n_begin, n_end, [&](auto mt, int64_t m0, int64_t n0) {
    int4_tile<decltype(mt)::value>(a, ws, m0, n0);
  });
}

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

void int8_cols(const Int8Args& a, const float* ws, int64_t n_begin, int64_t n_end) {
  over_row_tiles<kQuantRowTile>(a.m_rows, n_begin, n_end, [&](auto mt, int64_t m0, int64_t n0) {
    int8_tile<decltype(mt)::value>(a, ws, m0, n0);
  });
}

#endif
