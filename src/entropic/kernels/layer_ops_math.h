// The math of layer_ops.cpp (RMSNorm, RoPE with the KV write, SiLU * up) for rows
// [begin, end); included by level.h inside a level's namespace. Results round exactly where
// the PyTorch formulas round, the same at every level.

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t begin, int64_t end, int64_t n,
                   int64_t x_stride, float eps) {
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * x_stride;
    T* yr = y + r * n;
    float lanes[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      for (int l = 0; l < 16; ++l) {
        float v = load(xr + i + l);
        lanes[l] += v * v;
      }
    }
    float ss = 0.f;
    for (int l = 0; l < 16; ++l) ss += lanes[l];
    for (; i < n; ++i) {
      float v = load(xr + i);
      ss += v * v;
    }
    const float inv = 1.f / std::sqrt(ss / float(n) + eps);
    int64_t j = 0;
#if defined(ENTROPIC_SIMD)
    const F16 vinv = f16_set(inv);
    for (; j + 16 <= n; j += 16) {
      const F16 normed = round16(mul(load16(xr + j), vinv), yr);
      store16(yr + j, round16(mul(load16(w + j), normed), yr));
    }
#endif
    for (; j < n; ++j) {
      float normed = round_to(load(xr + j) * inv, yr);
      store(yr + j, round_to(load(w + j) * normed, yr));
    }
  }
}

// x * cos + roll(x, d/2) * sin_signed, each product rounded, then the sum rounded: the same
// roundings as the torch formula (RotaryEmbedding.apply_). Then the rotated k and v are
// copied into the token's cache slot ([2, kv_heads, d], as they sit in qkv).
template <typename T>
void rope_kv_rows(T* qkv, const T* cos, const T* sin, T* cache, const int64_t* slots,
                  int64_t begin, int64_t end, int64_t row_stride, int64_t heads,
                  int64_t kv_heads, int64_t d, float* tmp) {
  const int64_t half = d / 2;
  for (int64_t t = begin; t < end; ++t) {
    T* row = qkv + t * row_stride;
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      T* x = row + h * d;
#if defined(ENTROPIC_SIMD)
      if (d % 32 == 0 && d <= 256) {  // half a head is whole vectors: roll = swap them
        F16 xv[16];
        const int64_t nv = d / 16;
        for (int64_t v = 0; v < nv; ++v) xv[v] = load16(x + 16 * v);
        for (int64_t v = 0; v < nv; ++v) {
          const F16 a = round16(mul(xv[v], load16(c + 16 * v)), x);
          const F16 b = round16(mul(xv[(v + nv / 2) % nv], load16(s + 16 * v)), x);
          store16(x + 16 * v, round16(add(a, b), x));
        }
        continue;
      }
#endif
      for (int64_t i = 0; i < d; ++i) tmp[i] = load(x + i);
      for (int64_t i = 0; i < d; ++i) {
        float a = round_to(tmp[i] * load(c + i), x);
        float b = round_to(tmp[(i + half) % d] * load(s + i), x);
        store(x + i, round_to(a + b, x));
      }
    }
    std::memcpy(cache + slots[t] * 2 * kv_heads * d, row + heads * d,
                sizeof(T) * 2 * kv_heads * d);
  }
}

template <typename T>
void silu_mul_rows(const T* gu, T* y, int64_t begin, int64_t end, int64_t n, int64_t stride) {
  for (int64_t r = begin; r < end; ++r) {
    const T* g = gu + r * stride;
    const T* u = g + n;
    T* yr = y + r * n;
    int64_t i = 0;
#if defined(ENTROPIC_SIMD)
    for (; i + 16 <= n; i += 16) {
      const F16 x = load16(g + i);
      const F16 act = round16(div(x, add(f16_set(1.f), exp16(sub(f16_zero(), x)))), yr);
      store16(yr + i, round16(mul(act, load16(u + i)), yr));
    }
#endif
    for (; i < n; ++i) {
      float x = load(g + i);
      float act = round_to(x / (1.f + std::exp(-x)), yr);
      store(yr + i, round_to(act * load(u + i), yr));
    }
  }
}
