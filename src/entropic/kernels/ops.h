// entropic's ops as C++ functions, for ops that call other ops without going through the
// dispatcher (decode_stack.cpp). Each is defined in the file named beside it, where its
// contract is documented.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace entropic_ops {

// layer_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void rope_kv_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
              at::Tensor kv_cache, const at::Tensor& slot_mapping, int64_t num_heads,
              int64_t num_kv_heads);
at::Tensor silu_mul(const at::Tensor& gate_up);

// quant_linear.cpp
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& offset128);

// decode_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& slots, const std::optional<at::Tensor>& lengths,
                                  double scale, const std::optional<at::Tensor>& mass,
                                  const std::optional<at::Tensor>& keep, int64_t block_size,
                                  int64_t bounds_offset, int64_t sink, int64_t recent);

}  // namespace entropic_ops
