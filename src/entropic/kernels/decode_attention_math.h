// The math of decode_attention.cpp: one row's new token against one KV head and the `rep`
// query heads that share it, read in place from the paged cache. Scores and softmax in fp32.
// Included by level.h inside a level's namespace.

// Dot product of an fp32 query with one stored key (16 independent lanes: vectorizes).
template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    for (int l = 0; l < 16; ++l) lanes[l] += q[i + l] * load(k + i + l);
  }
  float s = 0.f;
  for (int l = 0; l < 16; ++l) s += lanes[l];
  for (; i < d; ++i) s += q[i] * load(k + i);
  return s;
}

// Normalize each head's output by its softmax sum, store it rounded, and add the head's
// attention probabilities to the row's mass (if asked). For a chunk of a split row
// (`partial`, decode_attention.cpp), each head's unnormalized output, max and sum instead:
// d + 2 floats a head, merged over the row's chunks by the caller.
template <typename T>
void finish_heads(const float* acc, const float* sc, const float* mx, const float* sum,
                  int64_t len, int64_t d, int64_t rep, T* out, float* mass, float* partial) {
  if (partial != nullptr) {
    for (int64_t h = 0; h < rep; ++h) {
      float* p = partial + h * (d + 2);
      std::memcpy(p, acc + h * d, d * sizeof(float));
      p[d] = mx[h];
      p[d + 1] = sum[h];
    }
    return;
  }
  for (int64_t h = 0; h < rep; ++h) {
    const float inv = 1.f / sum[h];
    T* o = out + h * d;
    for (int64_t i = 0; i < d; ++i) store(o + i, round_to(acc[h * d + i] * inv, o));
    if (mass != nullptr) {
      const float* s = sc + h * len;
      for (int64_t j = 0; j < len; ++j) mass[j] += s[j] * inv;
    }
  }
}

// Any head_dim and rep, plain C++.
template <typename T>
void attend_generic(const T* q, int64_t q_head_stride, const T* cache, const int64_t* slots,
                    int64_t len, int64_t kv_head, int64_t kv_heads, int64_t d, int64_t rep,
                    float scale, T* out, float* mass, const AttendScratch& ws) {
  const int64_t slot_size = 2 * kv_heads * d;
  float *qf = ws.qf, *sc = ws.sc, *acc = ws.acc, *mx = ws.stat, *sum = ws.stat + rep;
  for (int64_t i = 0; i < rep * d; ++i) acc[i] = 0.f;
  for (int64_t h = 0; h < rep; ++h) {
    for (int64_t i = 0; i < d; ++i) qf[h * d + i] = load(q + h * q_head_stride + i);
    mx[h] = -std::numeric_limits<float>::infinity();
    sum[h] = 0.f;
  }
  for (int64_t j = 0; j < len; ++j) {
    const T* k = cache + slots[j] * slot_size + kv_head * d;
    for (int64_t h = 0; h < rep; ++h) {
      float s = dot(qf + h * d, k, d) * scale;
      sc[h * len + j] = s;
      mx[h] = std::max(mx[h], s);
    }
  }
  for (int64_t h = 0; h < rep; ++h) {
    float* s = sc + h * len;
    for (int64_t j = 0; j < len; ++j) {
      s[j] = std::exp(s[j] - mx[h]);
      sum[h] += s[j];
    }
  }
  for (int64_t j = 0; j < len; ++j) {
    const T* v = cache + slots[j] * slot_size + (kv_heads + kv_head) * d;
    for (int64_t h = 0; h < rep; ++h) {
      const float p = sc[h * len + j];
      float* a = acc + h * d;
      for (int64_t i = 0; i < d; ++i) a[i] += p * load(v + i);
    }
  }
  finish_heads<T>(acc, sc, mx, sum, len, d, rep, out, mass, ws.partial);
}

constexpr int64_t kMaxVec = 16;  // head_dim up to 256 on the vector paths
constexpr int64_t kMaxRep = 16;  // query heads per KV head on the vector paths

#if defined(ENTROPIC_SIMD)

// One head's scores s[0, len) (stored to a multiple of 16) replaced in place by
// exp(s - max), the padding by zeros; returns their sum, the max in *mx.
inline float exp_scores(float* s, int64_t len, float* mx) {
  F16 m = f16_set(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < len; j += 16)
    m = select16(first16(len - j), max16(m, load16(s + j)), m);
  *mx = reduce_max16(m);
  const F16 mv = f16_set(*mx);
  F16 total = f16_zero();
  for (int64_t j = 0; j < len; j += 16) {
    const F16 e = maskz16(first16(len - j), exp16(sub(load16(s + j), mv)));
    store16(s + j, e);
    total = add(total, e);
  }
  return reduce_add16(total);
}

// The same computation in 16-lane vectors: head_dim a multiple of 16 (up to 256), rep <= 16.
template <typename T>
void attend_vec(const T* q, int64_t q_head_stride, const T* cache, const int64_t* slots,
                int64_t len, int64_t kv_head, int64_t kv_heads, int64_t d, int64_t rep,
                float scale, T* out, float* mass, const AttendScratch& ws) {
  const int64_t slot_size = 2 * kv_heads * d, nv = d / 16;
  float *qf = ws.qf, *sc = ws.sc, *acc = ws.acc;
  for (int64_t i = 0; i < rep * d; ++i) acc[i] = 0.f;
  for (int64_t h = 0; h < rep; ++h)
    for (int64_t i = 0; i < d; ++i) qf[h * d + i] = load(q + h * q_head_stride + i);
  float mx[kMaxRep], sum[kMaxRep];
  for (int64_t h = 0; h < rep; ++h) mx[h] = -std::numeric_limits<float>::infinity();
  F16 kv[kMaxVec];
  for (int64_t j = 0; j < len; ++j) {
    const T* k = cache + slots[j] * slot_size + kv_head * d;
    for (int64_t v = 0; v < nv; ++v) kv[v] = load16(k + 16 * v);
    for (int64_t h = 0; h < rep; ++h) {
      const float* qh = qf + h * d;
      F16 a = mul(load16(qh), kv[0]);
      for (int64_t v = 1; v < nv; ++v) a = fmadd(load16(qh + 16 * v), kv[v], a);
      const float s = reduce_add16(a) * scale;
      sc[h * len + j] = s;
      mx[h] = std::max(mx[h], s);
    }
  }
  for (int64_t h = 0; h < rep; ++h) {
    float* s = sc + h * len;
    const F16 m = f16_set(mx[h]);
    F16 total = f16_zero();
    for (int64_t j = 0; j < len; j += 16) {
      const M16 lanes = first16(len - j);
      const F16 e = exp16(sub(load16_masked(s + j, lanes), m));
      store16_masked(s + j, lanes, e);
      total = add(total, maskz16(lanes, e));
    }
    sum[h] = reduce_add16(total);
  }
  for (int64_t j = 0; j < len; ++j) {
    const T* v = cache + slots[j] * slot_size + (kv_heads + kv_head) * d;
    for (int64_t i = 0; i < nv; ++i) kv[i] = load16(v + 16 * i);
    for (int64_t h = 0; h < rep; ++h) {
      const F16 p = f16_set(sc[h * len + j]);
      float* a = acc + h * d;
      for (int64_t i = 0; i < nv; ++i) store16(a + 16 * i, fmadd(p, kv[i], load16(a + 16 * i)));
    }
  }
  finish_heads<T>(acc, sc, mx, sum, len, d, rep, out, mass, ws.partial);
}
#endif

#if defined(ENTROPIC_LEVEL_BF16)

// Asks for one whole slot (every KV head's K and V: `slot_size` elements of 2 bytes) in L2.
inline void prefetch_slot(const bf16_bits* slot, int64_t slot_size) {
  const char* p = reinterpret_cast<const char*>(slot);
  for (int64_t b = 0; b < slot_size * 2; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// Sums of 16 vectors: lane j of the result is the sum of the 16 lanes of v[j]. A transpose-
// and-add tree (45 shuffles and adds) instead of 16 horizontal reductions (~8 dependent ops
// each); the order of the additions is fixed.
inline __m512 sum16x16(__m512* v) {
  __m512 u[8], w[4], z[2];
  for (int i = 0; i < 8; ++i)  // lane L: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of its 4 floats
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // lane L: the sums of keys 4i .. 4i + 3 over lane L
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // lanes: keys 8i..+3 (L0+L1, L2+L3), keys 8i+4..+7 (same)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                       _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

// bf16 cache and queries, head_dim = 16 * NV (NV in 2, 4, 8, 16). Scores: each key against a
// query head is d / 32 AVX512-BF16 dot products (exact products, fp32 sums) and 16 keys'
// partial sums are reduced together; softmax in fp32; P.V in fp32 with the output of up to
// 16 / NV heads in registers. The same numbers for a row whatever the other rows are.
template <int NV>
void attend_bf16(const bf16_bits* q, int64_t q_head_stride, const bf16_bits* cache,
                 const int64_t* slots, int64_t len, int64_t kv_head, int64_t kv_heads,
                 int64_t rep, float scale, bf16_bits* out, float* mass, const AttendScratch& ws,
                 const Lookahead& ahead) {
  constexpr int64_t d = 16 * NV, nz = d / 32;  // nz: 32-wide bf16 vectors per head
  constexpr int64_t heads_per_group = NV >= 16 ? 1 : 16 / NV;
  const int64_t slot_size = 2 * kv_heads * d;
  const int64_t padded = (len + 15) / 16 * 16;
  float *sc = ws.sc, *acc = ws.acc;
  float mx[kMaxRep], sum[kMaxRep];
  for (int64_t h = 0; h < rep; ++h) {
    __m512bh qz[nz];
    for (int64_t z = 0; z < nz; ++z)
      qz[z] = (__m512bh)_mm512_loadu_si512(q + h * q_head_stride + 32 * z);
    float* s = sc + h * padded;
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      __m512 v[16];
      const int64_t n = std::min<int64_t>(16, len - j0);
      if (h == 0) {
        // A row's slots are scattered blocks, which the hardware prefetcher does not follow:
        // while a KV head's first scores are computed, fetch whole slots (every head's K and
        // V) 16 to 32 keys ahead, past those the lookahead already fetched; the passes after
        // it over this row then read from cache. The next row's share is spread over the
        // score passes of every query head, below.
        for (int64_t j = std::max(j0 + 16, ahead.covered); j < std::min(len, j0 + 32); ++j)
          prefetch_slot(cache + slots[j] * slot_size, slot_size);
      }
      {
        const int64_t chunks = rep * padded / 16, c = h * padded / 16 + j0 / 16;
        for (int64_t j = c * ahead.count / chunks; j < (c + 1) * ahead.count / chunks; ++j)
          prefetch_slot(cache + ahead.slots[j] * slot_size, slot_size);
      }
      for (int64_t j = 0; j < 16; ++j) {
        v[j] = _mm512_setzero_ps();
        if (j < n) {
          const bf16_bits* k = cache + slots[j0 + j] * slot_size + kv_head * d;
          for (int64_t z = 0; z < nz; ++z)
            v[j] = _mm512_dpbf16_ps(v[j], (__m512bh)_mm512_loadu_si512(k + 32 * z), qz[z]);
        }
      }
      _mm512_storeu_ps(s + j0, _mm512_mul_ps(sum16x16(v), _mm512_set1_ps(scale)));
    }
    sum[h] = exp_scores(s, len, mx + h);
  }
  for (int64_t h0 = 0; h0 < rep; h0 += heads_per_group) {
    const int64_t hn = std::min<int64_t>(heads_per_group, rep - h0);
    __m512 a[heads_per_group][NV];
    for (int64_t h = 0; h < heads_per_group; ++h)
      for (int c = 0; c < NV; ++c) a[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const bf16_bits* vr = cache + slots[j] * slot_size + (kv_heads + kv_head) * d;
      __m512 vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = vload(vr + 16 * c);
      for (int64_t h = 0; h < heads_per_group; ++h) {
        if (h >= hn) break;
        const __m512 p = _mm512_set1_ps(sc[(h0 + h) * padded + j]);
        for (int c = 0; c < NV; ++c) a[h][c] = _mm512_fmadd_ps(p, vv[c], a[h][c]);
      }
    }
    for (int64_t h = 0; h < hn; ++h)
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (h0 + h) * d + 16 * c, a[h][c]);
  }
  // finish_heads reads each head's probabilities at stride len
  if (mass != nullptr && padded != len)
    for (int64_t h = 1; h < rep; ++h)
      std::memmove(sc + h * len, sc + h * padded, len * sizeof(float));
  finish_heads<bf16_bits>(acc, sc, mx, sum, len, d, rep, out, mass, ws.partial);
}
#endif

#if defined(ENTROPIC_SIMD_AVX2)

// 16 stored elements as two fp32 vectors. float: elements 0..7 and 8..15. bf16: the even
// elements and the odd ones (a pair of bf16 in a 32-bit word: the even one is the word
// shifted left by 16, the odd one its high half), two instructions where a widening load
// and a shift per 8 elements would take four.
inline void load_pair(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}
inline void load_pair(const bf16_bits* p, __m256& a, __m256& b) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(int(0xFFFF0000u))));
}
// The element of a 16-element chunk in lane l of vector v (0 or 1) of load_pair.
template <typename T>
constexpr int pair_element(int v, int l) {
  return std::is_same_v<T, float> ? 8 * v + l : 2 * l + v;
}

// The rep query heads (head_dim d, a multiple of 16) in fp32, in load_pair's order.
template <typename T>
void queries_in_pair_order(const T* q, int64_t q_head_stride, int64_t rep, int64_t d,
                           float* qf) {
  for (int64_t h = 0; h < rep; ++h)
    for (int64_t c = 0; c < d; c += 16)
      for (int v = 0; v < 2; ++v)
        for (int l = 0; l < 8; ++l)
          qf[h * d + c + 8 * v + l] = load(q + h * q_head_stride + c + pair_element<T>(v, l));
}

// Lane j of the result: the sum of the 8 lanes of v[j] (a fixed tree of adds).
inline __m256 sum8x8(const __m256* v) {
  // [v0 v1 v2 v3 | v0 v1 v2 v3]: the sums of lanes 0..3, then of lanes 4..7
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// P.V of heads h0 .. h0 + HN - 1 over S 16-element slices of head_dim from slice c0: 2 * S
// accumulators a head in registers, one pass over the row's values, which are fetched 16
// keys ahead (a row's keys are slot_size apart, a stride the hardware follows poorly).
template <typename T, int HN, int S>
void attend_avx2_pv(const T* cache, const int64_t* slots, int64_t len, int64_t v_offset,
                    int64_t slot_size, int64_t d, int64_t c0, int64_t h0, const float* sc,
                    int64_t padded, float* acc) {
  __m256 a[HN][2 * S];
  for (int h = 0; h < HN; ++h)
    for (int i = 0; i < 2 * S; ++i) a[h][i] = _mm256_setzero_ps();
  const T* base = cache + v_offset + 16 * c0;
  for (int64_t j = 0; j < len; ++j) {
    if (j + 16 < len) {
      const char* ahead = reinterpret_cast<const char*>(base + slots[j + 16] * slot_size);
      for (int64_t b = 0; b < int64_t(S * 16 * sizeof(T)); b += 64)
        _mm_prefetch(ahead + b, _MM_HINT_T0);
    }
    const T* v = base + slots[j] * slot_size;
    for (int i = 0; i < S; ++i) {
      __m256 v0, v1;
      load_pair(v + 16 * i, v0, v1);
      for (int h = 0; h < HN; ++h) {
        const __m256 p = _mm256_broadcast_ss(sc + (h0 + h) * padded + j);
        a[h][2 * i] = _mm256_fmadd_ps(p, v0, a[h][2 * i]);
        a[h][2 * i + 1] = _mm256_fmadd_ps(p, v1, a[h][2 * i + 1]);
      }
    }
  }
  // (constant indices only: an accumulator indexed at run time would live in memory, and
  // GCC would store it at every key)
  alignas(32) float lanes[HN][2 * S][8];
#pragma GCC unroll 4
  for (int h = 0; h < HN; ++h)
#pragma GCC unroll 4
    for (int i = 0; i < 2 * S; ++i) _mm256_store_ps(lanes[h][i], a[h][i]);
  for (int h = 0; h < HN; ++h)
    for (int i = 0; i < 2 * S; ++i) {
      float* o = acc + (h0 + h) * d + 16 * (c0 + i / 2);
      for (int l = 0; l < 8; ++l) o[pair_element<T>(i % 2, l)] = lanes[h][i][l];
    }
}

// All heads' P.V: per group of up to 4 heads, S slices a pass (2 while the accumulators fit
// 8 registers, else 1: at 12 GCC spilled them at every key).
template <typename T, int HN>
void attend_avx2_pv_heads(const T* cache, const int64_t* slots, int64_t len, int64_t v_offset,
                          int64_t slot_size, int64_t d, int64_t h0, const float* sc,
                          int64_t padded, float* acc) {
  const int64_t nc = d / 16;
  int64_t c = 0;
  if constexpr (HN <= 2)
    for (; c + 2 <= nc; c += 2)
      attend_avx2_pv<T, HN, 2>(cache, slots, len, v_offset, slot_size, d, c, h0, sc, padded, acc);
  for (; c < nc; ++c)
    attend_avx2_pv<T, HN, 1>(cache, slots, len, v_offset, slot_size, d, c, h0, sc, padded, acc);
}

// AVX2 (8 lanes), bf16 or float cache, head_dim = 16 * NC. Scores: a key is loaded (and
// widened) once for the `rep` query heads that share it, each head's 8-lane partial sums
// of 8 keys reduced together (sum8x8); softmax in fp32; P.V a 16-element slice of head_dim
// at a time with up to 4 heads' accumulators in registers. A row's numbers do not depend
// on the other rows. (The 16-lane code, attend_vec, reduced every score on its own and
// kept P.V's accumulators in memory: on an AVX2 CPU it ran at 4-7 GB/s of cache.)
template <typename T, int NC>
void attend_avx2(const T* q, int64_t q_head_stride, const T* cache, const int64_t* slots,
                 int64_t len, int64_t kv_head, int64_t kv_heads, int64_t rep, float scale,
                 T* out, float* mass, const AttendScratch& ws) {
  constexpr int64_t d = 16 * NC;
  constexpr bool kKeepKey = NC <= 4;  // a key in registers: 2 * NC of the 16
  const int64_t slot_size = 2 * kv_heads * d, padded = (len + 15) / 16 * 16;
  float *qf = ws.qf, *sc = ws.sc, *acc = ws.acc;
  queries_in_pair_order(q, q_head_stride, rep, d, qf);
  alignas(32) float part[kMaxRep][8][8];
  for (int64_t j0 = 0; j0 < len; j0 += 8) {
    const int64_t n = std::min<int64_t>(8, len - j0);
    for (int64_t j = 0; j < 8; ++j) {
      if (j >= n) {
        for (int64_t h = 0; h < rep; ++h) _mm256_store_ps(part[h][j], _mm256_setzero_ps());
        continue;
      }
      if (j0 + j + 16 < len) {  // the key 16 ahead (a stride the hardware follows poorly)
        const char* ahead =
            reinterpret_cast<const char*>(cache + slots[j0 + j + 16] * slot_size + kv_head * d);
        for (int64_t b = 0; b < int64_t(d * sizeof(T)); b += 64)
          _mm_prefetch(ahead + b, _MM_HINT_T0);
      }
      const T* k = cache + slots[j0 + j] * slot_size + kv_head * d;
      __m256 kv[kKeepKey ? 2 * NC : 2];
      if constexpr (kKeepKey)
        for (int c = 0; c < NC; ++c) load_pair(k + 16 * c, kv[2 * c], kv[2 * c + 1]);
      // up to 3 heads at once, 2 accumulators each: 6 independent chains of NC fmas
      const auto heads = [&](int64_t h0, auto hn_tag) {
        constexpr int HN = decltype(hn_tag)::value;
        __m256 a[HN][2];
        for (int h = 0; h < HN; ++h) a[h][0] = a[h][1] = _mm256_setzero_ps();
        for (int c = 0; c < NC; ++c) {
          __m256 k0, k1;
          if constexpr (kKeepKey) {
            k0 = kv[2 * c];
            k1 = kv[2 * c + 1];
          } else {
            load_pair(k + 16 * c, k0, k1);
          }
          for (int h = 0; h < HN; ++h) {
            const float* qh = qf + (h0 + h) * d + 16 * c;
            a[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(qh), k0, a[h][0]);
            a[h][1] = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8), k1, a[h][1]);
          }
        }
        for (int h = 0; h < HN; ++h)
          _mm256_store_ps(part[h0 + h][j], _mm256_add_ps(a[h][0], a[h][1]));
      };
      for (int64_t h0 = 0; h0 < rep; h0 += 3) {
        switch (std::min<int64_t>(3, rep - h0)) {
          case 3: heads(h0, std::integral_constant<int, 3>{}); break;
          case 2: heads(h0, std::integral_constant<int, 2>{}); break;
          default: heads(h0, std::integral_constant<int, 1>{}); break;
        }
      }
    }
    for (int64_t h = 0; h < rep; ++h) {
      __m256 v[8];
      for (int j = 0; j < 8; ++j) v[j] = _mm256_load_ps(part[h][j]);
      _mm256_storeu_ps(sc + h * padded + j0, _mm256_mul_ps(sum8x8(v), _mm256_set1_ps(scale)));
    }
  }
  float mx[kMaxRep], sum[kMaxRep];
  for (int64_t h = 0; h < rep; ++h) {
    float* s = sc + h * padded;
    sum[h] = exp_scores(s, len, mx + h);
  }
  const int64_t v_offset = (kv_heads + kv_head) * d;
  const auto pv = [&](int64_t h0, auto hn_tag) {
    attend_avx2_pv_heads<T, decltype(hn_tag)::value>(cache, slots, len, v_offset, slot_size, d,
                                                     h0, sc, padded, acc);
  };
  for (int64_t h0 = 0; h0 < rep; h0 += 4) {
    switch (std::min<int64_t>(4, rep - h0)) {
      case 4: pv(h0, std::integral_constant<int, 4>{}); break;
      case 3: pv(h0, std::integral_constant<int, 3>{}); break;
      case 2: pv(h0, std::integral_constant<int, 2>{}); break;
      default: pv(h0, std::integral_constant<int, 1>{}); break;
    }
  }
  // finish_heads reads each head's probabilities at stride len
  if (mass != nullptr && padded != len)
    for (int64_t h = 1; h < rep; ++h)
      std::memmove(sc + h * len, sc + h * padded, len * sizeof(float));
  finish_heads<T>(acc, sc, mx, sum, len, d, rep, out, mass, ws.partial);
}
#endif

// Query-aware block selection (docs/pruning.md): an upper bound on q.k over the keys of a
// block, from the elementwise minimum and maximum of those keys (kept after the cache's
// slots, one bound row per block: the minima where a slot has K, the maxima where it has V):
//   bound = sum_i max(q_i * min_i, q_i * max_i) >= q.k for every key k of the block.
// out[h * n + j]: the bound of block j for query head h of the `rep` that share the KV head.
// `rows`: the cache row of each block's bound; qf: rep * d floats of scratch.
template <typename T>
void key_bounds(const T* q, int64_t q_head_stride, const T* cache, const int64_t* rows,
                int64_t n, int64_t kv_head, int64_t kv_heads, int64_t d, int64_t rep,
                float* qf, float* out) {
  const int64_t slot_size = 2 * kv_heads * d;
#if defined(ENTROPIC_SIMD_AVX2)
  if (d % 16 == 0) {
    // 8 blocks' bounds reduced together (sum8x8)
    queries_in_pair_order(q, q_head_stride, rep, d, qf);
    const int64_t bytes = d * int64_t(sizeof(T));
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
      const int64_t m = std::min<int64_t>(8, n - j0);
      // the next 8 blocks' bound rows (scattered, one per block) while these are computed
      for (int64_t j = j0 + 8; j < std::min(n, j0 + 16); ++j) {
        const char* mn = reinterpret_cast<const char*>(cache + rows[j] * slot_size + kv_head * d);
        for (int64_t b = 0; b < bytes; b += 64) {
          _mm_prefetch(mn + b, _MM_HINT_T0);
          _mm_prefetch(mn + kv_heads * bytes + b, _MM_HINT_T0);
        }
      }
      for (int64_t h = 0; h < rep; ++h) {
        const float* qh = qf + h * d;
        __m256 part[8];
        for (int64_t j = 0; j < 8; ++j) {
          part[j] = _mm256_setzero_ps();
          if (j >= m) continue;
          const T* mn = cache + rows[j0 + j] * slot_size + kv_head * d;
          const T* mx = mn + kv_heads * d;
          __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
          for (int64_t c = 0; c < d; c += 16) {
            __m256 n0, n1, x0, x1;
            load_pair(mn + c, n0, n1);
            load_pair(mx + c, x0, x1);
            const __m256 q0 = _mm256_loadu_ps(qh + c), q1 = _mm256_loadu_ps(qh + c + 8);
            a0 = _mm256_add_ps(a0, _mm256_max_ps(_mm256_mul_ps(q0, n0), _mm256_mul_ps(q0, x0)));
            a1 = _mm256_add_ps(a1, _mm256_max_ps(_mm256_mul_ps(q1, n1), _mm256_mul_ps(q1, x1)));
          }
          part[j] = _mm256_add_ps(a0, a1);
        }
        alignas(32) float b[8];
        _mm256_store_ps(b, sum8x8(part));
        for (int64_t j = 0; j < m; ++j) out[h * n + j0 + j] = b[j];
      }
    }
    return;
  }
#endif
  for (int64_t h = 0; h < rep; ++h)
    for (int64_t i = 0; i < d; ++i) qf[h * d + i] = load(q + h * q_head_stride + i);
#if defined(ENTROPIC_SIMD)
  if (d % 16 == 0) {
    for (int64_t j = 0; j < n; ++j) {
      const T* mn = cache + rows[j] * slot_size + kv_head * d;
      const T* mx = mn + kv_heads * d;
      for (int64_t h = 0; h < rep; ++h) {
        const float* qh = qf + h * d;
        F16 a = f16_zero();
        for (int64_t i = 0; i < d; i += 16) {
          const F16 qv = load16(qh + i);
          a = add(a, max16(mul(qv, load16(mn + i)), mul(qv, load16(mx + i))));
        }
        out[h * n + j] = reduce_add16(a);
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) {
    const T* mn = cache + rows[j] * slot_size + kv_head * d;
    const T* mx = mn + kv_heads * d;
    for (int64_t h = 0; h < rep; ++h) {
      float s = 0.f;
      for (int64_t i = 0; i < d; ++i) {
        const float a = qf[h * d + i];
        s += std::max(a * load(mn + i), a * load(mx + i));
      }
      out[h * n + j] = s;
    }
  }
}

template <typename T>
void attend(const T* q, int64_t q_head_stride, const T* cache, const int64_t* slots, int64_t len,
            int64_t kv_head, int64_t kv_heads, int64_t d, int64_t rep, float scale, T* out,
            float* mass, const AttendScratch& ws, const Lookahead& ahead) {
#if defined(ENTROPIC_LEVEL_BF16)
  if constexpr (std::is_same_v<T, bf16_bits>) {
    if (rep <= kMaxRep && (d == 32 || d == 64 || d == 128 || d == 256)) {
      switch (d) {
        case 32: attend_bf16<2>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                scale, out, mass, ws, ahead); return;
        case 64: attend_bf16<4>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                scale, out, mass, ws, ahead); return;
        case 128: attend_bf16<8>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                 scale, out, mass, ws, ahead); return;
        default: attend_bf16<16>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                 scale, out, mass, ws, ahead); return;
      }
    }
  }
#endif
#if defined(ENTROPIC_SIMD_AVX2)
  if (rep <= kMaxRep && (d == 32 || d == 64 || d == 128 || d == 256)) {
    switch (d) {
      case 32: attend_avx2<T, 2>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                 scale, out, mass, ws); return;
      case 64: attend_avx2<T, 4>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                 scale, out, mass, ws); return;
      case 128: attend_avx2<T, 8>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                  scale, out, mass, ws); return;
      default: attend_avx2<T, 16>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                  scale, out, mass, ws); return;
    }
  }
#endif
#if defined(ENTROPIC_SIMD)
  if (d % 16 == 0 && d / 16 <= kMaxVec && rep <= kMaxRep) {
    attend_vec<T>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, d, rep, scale, out,
                  mass, ws);
    return;
  }
#endif
  (void)ahead;
  attend_generic<T>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, d, rep, scale, out,
                    mass, ws);
}
