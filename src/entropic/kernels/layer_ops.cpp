// The small per-layer ops of a decoder layer, one pass each: RMSNorm, RoPE with the KV cache
// write, SiLU(gate) * up. Eager PyTorch spends a few microseconds of dispatch on every op
// whatever its size; at batch 1 a decoder layer is ~50 such ops (RMSNorm alone is ~10), which
// costs as much as its weights' memory traffic. These round exactly where the PyTorch formulas
// they replace round (bf16 results of fp32 arithmetic).
//   rms_norm(x, weight, eps) -> y                 y = weight * bf16(x * rsqrt(mean(x^2) + eps))
//   rope_kv_(qkv, cos, sin_signed, kv_cache, slot_mapping, num_heads, num_kv_heads)
//       rotates q and k in place in the fused qkv rows and writes k, v into their cache slots
//   silu_mul(gate_up) -> y                        y = silu(gate) * up, gate_up = [gate | up]
#include <torch/library.h>

#include <type_traits>

#include "common.h"

namespace {

using namespace entropic_kernels;

// ---------------------------------------------------------------------------------------------
// RMSNorm

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t n, int64_t x_stride,
                   float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
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
#if defined(__AVX512F__)
      const __m512 vinv = _mm512_set1_ps(inv);
      for (; j + 16 <= n; j += 16) {
        const __m512 normed = round16(_mm512_mul_ps(load16(xr + j), vinv), yr);
        store16(yr + j, round16(_mm512_mul_ps(load16(w + j), normed), yr));
      }
#endif
      for (; j < n; ++j) {
        float normed = round_to(load(xr + j) * inv, yr);
        store(yr + j, round_to(load(w + j) * normed, yr));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [rows, n] with unit stride");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous [n] tensor of x's dtype");
  auto y = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch(x, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(ptr<T>(x), ptr<T>(weight), ptr<T>(y), x.size(0), x.size(1), x.stride(0),
                     float(eps));
  });
  return y;
}

// ---------------------------------------------------------------------------------------------
// RoPE on q and k (in place, HF rotate-half layout) and the KV cache write

template <typename T>
void rope_kv_rows(T* qkv, const T* cos, const T* sin, T* cache, const int64_t* slots, int64_t rows,
                  int64_t row_stride, int64_t heads, int64_t kv_heads, int64_t d) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(d);
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * row_stride;
      const T* c = cos + t * d;
      const T* s = sin + t * d;
      // x * cos + roll(x, d/2) * sin_signed, each product rounded, then the sum rounded:
      // the same roundings as the torch formula (RotaryEmbedding.apply_).
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        T* x = row + h * d;
#if defined(__AVX512F__)
        if (d % 32 == 0 && d <= 256) {  // half a head is whole vectors: roll = swap them
          __m512 xv[16];
          const int64_t nv = d / 16;
          for (int64_t v = 0; v < nv; ++v) xv[v] = load16(x + 16 * v);
          for (int64_t v = 0; v < nv; ++v) {
            const __m512 a = round16(_mm512_mul_ps(xv[v], load16(c + 16 * v)), x);
            const __m512 b = round16(_mm512_mul_ps(xv[(v + nv / 2) % nv], load16(s + 16 * v)), x);
            store16(x + 16 * v, round16(_mm512_add_ps(a, b), x));
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
      // cache slot layout [2, kv_heads, d]: the rotated k, then v, as they sit in qkv
      std::memcpy(cache + slots[t] * 2 * kv_heads * d, row + heads * d,
                  sizeof(T) * 2 * kv_heads * d);
    }
  });
}

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
    rope_kv_rows<T>(ptr<T>(qkv), ptr<T>(cos), ptr<T>(sin_signed), ptr<T>(kv_cache), slots, t,
                    qkv.stride(0), num_heads, num_kv_heads, d);
  });
}

// ---------------------------------------------------------------------------------------------
// SwiGLU: silu(gate) * up

template <typename T>
void silu_mul_rows(const T* gu, T* y, int64_t rows, int64_t n, int64_t stride) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * stride;
      const T* u = g + n;
      T* yr = y + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {
        const __m512 x = load16(g + i);
        const __m512 act = round16(_mm512_div_ps(
            x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))), yr);
        store16(yr + i, round16(_mm512_mul_ps(act, load16(u + i)), yr));
      }
#endif
      for (; i < n; ++i) {
        float x = load(g + i);
        float act = round_to(x / (1.f + std::exp(-x)), yr);
        store(yr + i, round_to(act * load(u + i), yr));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_cpu_float(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [rows, 2 * n] with unit stride");
  const int64_t n = gate_up.size(1) / 2;
  auto y = at::empty({gate_up.size(0), n}, gate_up.options());
  dispatch(gate_up, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    silu_mul_rows<T>(ptr<T>(gate_up), ptr<T>(y), gate_up.size(0), n, gate_up.stride(0));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin_signed, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_kv_", &rope_kv_);
  m.impl("silu_mul", &silu_mul);
}
