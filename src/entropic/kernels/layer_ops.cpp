// The small per-layer ops of a decoder layer, one pass each: RMSNorm, RoPE with the KV cache
// write, SiLU(gate) * up. Eager PyTorch spends a few microseconds of dispatch on every op
// whatever its size; at batch 1 a decoder layer is ~50 such ops (RMSNorm alone is ~10), which
// costs as much as its weights' memory traffic. These round exactly where the PyTorch formulas
// they replace round (bf16 results of fp32 arithmetic), at every ISA level (layer_ops_math.h).
//   rms_norm(x, weight, eps) -> y                 y = weight * bf16(x * rsqrt(mean(x^2) + eps))
//   rope_kv_(qkv, cos, sin_signed, kv_cache, slot_mapping, num_heads, num_kv_heads)
//       rotates q and k in place in the fused qkv rows and writes k, v into their cache slots
//   silu_mul(gate_up) -> y                        y = silu(gate) * up, gate_up = [gate | up]
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "common.h"
#include "ops.h"

namespace entropic_ops {

using namespace entropic_kernels;

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, n] with unit stride");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [n] tensor of x's dtype");
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto& k = active().typed<T>();
    const T *xp = ptr<T>(x), *wp = ptr<T>(weight);
    T* yp = ptr<T>(y);
    const int64_t n = x.size(1), stride = x.stride(0);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      k.rms_norm(xp, wp, yp, begin, end, n, stride, float(eps));
    });
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// RoPE on q and k (in place, HF rotate-half layout) and the KV cache write

void rope_kv_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
              at::Tensor kv_cache, const at::Tensor& slot_mapping, int64_t num_heads,
              int64_t num_kv_heads) {
  check_cpu_float(qkv, "qkv");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_kv_: qkv must be [tokens, width]");
  const int64_t t = qkv.size(0);
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous() && kv_cache.size(1) == 2 &&
                  kv_cache.size(2) == num_kv_heads && kv_cache.scalar_type() == qkv.scalar_type(),
              "rope_kv_: kv_cache must be a contiguous [slots, 2, kv_heads, head_dim] tensor of "
              "qkv's dtype");
  const int64_t d = kv_cache.size(3);
  TORCH_CHECK(d % 2 == 0, "rope_kv_: head_dim must be even");
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d,
              "rope_kv_: qkv width ", qkv.size(1), " != (heads + 2 * kv_heads) * head_dim");
  for (const at::Tensor* tab : {&cos, &sin_signed}) {
    TORCH_CHECK(tab->is_contiguous() && tab->numel() == t * d &&
                    tab->scalar_type() == qkv.scalar_type(),
                "rope_kv_: cos and sin must be contiguous [tokens, head_dim] of qkv's dtype");
  }
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == t,
              "rope_kv_: slot_mapping must be a contiguous int64 [tokens] tensor");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(0);
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < num_slots, "rope_kv_: slot ", slots[i],
                " out of range [0, ", num_slots, ")");
  }
  dispatch(qkv, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto& k = active().typed<T>();
    T *q = ptr<T>(qkv), *cache = ptr<T>(kv_cache);
    const T *c = ptr<T>(cos), *sn = ptr<T>(sin_signed);
    const int64_t stride = qkv.stride(0);
    at::parallel_for(0, t, 8, [&](int64_t begin, int64_t end) {
      std::vector<float> tmp(d);
      k.rope_kv(q, c, sn, cache, slots, begin, end, stride, num_heads, num_kv_heads, d,
                tmp.data());
    });
  });
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: silu(gate) * up

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [rows, 2 * n] with unit stride");
  const int64_t n = gate_up.size(1) / 2;
  auto y = at::empty({gate_up.size(0), n}, gate_up.options());
  dispatch(gate_up, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto& k = active().typed<T>();
    const T* gu = ptr<T>(gate_up);
    T* yp = ptr<T>(y);
    const int64_t stride = gate_up.stride(0);
    at::parallel_for(0, gate_up.size(0), 8, [&](int64_t begin, int64_t end) {
      k.silu_mul(gu, yp, begin, end, n, stride);
    });
  });
  return y;
}

}  // namespace entropic_ops

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin_signed, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("rms_norm", &entropic_ops::rms_norm);
  m.impl("rope_kv_", &entropic_ops::rope_kv_);
  m.impl("silu_mul", &entropic_ops::silu_mul);
}
