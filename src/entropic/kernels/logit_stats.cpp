// Per-row statistics of a step's logits for the sampler, in two passes over each row.
//   logit_stats(logits) -> (max, logsumexp, entropy, argmax)
// and the entropy of chosen rows at their own temperatures (the thermostat's H^T), in one
// pass over each given the row max:
//   tempered_entropy(logits, rows, row_max, temps) -> entropy
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "common.h"

namespace {

using namespace entropic_kernels;

// ---------------------------------------------------------------------------------------------
// Per-row statistics of fp32 logits in two passes over each row: the max and its first index
// (torch.argmax's choice among ties), then Z = sum exp(x - max) and the exact entropy of
// softmax(x), H = log Z - sum exp(x - max) (x - max) / Z (a -inf logit adds nothing). A row
// with a NaN gets a NaN max (and the other results are then meaningless): callers check the
// max before trusting the rest.

void logit_stats_row(const float* x, int64_t n, float* mx, float* lse, float* ent, int64_t* arg) {
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_i = 0;
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 bv = _mm512_set1_ps(best);
  __m512i bi = _mm512_setzero_si512();
  __m512i idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __mmask16 any_nan = 0;
  for (; i + 16 <= n && n < (int64_t(1) << 31); i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    any_nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, bv, _CMP_GT_OQ);  // strict: first index wins
    bv = _mm512_mask_mov_ps(bv, gt, v);
    bi = _mm512_mask_mov_epi32(bi, gt, idx);
    idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
  }
  nan = any_nan != 0;
  alignas(64) float lv[16];
  alignas(64) int32_t li[16];
  _mm512_store_ps(lv, bv);
  _mm512_store_si512(li, bi);
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
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(best);
  __m512 zv = _mm512_setzero_ps(), zxv = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 d = _mm512_sub_ps(_mm512_loadu_ps(x + i), m);
    const __mmask16 live = _mm512_cmp_ps_mask(d, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(d));
    zv = _mm512_add_ps(zv, e);
    zxv = _mm512_add_ps(zxv, _mm512_maskz_mul_ps(live, e, d));
  }
  z = _mm512_reduce_add_ps(zv);
  zx = _mm512_reduce_add_ps(zxv);
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> logit_stats(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "logit_stats: logits must be a float32 [rows, vocab] CPU tensor with unit stride "
              "and vocab > 0");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto opts = logits.options();
  auto mx = at::empty({rows}, opts), lse = at::empty({rows}, opts), ent = at::empty({rows}, opts);
  auto arg = at::empty({rows}, opts.dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  float *pm = mx.data_ptr<float>(), *pl = lse.data_ptr<float>(), *pe = ent.data_ptr<float>();
  int64_t* pa = arg.data_ptr<int64_t>();
  // a thread per row when there are several; a long single row stays on one thread (its two
  // passes take ~20 us for 49k logits)
  at::parallel_for(0, rows, n >= 4096 ? 1 : 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      logit_stats_row(x + r * stride, n, pm + r, pl + r, pe + r, pa + r);
  });
  return {mx, lse, ent, arg};
}

// ---------------------------------------------------------------------------------------------
// Entropy of softmax(x / T) in one pass, given m = max(x) (finite): with d = (x - m) / T,
// Z = sum exp(d) and H = log Z - sum exp(d) d / Z. The max of x / T is m / T for T > 0, so
// d <= 0 and exp never overflows; a -inf logit adds nothing.

float tempered_entropy_row(const float* x, int64_t n, float m, float t) {
  const float inv = 1.f / t;
  float z = 0.f, zd = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m), iv = _mm512_set1_ps(inv);
  __m512 zv = _mm512_setzero_ps(), zdv = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 d = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv), iv);
    const __mmask16 live = _mm512_cmp_ps_mask(d, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, exp16(d));
    zv = _mm512_add_ps(zv, e);
    zdv = _mm512_add_ps(zdv, _mm512_maskz_mul_ps(live, e, d));
  }
  z = _mm512_reduce_add_ps(zv);
  zd = _mm512_reduce_add_ps(zdv);
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

at::Tensor tempered_entropy(const at::Tensor& logits, const at::Tensor& rows,
                            const at::Tensor& row_max, const at::Tensor& temps) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                  logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "tempered_entropy: logits must be a float32 [rows, vocab] CPU tensor with unit "
              "stride and vocab > 0");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 &&
                  row_max.scalar_type() == at::kFloat && row_max.dim() == 1 &&
                  row_max.size(0) == logits.size(0) && temps.scalar_type() == at::kFloat &&
                  temps.dim() == 1 && temps.size(0) == rows.size(0),
              "tempered_entropy: rows (long [k]), row_max (float [rows of logits]) and temps "
              "(float [k]) do not match the logits");
  const int64_t k = rows.size(0), n = logits.size(1), total = logits.size(0);
  auto r = rows.contiguous(), mx = row_max.contiguous(), t = temps.contiguous();
  const int64_t* pr = r.data_ptr<int64_t>();
  const float *pm = mx.data_ptr<float>(), *pt = t.data_ptr<float>();
  for (int64_t j = 0; j < k; ++j) {
    TORCH_CHECK(0 <= pr[j] && pr[j] < total, "tempered_entropy: row ", pr[j], " out of range");
    TORCH_CHECK(pt[j] > 0.f && std::isfinite(pt[j]) && std::isfinite(pm[pr[j]]),
                "tempered_entropy: temperatures must be finite and > 0 and row maxima finite");
  }
  auto out = at::empty({k}, logits.options());
  const float* x = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  float* po = out.data_ptr<float>();
  at::parallel_for(0, k, n >= 4096 ? 1 : 64, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j)
      po[j] = tempered_entropy_row(x + pr[j] * stride, n, pm[pr[j]], pt[j]);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("logit_stats(Tensor logits) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("tempered_entropy(Tensor logits, Tensor rows, Tensor row_max, Tensor temps) -> Tensor");
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("logit_stats", &logit_stats);
  m.impl("tempered_entropy", &tempered_entropy);
}
