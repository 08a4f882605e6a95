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
// attention probabilities to the row's mass (if asked).
template <typename T>
void finish_heads(const float* acc, const float* sc, const float* sum, int64_t len, int64_t d,
                  int64_t rep, T* out, float* mass) {
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
  finish_heads<T>(acc, sc, sum, len, d, rep, out, mass);
}

constexpr int64_t kMaxVec = 16;  // head_dim up to 256 on the vector paths
constexpr int64_t kMaxRep = 16;  // query heads per KV head on the vector paths

#if defined(ENTROPIC_SIMD)

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
  finish_heads<T>(acc, sc, sum, len, d, rep, out, mass);
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
    F16 m = f16_set(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < len; j += 16)
      m = select16(first16(len - j), max16(m, load16(s + j)), m);
    mx[h] = reduce_max16(m);
    const F16 mv = f16_set(mx[h]);
    F16 total = f16_zero();
    for (int64_t j = 0; j < len; j += 16) {
      const F16 e = maskz16(first16(len - j), exp16(sub(load16(s + j), mv)));
      store16(s + j, e);
      total = add(total, e);
    }
    sum[h] = reduce_add16(total);
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
  finish_heads<bf16_bits>(acc, sc, sum, len, d, rep, out, mass);
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
