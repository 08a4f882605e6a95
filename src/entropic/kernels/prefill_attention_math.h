// The math of prefill_attention.cpp (causal, flash style); included by level.h inside a
// level's namespace, for the levels with vectors.
//
// Each KV head's keys and values are first packed in blocks of 64 keys. Scores and the
// P.V products are sums of exact products of bf16 numbers in fp32; scores, running max,
// softmax sums and output accumulators are fp32; probabilities are rounded to bf16 for P.V
// and the sums add the rounded values, so the weights that meet V sum exactly to the divisor.
// - avx512bf16: AVX512-BF16 dot products over pairs (VDPBF16PS: per lane, acc += the odd
//   pair member's product, then the even one's, each as one fused multiply-add). Packed
//   keys [dim pair][64 keys][2 dims], values [key pair][dim][2 keys], bf16.
// - avx512, avx2: the same fused multiply-adds one by one in fp32, in the same order (odd
//   member of each pair first). Packed keys [dim][64 keys], values [key][dim], fp32.
// - float32 models, at every level with vectors: the fp32 levels' fused multiply-adds over
//   the fp32 cache, with fp32 probabilities (no bf16 rounding anywhere) and an fp32 output.
// - amx: avx512bf16's layouts and softmax, with both products on AMX-BF16 tiles (TDPBF16PS,
//   16 rows x 16 columns x 16 pairs per instruction, over the pairs in the same order). Its
//   rounding within a pair differs from VDPBF16PS's (measured: either order of the pair
//   members gives outputs 1 bf16 ulp apart in places), so amx is close to avx512bf16, not
//   the same bits. Still the same numbers for a row however the prompt is chunked.
// avx512bf16 and the fp32 levels give the same numbers where the CPU's VDPBF16PS rounds as
// Intel documents (and without denormals, which VDPBF16PS flushes). Key blocks are aligned
// to position 0, so a row's sums run over the same blocks in the same order however the
// prompt was chunked.

constexpr int kPfRowTile = 4;  // rows (query position x head) per register tile
// The fp32 path's tile at AVX2: 6 rows x 2 vectors, 12 accumulators of the 16 registers
// (4 x 2 left its fused multiply-adds waiting on loads: 6 loads for 8 of them)
constexpr int kPf32RowTile = W == 8 ? 6 : kPfRowTile;

template <int MaxRows = kPfRowTile, typename F>
void pf_tiles(int64_t rows, F&& f) {
  for (int64_t r0 = 0; r0 < rows; r0 += MaxRows) {
    switch (std::min<int64_t>(MaxRows, rows - r0)) {
      case 6: if constexpr (MaxRows >= 6) f(std::integral_constant<int, 6>{}, r0); break;
      case 5: if constexpr (MaxRows >= 5) f(std::integral_constant<int, 5>{}, r0); break;
      case 4: f(std::integral_constant<int, 4>{}, r0); break;
      case 3: f(std::integral_constant<int, 3>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      default: f(std::integral_constant<int, 1>{}, r0); break;
    }
  }
}

// ---- fp32 fused multiply-adds: the fp32 levels' path for bf16 models, and every level's
// path for float32 models (T: the cache's and q's element type) ----

template <typename T>
void pf32_pack_block(const void* cachev, const int64_t* slots, int64_t nk, int64_t kv_heads,
                     int64_t d, int64_t g, int64_t b, void* kpv, void* vpv) {
  const T* cache = static_cast<const T*>(cachev);
  const int64_t slot_size = 2 * kv_heads * d;
  float* kp = static_cast<float*>(kpv);  // [d][64]
  float* vp = static_cast<float*>(vpv);  // [64][d]
  for (int64_t j = 0; j < kPfKeys; ++j) {
    const int64_t key = b * kPfKeys + j;
    if (key >= nk) {
      for (int64_t i = 0; i < d; ++i) kp[i * kPfKeys + j] = vp[j * d + i] = 0.f;
      continue;
    }
    const T* slot = cache + slots[key] * slot_size;
    const T* kr = slot + g * d;
    const T* vr = slot + (kv_heads + g) * d;
    for (int64_t i = 0; i < d; ++i) kp[i * kPfKeys + j] = load(kr + i);
    for (int64_t i = 0; i < d; ++i) vp[j * d + i] = load(vr + i);
  }
}

struct Pf32Queries {
  const float* row[kPf32RowTile];  // fp32 copies of the rows' queries
};

// Keys (scores) and head dims (P.V) per register pass: 4 x 16 lanes on AVX-512, 2 x 8 on
// AVX2 (16 registers). A pass covers different outputs, so it does not change any sum.
constexpr int kPfChunk = W == 16 ? 4 : 2;

// A loaded vector kept in a register: at AVX2, with 12 accumulators, GCC otherwise folds the
// load into every fused multiply-add that uses it (a load each, the loads then binding).
inline V pf32_in_register(V v) {
#if defined(ENTROPIC_SIMD_AVX2)
  asm("" : "+x"(v));
#endif
  return v;
}

// step(i) for i in 0 .. n - 1 (n even). kPairs (bf16 models): each pair's odd member first,
// as VDPBF16PS adds them; float32 models: in order, one at a time (not unrolled: each step's
// key or value vectors are loaded once for all RT rows).
template <bool kPairs, typename F>
inline void pf32_walk(int64_t n, F&& step) {
  if constexpr (kPairs) {
    for (int64_t i0 = 0; i0 < n; i0 += 2) {
      step(i0 + 1);
      step(i0);
    }
  } else {
#pragma GCC unroll 1
    for (int64_t i = 0; i < n; ++i) step(i);
  }
}

template <int RT, bool kPairs>
void pf32_scores(const Pf32Queries& q, const void* kblkv, int64_t d, float* s) {
  const float* kblk = static_cast<const float*>(kblkv);
  for (int64_t k0 = 0; k0 < kPfKeys; k0 += kPfChunk * W) {
    V acc[RT][kPfChunk];
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < kPfChunk; ++c) acc[r][c] = vzero();
    auto step = [&](int64_t i) {
      V k[kPfChunk];
      for (int c = 0; c < kPfChunk; ++c)
        k[c] = pf32_in_register(vload(kblk + i * kPfKeys + k0 + c * W));
      for (int r = 0; r < RT; ++r) {
        const V qv = vset(q.row[r][i]);
        for (int c = 0; c < kPfChunk; ++c) acc[r][c] = vfma(qv, k[c], acc[r][c]);
      }
    };
    pf32_walk<kPairs>(d, step);
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < kPfChunk; ++c) vstore(s + r * kPfKeys + k0 + c * W, acc[r][c]);
  }
}

// o[r] = alpha[r] * o[r] + P[r] . V for RT rows; P as fp32 p[r][64].
template <int RT, bool kPairs>
void pf32_values(const void* pv, const void* vblkv, int64_t d, float* o, const float* alpha) {
  const float* p = static_cast<const float*>(pv);
  const float* vblk = static_cast<const float*>(vblkv);
  for (int64_t c0 = 0; c0 < d; c0 += kPfChunk * W) {
    V acc[RT][kPfChunk];
    for (int r = 0; r < RT; ++r) {
      const V a = vset(alpha[r]);
      for (int c = 0; c < kPfChunk; ++c) acc[r][c] = vmul(a, vload(o + r * d + c0 + c * W));
    }
    auto step = [&](int64_t j) {
      V v[kPfChunk];
      for (int c = 0; c < kPfChunk; ++c)
        v[c] = pf32_in_register(vload(vblk + j * d + c0 + c * W));
      for (int r = 0; r < RT; ++r) {
        const V pj = vset(p[r * kPfKeys + j]);
        for (int c = 0; c < kPfChunk; ++c) acc[r][c] = vfma(pj, v[c], acc[r][c]);
      }
    };
    pf32_walk<kPairs>(kPfKeys, step);
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < kPfChunk; ++c) vstore(o + r * d + c0 + c * W, acc[r][c]);
  }
}

// One row's probabilities e[4] (keys 0..63) stored as fp32 for P.V; returns their sum (in
// the bf16 level's order). kRound (bf16 models): each rounded to bf16 first, as VCVTNE2PS2BF16
// rounds (nearest even, denormals to zero), so that the fp32 levels give the bf16 level's
// numbers; float32 models keep them as computed.
template <bool kRound>
inline float pf32_store_probs(const F16* e, void* pv) {
  float* pr = static_cast<float*>(pv);
  const F16 tiny = f16_set(std::numeric_limits<float>::min());
  F16 total = f16_zero();
  for (int c = 0; c < 4; ++c) {
    F16 r = e[c];
    if constexpr (kRound)
      r = maskz16(ge16(e[c], tiny), round16(e[c], static_cast<const bf16_bits*>(nullptr)));
    store16(pr + 16 * c, r);
    total = add(total, r);
  }
  return reduce_add16(total);
}

// ---- bf16 dot products (the bf16 levels' path for bf16 models) ----
#if defined(ENTROPIC_LEVEL_BF16)

constexpr bool kPfDotLevel = true;
constexpr int64_t kPfElemBytes = 2;

void pf_pack_block(const void* cachev, const int64_t* slots, int64_t nk, int64_t kv_heads,
                   int64_t d, int64_t g, int64_t b, void* kpv, void* vpv) {
  const bf16_bits* cache = static_cast<const bf16_bits*>(cachev);
  const int64_t slot_size = 2 * kv_heads * d, pairs = d / 2;
  uint32_t* kw = static_cast<uint32_t*>(kpv);
  bf16_bits* vp = static_cast<bf16_bits*>(vpv);
  for (int64_t j = 0; j < kPfKeys; ++j) {
    const int64_t key = b * kPfKeys + j;
    if (key >= nk) {
      for (int64_t p = 0; p < pairs; ++p) kw[p * kPfKeys + j] = 0;
      for (int64_t i = 0; i < d; ++i) vp[((j / 2) * d + i) * 2 + (j & 1)] = 0;
      continue;
    }
    const bf16_bits* slot = cache + slots[key] * slot_size;
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(slot + g * d);
    for (int64_t p = 0; p < pairs; ++p) kw[p * kPfKeys + j] = kr[p];
    const bf16_bits* vr = slot + (kv_heads + g) * d;
    for (int64_t i = 0; i < d; ++i) vp[((j / 2) * d + i) * 2 + (j & 1)] = vr[i];
  }
}

// The rows' queries as the scores read them: dim pairs (bf16 in the item's q rows).
struct PfQueries {
  const uint32_t* row[kPfRowTile];
};

// Scores of RT rows against one block of 64 keys: s[r][64] (unscaled).
template <int RT>
void pf_scores(const PfQueries& q, const void* kblkv, int64_t d, float* s) {
  const bf16_bits* kblk = static_cast<const bf16_bits*>(kblkv);
  const int64_t pairs = d / 2;
  __m512 acc[RT][4];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[4];
    for (int c = 0; c < 4; ++c)
      k[c] = (__m512bh)_mm512_loadu_si512(kblk + (p * kPfKeys + 16 * c) * 2);
    for (int r = 0; r < RT; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(int(q.row[r][p]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, k[c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kPfKeys + 16 * c, acc[r][c]);
}

// o[r] = alpha[r] * o[r] + P[r] . V for RT rows; P as bf16 key pairs p[r][32].
template <int RT>
void pf_values(const void* pv, const void* vblkv, int64_t d, float* o, const float* alpha) {
  const uint32_t* pw = static_cast<const uint32_t*>(pv);
  const bf16_bits* vblk = static_cast<const bf16_bits*>(vblkv);
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    __m512 acc[RT][4];
    for (int r = 0; r < RT; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int c = 0; c < 4; ++c)
        acc[r][c] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * d + c0 + 16 * c));
    }
    for (int64_t kp = 0; kp < kPfKeys / 2; ++kp) {
      __m512bh v[4];
      for (int c = 0; c < 4; ++c)
        v[c] = (__m512bh)_mm512_loadu_si512(vblk + (kp * d + c0 + 16 * c) * 2);
      for (int r = 0; r < RT; ++r) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(int(pw[r * (kPfKeys / 2) + kp]));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, v[c]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * d + c0 + 16 * c, acc[r][c]);
  }
}

// One row's probabilities e[4] (keys 0..63, fp32) rounded to bf16 and stored as P.V reads
// them (key pairs); returns their sum.
inline float pf_store_probs(const F16* e, void* pv) {
  uint32_t* pr = static_cast<uint32_t*>(pv);
  __m512 total = _mm512_setzero_ps();
  for (int c = 0; c < 4; c += 2) {
    const __m512i pi = (__m512i)_mm512_cvtne2ps_pbh(e[c + 1].p[0], e[c].p[0]);
    _mm512_storeu_si512(pr + 8 * c, pi);
    total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm512_castsi512_si256(pi)), 16)));
    total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pi, 1)), 16)));
  }
  return reduce_add16(F16{{total}});
}
constexpr int64_t kPfProbFloats = kPfKeys / 2;  // workspace floats of one row's P

#if defined(ENTROPIC_LEVEL_AMX)

// Tile registers as used here: 0-3 accumulators (16 rows x 16 fp32), 4 the A operand (16 rows
// x 16 bf16 pairs), 5-7 B operands (16 pairs x 16 columns); each 16 rows of 64 bytes.
struct alignas(64) PfTileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads the tile shapes (per thread; other code, oneDNN's among it, sets its own).
inline void pf_tiles_begin() {
  PfTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

constexpr int64_t kPfRowPad = 16;  // rows (query position x head) per tile

// Accumulators 0-3 += A (tile 4) x the four B tiles of 16 columns at b, b + 64, b + 128 and
// b + 192 bytes (rows `stride` bytes apart); B tiles loaded ahead of the products that use
// them.
inline void pf_dp4(const char* b, int64_t stride) {
  _tile_loadd(5, b, stride);
  _tile_loadd(6, b + 64, stride);
  _tile_loadd(7, b + 128, stride);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(5, b + 192, stride);
  _tile_dpbf16ps(1, 4, 6);
  _tile_dpbf16ps(2, 4, 7);
  _tile_dpbf16ps(3, 4, 5);
}

// Stores accumulators 0-3 as 16 rows of 64 floats at c (rows `stride` bytes apart).
inline void pf_store4(float* c, int64_t stride) {
  _tile_stored(0, c, stride);
  _tile_stored(1, c + 16, stride);
  _tile_stored(2, c + 32, stride);
  _tile_stored(3, c + 48, stride);
}

// Scores of `rows` rows (a multiple of 16) against one block of 64 keys: s[r][64]
// (unscaled). q: the rows' queries, bf16, d per row.
inline void pf_block_scores(const bf16_bits* q, int64_t rows, const void* kblkv, int64_t d,
                            float* s) {
  const char* kblk = static_cast<const char*>(kblkv);
  constexpr int64_t pair_row = kPfKeys * 4;  // bytes of one dim pair's 64 keys
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ks = 0; ks < d / 32; ++ks) {  // 16 dim pairs per step, in order
      _tile_loadd(4, q + r0 * d + ks * 32, d * 2);
      pf_dp4(kblk + ks * 16 * pair_row, pair_row);
    }
    pf_store4(s + r0 * kPfKeys, kPfKeys * 4);
  }
}

// o[r] = alpha[r] * o[r] + P[r] . V for `rows` rows (a multiple of 16); P as bf16 key pairs
// p[r][32]. alpha * o first, as the VDPBF16PS path starts its chains.
inline void pf_block_values(const void* pv, int64_t rows, const void* vblkv, int64_t d,
                            float* o, const float* alpha) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int64_t c = 0; c < d; c += 16)
      _mm512_storeu_ps(o + r * d + c, _mm512_mul_ps(a, _mm512_loadu_ps(o + r * d + c)));
  }
  const char* p = static_cast<const char*>(pv);
  const char* vblk = static_cast<const char*>(vblkv);
  const int64_t o_row = d * 4, v_row = d * 4, p_row = kPfProbFloats * 4;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    for (int64_t c0 = 0; c0 < d; c0 += 64) {
      float* oc = o + r0 * d + c0;
      _tile_loadd(0, oc, o_row);
      _tile_loadd(1, oc + 16, o_row);
      _tile_loadd(2, oc + 32, o_row);
      _tile_loadd(3, oc + 48, o_row);
      for (int64_t ks = 0; ks < kPfKeys / 32; ++ks) {  // 16 key pairs per step, in order
        _tile_loadd(4, p + r0 * p_row + ks * 64, p_row);
        pf_dp4(vblk + ks * 16 * v_row + c0 * 4, v_row);
      }
      pf_store4(oc, o_row);
    }
  }
}
#endif

#else

constexpr bool kPfDotLevel = false;
constexpr int64_t kPfElemBytes = 4;
constexpr int64_t kPfProbFloats = kPfKeys;

// bf16 models pack as float32 ones do (fp32 keys and values)
void pf_pack_block(const void* cache, const int64_t* slots, int64_t nk, int64_t kv_heads,
                   int64_t d, int64_t g, int64_t b, void* kp, void* vp) {
  pf32_pack_block<bf16_bits>(cache, slots, nk, kv_heads, d, g, b, kp, vp);
}

#endif

// One work item: query positions [qb * 16, +16) with the heads of KV head g. T: q's, the
// cache's and the output's element type; kFma: the fp32 fused multiply-adds (pf32_*), else
// the bf16 level's dot products (bf16 models on the bf16 levels).
template <typename T, bool kFma>
void pf_item(const PrefillArgs& a, int64_t g, int64_t qb, float* ws) {
  constexpr bool kDot = !kFma;
  static_assert(kFma || (kPfDotLevel && std::is_same_v<T, bf16_bits>));
  constexpr int64_t prob_floats = kDot ? kPfProbFloats : kPfKeys;
  constexpr bool kPairs = std::is_same_v<T, bf16_bits>;  // the bf16 level's order
  const int64_t rep = a.heads / a.kv_heads, d = a.d;
  const int64_t i0 = qb * kPfQueries, nq = std::min(kPfQueries, a.q_len - i0), rows = nq * rep;
  int64_t rows_p = rows;
#if defined(ENTROPIC_LEVEL_AMX)
  // whole tiles of rows; the padding rows' queries and probabilities are zeros
  if constexpr (kDot) rows_p = (rows + kPfRowPad - 1) / kPfRowPad * kPfRowPad;
#endif
  float* o = ws;
  float* s = o + rows_p * d;
  float* mx = s + rows_p * kPfKeys;
  float* sum = mx + rows_p;
  float* alpha = sum + rows_p;
  float* probs = alpha + rows_p;  // rows x prob_floats
  float* qf = probs + rows_p * prob_floats;  // kFma: the rows' queries in fp32 (amx: bf16)
  std::fill(o, o + rows_p * d, 0.f);
  for (int64_t r = 0; r < rows_p; ++r) {
    mx[r] = -std::numeric_limits<float>::infinity();
    sum[r] = 0.f;
    alpha[r] = 1.f;
  }
  const T* q = static_cast<const T*>(a.q);
  auto q_row = [&](int64_t r) {
    return q + (i0 + r / rep) * a.q_stride + (g * rep + r % rep) * d;
  };
#if defined(ENTROPIC_LEVEL_AMX)
  bf16_bits* qs = reinterpret_cast<bf16_bits*>(qf);  // rows_p x d
  (void)qs;
  if constexpr (kDot) {
    std::fill(probs + rows * kPfProbFloats, probs + rows_p * kPfProbFloats, 0.f);
    for (int64_t r = 0; r < rows_p; ++r) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(qs + r * d);
      const uint32_t* src = reinterpret_cast<const uint32_t*>(r < rows ? q_row(r) : nullptr);
      for (int64_t p = 0; p < d / 2; ++p) dst[p] = src ? src[p] : 0u;  // padding rows: 0
    }
    pf_tiles_begin();
  }
#endif
  if constexpr (kFma) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < d; ++i) qf[r * d + i] = load(q_row(r) + i);
  }
  const int64_t nblk = (a.start + i0 + nq - 1) / kPfKeys + 1;
  const int64_t block_bytes = kPfKeys * d * (kDot ? kPfElemBytes : int64_t(sizeof(float)));
  const F16 scale = f16_set(a.scale);
  const F16 minus_inf = f16_set(-std::numeric_limits<float>::infinity());
  for (int64_t b = 0; b < nblk; ++b) {
    if (a.keep != nullptr && !a.keep[b]) continue;  // a block-sparse item skips it
    const char* kblk = static_cast<const char*>(a.kp) + (g * a.blocks + b) * block_bytes;
    const char* vblk = static_cast<const char*>(a.vp) + (g * a.blocks + b) * block_bytes;
    if constexpr (kDot) {
#if defined(ENTROPIC_LEVEL_AMX)
      pf_block_scores(qs, rows_p, kblk, d, s);
#elif defined(ENTROPIC_LEVEL_BF16)
      pf_tiles(rows, [&](auto rt, int64_t r0) {
        PfQueries qr{};
        for (int t = 0; t < rt; ++t)
          qr.row[t] = reinterpret_cast<const uint32_t*>(q_row(r0 + t));
        pf_scores<decltype(rt)::value>(qr, kblk, d, s + r0 * kPfKeys);
      });
#endif
    } else {
      pf_tiles<kPf32RowTile>(rows, [&](auto rt, int64_t r0) {
        Pf32Queries qr{};
        for (int t = 0; t < rt; ++t) qr.row[t] = qf + (r0 + t) * d;
        pf32_scores<decltype(rt)::value, kPairs>(qr, kblk, d, s + r0 * kPfKeys);
      });
    }
    for (int64_t r = 0; r < rows; ++r) {
      // keys up to the row's own position
      const int64_t valid = std::min<int64_t>(kPfKeys, a.start + i0 + r / rep - b * kPfKeys + 1);
      float* pr = probs + r * prob_floats;
      if (valid <= 0) {  // the whole block lies after this row's position
        alpha[r] = 1.f;
        std::fill(pr, pr + prob_floats, 0.f);
        continue;
      }
      F16 x[4], e[4];
      M16 m[4];
      F16 bm = minus_inf;
      for (int c = 0; c < 4; ++c) {
        m[c] = first16(valid - 16 * c);
        x[c] = mul(load16(s + r * kPfKeys + 16 * c), scale);
        bm = select16(m[c], max16(bm, x[c]), bm);
      }
      const float m_new = std::max(mx[r], reduce_max16(bm));
      alpha[r] = std::exp(mx[r] - m_new);  // exp(-inf) = 0 on the first block
      mx[r] = m_new;
      for (int c = 0; c < 4; ++c) e[c] = maskz16(m[c], exp16(sub(x[c], f16_set(m_new))));
      float block_sum;
      if constexpr (kDot) {
#if defined(ENTROPIC_LEVEL_BF16)
        block_sum = pf_store_probs(e, pr);
#endif
      } else {
        block_sum = pf32_store_probs<kPairs>(e, pr);
      }
      sum[r] = sum[r] * alpha[r] + block_sum;
    }
    if constexpr (kDot) {
#if defined(ENTROPIC_LEVEL_AMX)
      pf_block_values(probs, rows_p, vblk, d, o, alpha);
#elif defined(ENTROPIC_LEVEL_BF16)
      pf_tiles(rows, [&](auto rt, int64_t r0) {
        pf_values<decltype(rt)::value>(probs + r0 * kPfProbFloats, vblk, d, o + r0 * d,
                                       alpha + r0);
      });
#endif
    } else {
      pf_tiles<kPf32RowTile>(rows, [&](auto rt, int64_t r0) {
        pf32_values<decltype(rt)::value, kPairs>(probs + r0 * kPfKeys, vblk, d, o + r0 * d,
                                                 alpha + r0);
      });
    }
  }
#if defined(ENTROPIC_LEVEL_AMX)
  if constexpr (kDot) _tile_release();
#endif
  T* out = static_cast<T*>(a.out);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r / rep, h = g * rep + r % rep;
    T* dst = out + i * a.heads * d + h * d;
    const F16 inv = f16_set(1.f / sum[r]);
    for (int64_t c = 0; c < d; c += 16)
      store16(dst + c, round16(mul(load16(o + r * d + c), inv), dst));
  }
}

