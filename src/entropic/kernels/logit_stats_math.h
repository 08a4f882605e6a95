// The math of logit_stats.cpp, one row at a time; included by level.h inside a level's
// namespace.
//
// logit_stats_row: two passes over fp32 logits: the max and its first index (torch.argmax's
// choice among ties), then Z = sum exp(x - max) and the exact entropy of softmax(x),
// H = log Z - sum exp(x - max) (x - max) / Z (a -inf logit adds nothing). A row with a NaN
// gets a NaN max (and the other results are then meaningless): callers check the max.

void logit_stats_row(const float* x, int64_t n, float* mx, float* lse, float* ent,
                     int64_t* arg) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = 0;
  bool nan = false;
  int64_t i = 0;
#if defined(ENTROPIC_SIMD)
  F16 bv = f16_set(best);
  I16 bi = i16_set(0), idx = i16_iota();
  M16 any_nan = unord16(bv, bv);
  for (; i + 16 <= n && n < (int64_t(1) << 31); i += 16) {
    const F16 v = load16(x + i);
    any_nan = or16(any_nan, unord16(v, v));
    const M16 gt = gt16(v, bv);  // strict: the first index wins
    bv = select16(gt, v, bv);
    bi = i16_select(gt, idx, bi);
    idx = i16_add(idx, 16);
  }
  nan = any16(any_nan);
  alignas(64) float lv[16];
  alignas(64) int32_t li[16];
  store16(lv, bv);
  i16_store(li, bi);
  for (int l = 0; l < 16; ++l) {
    if (lv[l] > best || (lv[l] == best && li[l] < best_i && lv[l] > -INFINITY)) {
      best = lv[l];
      best_i = li[l];
    }
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(x[i])) nan = true;
    if (x[i] > best) {
      best = x[i];
      best_i = i;
    }
  }
  *arg = best_i;
  if (nan || !std::isfinite(best)) {  // the caller takes another path for such rows
    *mx = nan ? std::numeric_limits<float>::quiet_NaN() : best;
    *lse = *ent = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  *mx = best;
  float z = 0.f, zx = 0.f;
  i = 0;
#if defined(ENTROPIC_SIMD)
  const F16 m = f16_set(best), minus_inf = f16_set(-INFINITY);
  F16 zv = f16_zero(), zxv = f16_zero();
  for (; i + 16 <= n; i += 16) {
    const F16 d = sub(load16(x + i), m);
    const M16 live = neq16(d, minus_inf);
    const F16 e = maskz16(live, exp16(d));
    zv = add(zv, e);
    zxv = add(zxv, maskz16(live, mul(e, d)));
  }
  z = reduce_add16(zv);
  zx = reduce_add16(zxv);
#else
  // 16 partial sums, as the vector levels (one running sum over a 49k vocabulary loses
  // ~5e-6 of the total)
  float zl[16] = {0}, zxl[16] = {0};
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) {
      const float d = x[i + l] - best;
      if (d == -INFINITY) continue;
      const float e = std::exp(d);
      zl[l] += e;
      zxl[l] += e * d;
    }
  }
  for (int l = 0; l < 16; ++l) {
    z += zl[l];
    zx += zxl[l];
  }
#endif
  for (; i < n; ++i) {
    const float d = x[i] - best;
    if (d == -INFINITY) continue;
    const float e = std::exp(d);
    z += e;
    zx += e * d;
  }
  *lse = best + std::log(z);
  *ent = std::log(z) - zx / z;
}

// Entropy of softmax(x / T) in one pass, given m = max(x) (finite): with d = (x - m) / T,
// Z = sum exp(d) and H = log Z - sum exp(d) d / Z. The max of x / T is m / T for T > 0, so
// d <= 0 and exp never overflows; a -inf logit adds nothing.
float tempered_entropy_row(const float* x, int64_t n, float m, float t) {
  const float inv = 1.f / t;
  float z = 0.f, zd = 0.f;
  int64_t i = 0;
#if defined(ENTROPIC_SIMD)
  const F16 mv = f16_set(m), iv = f16_set(inv), minus_inf = f16_set(-INFINITY);
  F16 zv = f16_zero(), zdv = f16_zero();
  for (; i + 16 <= n; i += 16) {
    const F16 d = mul(sub(load16(x + i), mv), iv);
    const M16 live = neq16(d, minus_inf);
    const F16 e = maskz16(live, exp16(d));
    zv = add(zv, e);
    zdv = add(zdv, maskz16(live, mul(e, d)));
  }
  z = reduce_add16(zv);
  zd = reduce_add16(zdv);
#else
  float zl[16] = {0}, zdl[16] = {0};
  for (; i + 16 <= n; i += 16) {
    for (int l = 0; l < 16; ++l) {
      const float d = (x[i + l] - m) * inv;
      if (d == -INFINITY) continue;
      const float e = std::exp(d);
      zl[l] += e;
      zdl[l] += e * d;
    }
  }
  for (int l = 0; l < 16; ++l) {
    z += zl[l];
    zd += zdl[l];
  }
#endif
  for (; i < n; ++i) {
    const float d = (x[i] - m) * inv;
    if (d == -INFINITY) continue;
    const float e = std::exp(d);
    z += e;
    zd += e * d;
  }
  return std::log(z) - zd / z;
}
