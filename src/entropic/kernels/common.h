// Shared helpers of entropic's op files (argument checks, storage types, dispatch on the
// dtype); the kernels' math lives in the ISA levels (isa.h).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

#include "isa.h"

namespace entropic_kernels {

#include "scalar.h"

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

inline void check_cpu_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "entropic kernels: ", name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              "entropic kernels: ", name, " must be float32 or bfloat16, got ", t.scalar_type());
}

// Dispatch on the storage type of a float32 / bfloat16 tensor.
template <typename F>
void dispatch(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else {
    f(static_cast<bf16_bits*>(nullptr));
  }
}

}  // namespace entropic_kernels
