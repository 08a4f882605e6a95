// Per-row statistics of a step's logits for the sampler, in two passes over each row.
//   logit_stats(logits) -> (max, logsumexp, entropy, argmax)
// and the entropy of chosen rows at their own temperatures (the thermostat's H^T), in one
// pass over each given the row max (logit_stats_math.h says how):
//   tempered_entropy(logits, rows, row_max, temps) -> entropy
#include <torch/library.h>

#include <limits>
#include <tuple>

#include "common.h"

namespace {

using namespace entropic_kernels;

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
  const auto row = active().logit_stats_row;
  at::parallel_for(0, rows, n >= 4096 ? 1 : 64, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r)
      row(x + r * stride, n, pm + r, pl + r, pe + r, pa + r);
  });
  return {mx, lse, ent, arg};
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
  const auto row = active().tempered_entropy_row;
  at::parallel_for(0, k, n >= 4096 ? 1 : 64, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j)
      po[j] = row(x + pr[j] * stride, n, pm[pr[j]], pt[j]);
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
