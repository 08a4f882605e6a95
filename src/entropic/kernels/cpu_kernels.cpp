// Native CPU kernels of the entropic engine: the small per-layer ops fused into one pass each,
// and a paged decode attention that reads the KV cache in place.
//
// Eager PyTorch spends a few microseconds of dispatch on every op whatever its size; at batch 1
// a decoder layer is ~50 such ops (RMSNorm alone is ~10), which costs as much as its weights'
// memory traffic. These kernels replace them with one call each. They round exactly where the
// PyTorch formulas they replace round (bf16 results of fp32 arithmetic), so outputs agree with
// the torch path up to fp32 summation order.
//
// Ops (registered as torch.ops.entropic.*):
//   rms_norm(x, weight, eps) -> y                 y = weight * bf16(x * rsqrt(mean(x^2) + eps))
//   rope_kv_(qkv, cos, sin_signed, kv_cache, slot_mapping, num_heads, num_kv_heads)
//       rotates q and k in place in the fused qkv rows and writes k, v into their cache slots
//   silu_mul(gate_up) -> y                        y = silu(gate) * up, gate_up = [gate | up]
//   paged_decode_attention(q, kv_cache, slots, lengths, scale, mass) -> out
//       one new token per row against the context slots of that row, read in place
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bf16_bits = uint16_t;

inline float load(const float* p) { return *p; }
inline float load(const bf16_bits* p) {
  uint32_t u = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to the storage type: round-to-nearest-even for bf16, as c10::BFloat16 does.
inline float round_to(float f, const float*) { return f; }
inline float round_to(float f, const bf16_bits*) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if (std::isnan(f)) {
    u = 0x7fc00000u;
  } else {
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  }
  float r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

inline void store(float* p, float f) { *p = f; }
inline void store(bf16_bits* p, float f) {  // f must already be rounded (round_to)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  *p = bf16_bits(u >> 16);
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_bits* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// 16 lanes rounded as round_to rounds one value
inline __m512 round16(__m512 f, const float*) { return f; }
inline __m512 round16(__m512 f, const bf16_bits*) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(int(0xffff0000u)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(r);
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(bf16_bits* p, __m512 v) {  // v must already be rounded (round16)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
#endif

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

void check_cpu_float(const at::Tensor& t, const char* name) {
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
// Paged decode attention

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

// One row, one KV head and the `rep` query heads that share it. Scores and softmax in fp32.
template <typename T>
void attend_generic(const T* q, int64_t q_head_stride, const T* cache, const int64_t* slots,
                    int64_t len, int64_t kv_head, int64_t kv_heads, int64_t d, int64_t rep,
                    float scale, T* out, float* mass, std::vector<float>& qf,
                    std::vector<float>& sc, std::vector<float>& acc) {
  const int64_t slot_size = 2 * kv_heads * d;
  qf.resize(rep * d);
  sc.resize(rep * len);
  acc.assign(rep * d, 0.f);
  for (int64_t h = 0; h < rep; ++h)
    for (int64_t i = 0; i < d; ++i) qf[h * d + i] = load(q + h * q_head_stride + i);
  std::vector<float> mx(rep, -std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < len; ++j) {
    const T* k = cache + slots[j] * slot_size + kv_head * d;
    for (int64_t h = 0; h < rep; ++h) {
      float s = dot(qf.data() + h * d, k, d) * scale;
      sc[h * len + j] = s;
      mx[h] = std::max(mx[h], s);
    }
  }
  std::vector<float> sum_v(rep, 0.f);
  float* sum = sum_v.data();
  for (int64_t h = 0; h < rep; ++h) {
    float* s = sc.data() + h * len;
    for (int64_t j = 0; j < len; ++j) {
      s[j] = std::exp(s[j] - mx[h]);
      sum[h] += s[j];
    }
  }
  for (int64_t j = 0; j < len; ++j) {
    const T* v = cache + slots[j] * slot_size + (kv_heads + kv_head) * d;
    for (int64_t h = 0; h < rep; ++h) {
      const float p = sc[h * len + j];
      float* a = acc.data() + h * d;
      for (int64_t i = 0; i < d; ++i) a[i] += p * load(v + i);
    }
  }
  finish_heads<T>(acc.data(), sc.data(), sum, len, d, rep, out, mass);
}

#if defined(__AVX512F__)

// exp on 16 lanes (Cephes' expf: range reduction by ln 2, degree-6 polynomial; ~1 ulp).
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3365447505f)),
                    _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

constexpr int64_t kMaxVec = 16;  // head_dim up to 256
constexpr int64_t kMaxRep = 16;  // query heads per KV head

// The same computation with AVX-512: head_dim a multiple of 16 (up to 256), rep <= 16.
template <typename T>
void attend_avx512(const T* q, int64_t q_head_stride, const T* cache, const int64_t* slots,
                   int64_t len, int64_t kv_head, int64_t kv_heads, int64_t d, int64_t rep,
                   float scale, T* out, float* mass, std::vector<float>& qf,
                   std::vector<float>& sc, std::vector<float>& acc) {
  const int64_t slot_size = 2 * kv_heads * d, nv = d / 16;
  qf.resize(rep * d);
  sc.resize(rep * len);
  acc.assign(rep * d, 0.f);
  for (int64_t h = 0; h < rep; ++h)
    for (int64_t i = 0; i < d; ++i) qf[h * d + i] = load(q + h * q_head_stride + i);
  float mx[kMaxRep], sum[kMaxRep];
  for (int64_t h = 0; h < rep; ++h) mx[h] = -std::numeric_limits<float>::infinity();
  __m512 kv[kMaxVec];
  for (int64_t j = 0; j < len; ++j) {
    const T* k = cache + slots[j] * slot_size + kv_head * d;
    for (int64_t v = 0; v < nv; ++v) kv[v] = load16(k + 16 * v);
    for (int64_t h = 0; h < rep; ++h) {
      const float* qh = qf.data() + h * d;
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qh), kv[0]);
      for (int64_t v = 1; v < nv; ++v) a = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * v), kv[v], a);
      const float s = _mm512_reduce_add_ps(a) * scale;
      sc[h * len + j] = s;
      mx[h] = std::max(mx[h], s);
    }
  }
  for (int64_t h = 0; h < rep; ++h) {
    float* s = sc.data() + h * len;
    const __m512 m = _mm512_set1_ps(mx[h]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 lanes = len - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (len - j)) - 1);
      __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + j), m));
      _mm512_mask_storeu_ps(s + j, lanes, e);
      total = _mm512_add_ps(total, _mm512_maskz_mov_ps(lanes, e));
    }
    sum[h] = _mm512_reduce_add_ps(total);
  }
  for (int64_t j = 0; j < len; ++j) {
    const T* v = cache + slots[j] * slot_size + (kv_heads + kv_head) * d;
    for (int64_t i = 0; i < nv; ++i) kv[i] = load16(v + 16 * i);
    for (int64_t h = 0; h < rep; ++h) {
      const __m512 p = _mm512_set1_ps(sc[h * len + j]);
      float* a = acc.data() + h * d;
      for (int64_t i = 0; i < nv; ++i)
        _mm512_storeu_ps(a + 16 * i, _mm512_fmadd_ps(p, kv[i], _mm512_loadu_ps(a + 16 * i)));
    }
  }
  finish_heads<T>(acc.data(), sc.data(), sum, len, d, rep, out, mass);
}
#endif

template <typename T>
void attend(const T* q, int64_t q_head_stride, const T* cache, const int64_t* slots, int64_t len,
            int64_t kv_head, int64_t kv_heads, int64_t d, int64_t rep, float scale, T* out,
            float* mass, std::vector<float>& qf, std::vector<float>& sc, std::vector<float>& acc) {
#if defined(__AVX512F__)
  if (d % 16 == 0 && d / 16 <= kMaxVec && rep <= kMaxRep) {
    attend_avx512<T>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, d, rep, scale, out,
                     mass, qf, sc, acc);
    return;
  }
#endif
  attend_generic<T>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, d, rep, scale, out,
                    mass, qf, sc, acc);
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
        alignas(64) float act[16], up[16];
        const __m512 x = load16(g + i);
        _mm512_store_ps(act, _mm512_div_ps(
            x, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
        _mm512_store_ps(up, load16(u + i));
        for (int l = 0; l < 16; ++l) store(yr + i + l, round_to(round_to(act[l], yr) * up[l], yr));
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

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& slots, const std::optional<at::Tensor>& lengths,
                                  double scale, const std::optional<at::Tensor>& mass) {
  check_cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "paged_decode_attention: q must be [rows, heads, head_dim], heads contiguous");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous() && kv_cache.size(1) == 2 &&
                  kv_cache.size(3) == q.size(2) && kv_cache.scalar_type() == q.scalar_type(),
              "paged_decode_attention: kv_cache must be a contiguous [slots, 2, kv_heads, "
              "head_dim] tensor of q's dtype");
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = kv_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "paged_decode_attention: heads (", heads,
              ") must be a multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(slots.dim() == 2 && slots.size(0) == n && slots.is_contiguous() &&
                  slots.scalar_type() == at::kLong,
              "paged_decode_attention: slots must be a contiguous int64 [rows, ctx] tensor");
  const int64_t ctx = slots.size(1), num_slots = kv_cache.size(0);
  std::vector<int64_t> len(n, ctx);
  if (lengths.has_value()) {
    TORCH_CHECK(lengths->scalar_type() == at::kLong && lengths->numel() == n &&
                    lengths->is_contiguous(),
                "paged_decode_attention: lengths must be a contiguous int64 [rows] tensor");
    const int64_t* l = lengths->data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(l[r] >= 1 && l[r] <= ctx, "paged_decode_attention: length ", l[r],
                  " of row ", r, " out of range [1, ", ctx, "]");
      len[r] = l[r];
    }
  }
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < len[r]; ++j) {
      const int64_t s = sl[r * ctx + j];
      TORCH_CHECK(s >= 0 && s < num_slots, "paged_decode_attention: slot ", s,
                  " out of range [0, ", num_slots, ")");
    }
  }
  float* mass_ptr = nullptr;
  if (mass.has_value()) {
    TORCH_CHECK(mass->scalar_type() == at::kFloat && mass->is_contiguous() &&
                    mass->dim() == 2 && mass->size(0) == n && mass->size(1) == ctx,
                "paged_decode_attention: mass must be a contiguous float32 [rows, ctx] tensor");
    mass_ptr = mass->data_ptr<float>();
  }
  auto out = at::empty({n, heads * d}, q.options());
  const int64_t rep = heads / kv_heads;
  dispatch(q, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* qp = ptr<T>(q);
    const T* cache = ptr<T>(kv_cache);
    T* op = ptr<T>(out);
    // Work items are (row, kv head); with `mass`, a row's heads add into one mass row, so
    // then a row is one item.
    const int64_t per_row = mass_ptr ? 1 : kv_heads;
    at::parallel_for(0, n * per_row, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf, sc, acc;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / per_row;
        const int64_t g0 = mass_ptr ? 0 : item % per_row;
        const int64_t g1 = mass_ptr ? kv_heads : g0 + 1;
        for (int64_t g = g0; g < g1; ++g) {
          attend<T>(qp + r * q.stride(0) + g * rep * d, d, cache, sl + r * ctx, len[r], g,
                    kv_heads, d, rep, float(scale), op + r * heads * d + g * rep * d,
                    mass_ptr ? mass_ptr + r * ctx : nullptr, qf, sc, acc);
        }
      }
    });
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Weight-only int4 linear: y = x @ W.T with W in groups of 32 inputs, w = scale * q + offset,
// q in 0..15. Each group is one AVX512-BF16 dot product of bf16 codes against the bf16
// activations (exact products, fp32 sums), scaled in fp32; offsets meet the activations'
// group sums. Codes are stored two groups per 32 bytes (byte j: element j of the even group
// in the low nibble, of the odd group in the high one), so that a nibble becomes the bf16
// number 128 + q with one OR (0x4300 is bf16 128; 128..255 are exact in bf16); the extra
// 128 * scale is taken off the offset at load time (`offset128` = offset - 128 * scale).
// Every output (row m, column n) is summed in the same order whatever M, the tiling and
// the thread count: a row's result does not depend on the other rows of the call.

constexpr int64_t kRowTile = 4;
constexpr int64_t kColTile = 4;  // the codes and scales are stored in tiles of 4 columns
constexpr int64_t kPrefetchBytes = 1024;

#if defined(__AVX512BF16__)

// Runs `tile(rows, m0, n0)` over every tile of kRowTile rows x kColTile columns, `rows` as a
// compile-time constant (std::integral_constant), threads splitting blocks of columns. The
// tiling decides only who computes an output, never the order of its sum.
template <typename Tile>
void over_tiles(int64_t m_rows, int64_t n_cols, Tile&& tile) {
  const int64_t col_block = m_rows > kRowTile ? 64 : 16;
  at::parallel_for(0, (n_cols + col_block - 1) / col_block, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n_end = std::min(n_cols, b1 * col_block);
    for (int64_t m0 = 0; m0 < m_rows; m0 += kRowTile) {
      const int64_t mt = std::min(kRowTile, m_rows - m0);
      for (int64_t n0 = b0 * col_block; n0 < n_end; n0 += kColTile) {
        switch (mt) {
          case 4: tile(std::integral_constant<int, 4>{}, m0, n0); break;
          case 3: tile(std::integral_constant<int, 3>{}, m0, n0); break;
          case 2: tile(std::integral_constant<int, 2>{}, m0, n0); break;
          default: tile(std::integral_constant<int, 1>{}, m0, n0); break;
        }
      }
    }
  });
}

struct Int4Args {
  const bf16_bits* x;
  int64_t x_stride;
  const uint8_t* codes;
  int64_t row_bytes;
  const float* scale;
  const float* offset;
  const float* xsum;
  bf16_bits* y;
  int64_t n_cols, groups;
};

// One tile of MT rows x kColTile columns, accumulators in registers (compile-time sizes).
// The tile's codes and scales are contiguous, read front to back.
template <int MT>
void int4_tile(const Int4Args& a, int64_t m0, int64_t n0) {
  constexpr int NT = kColTile;
  const __m512i low4 = _mm512_set1_epi16(0x000f), bias = _mm512_set1_epi16(0x4300);
  __m512 acc[NT][MT];
  for (int c = 0; c < NT; ++c)
    for (int t = 0; t < MT; ++t) acc[c][t] = _mm512_setzero_ps();
  const int64_t tile = n0 / NT;
  const uint8_t* cb = a.codes + tile * a.row_bytes * NT;
  const float* sb = a.scale + tile * a.groups * NT;
  for (int64_t g = 0; g < a.groups; g += 2) {
    // the tile streams from memory: ask for its data a few pairs ahead
    _mm_prefetch(reinterpret_cast<const char*>(cb + (g / 2 * NT) * 32 + kPrefetchBytes),
                 _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cb + (g / 2 * NT) * 32 + kPrefetchBytes + 64),
                 _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(sb + g * NT) + kPrefetchBytes / 4, _MM_HINT_T0);
    __m512bh w0[NT], w1[NT];
    for (int c = 0; c < NT; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(cb + (g / 2 * NT + c) * 32)));
      w0[c] = (__m512bh)_mm512_ternarylogic_epi32(v, low4, bias, 0xEA);  // (v & 15) | bias
      w1[c] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
    }
    for (int t = 0; t < MT; ++t) {
      const __m512bh x0 = (__m512bh)_mm512_loadu_si512(a.x + (m0 + t) * a.x_stride + g * 32);
      for (int c = 0; c < NT; ++c)
        acc[c][t] = _mm512_fmadd_ps(_mm512_set1_ps(sb[g * NT + c]),
                                    _mm512_dpbf16_ps(_mm512_setzero_ps(), w0[c], x0), acc[c][t]);
    }
    if (g + 1 < a.groups) {
      for (int t = 0; t < MT; ++t) {
        const __m512bh x1 =
            (__m512bh)_mm512_loadu_si512(a.x + (m0 + t) * a.x_stride + g * 32 + 32);
        for (int c = 0; c < NT; ++c)
          acc[c][t] = _mm512_fmadd_ps(_mm512_set1_ps(sb[(g + 1) * NT + c]),
                                      _mm512_dpbf16_ps(_mm512_setzero_ps(), w1[c], x1),
                                      acc[c][t]);
      }
    }
  }
  for (int c = 0; c < NT && n0 + c < a.n_cols; ++c) {  // padding columns are not stored
    const float* on = a.offset + (n0 + c) * a.groups;
    for (int t = 0; t < MT; ++t) {
      const float* xs = a.xsum + (m0 + t) * a.groups;
      float off = 0.f;
      for (int64_t g = 0; g < a.groups; ++g) off += on[g] * xs[g];
      const float v = _mm512_reduce_add_ps(acc[c][t]) + off;
      bf16_bits* out = a.y + (m0 + t) * a.n_cols + n0 + c;
      store(out, round_to(v, out));
    }
  }
}

void int4_rows(const bf16_bits* x, int64_t x_stride, const uint8_t* codes, const float* scale,
               const float* offset, bf16_bits* y, int64_t m_rows, int64_t n_cols, int64_t k) {
  const int64_t groups = k / 32;
  std::vector<float> xsum(m_rows * groups);  // group sums of each activation row
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t g = 0; g < groups; ++g)
      xsum[m * groups + g] = _mm512_reduce_add_ps(_mm512_add_ps(
          load16(x + m * x_stride + g * 32), load16(x + m * x_stride + g * 32 + 16)));
  const Int4Args a{x, x_stride, codes, (groups + 1) / 2 * 32, scale, offset, xsum.data(), y,
                   n_cols, groups};
  over_tiles(m_rows, n_cols, [&](auto mt, int64_t m0, int64_t n0) {
    int4_tile<decltype(mt)::value>(a, m0, n0);
  });
}
// Weight-only int8 linear, one scale per output column: w = scale * (c - 128), c = q + 128 in
// 0..255 stored as a byte. A byte is split into nibbles lo + 16 hi; each nibble becomes the
// exact bf16 number 128 + nibble (one OR), and the high one meets 16 x (exact in bf16), so
// one fp32 accumulator per output sums both dot products:
//   acc = sum (128 + lo) x + (128 + hi) 16 x = sum c x + 2176 sum x,
//   y = scale * (acc - 2304 sum x).
template <int MT>
void int8_tile(const bf16_bits* x, const bf16_bits* x16, int64_t k, const uint8_t* codes,
               const float* scale, const float* xsum, bf16_bits* y, int64_t m0, int64_t n0,
               int64_t n_cols) {
  constexpr int NT = kColTile;
  const __m512i low4 = _mm512_set1_epi16(0x000f), bias = _mm512_set1_epi16(0x4300);
  __m512 acc[NT][MT];
  for (int c = 0; c < NT; ++c)
    for (int t = 0; t < MT; ++t) acc[c][t] = _mm512_setzero_ps();
  const uint8_t* cb = codes + (n0 / NT) * NT * k;
  for (int64_t g = 0; g < k / 32; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(cb + g * NT * 32 + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cb + g * NT * 32 + kPrefetchBytes + 64),
                 _MM_HINT_T0);
    __m512bh lo[NT], hi[NT];
    for (int c = 0; c < NT; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + (g * NT + c) * 32)));
      lo[c] = (__m512bh)_mm512_ternarylogic_epi32(v, low4, bias, 0xEA);
      hi[c] = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
    }
    for (int t = 0; t < MT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + (m0 + t) * k + g * 32);
      const __m512bh xv16 = (__m512bh)_mm512_loadu_si512(x16 + (m0 + t) * k + g * 32);
      for (int c = 0; c < NT; ++c)
        acc[c][t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[c][t], lo[c], xv), hi[c], xv16);
    }
  }
  for (int c = 0; c < NT && n0 + c < n_cols; ++c) {
    for (int t = 0; t < MT; ++t) {
      const float v = scale[n0 + c] * (_mm512_reduce_add_ps(acc[c][t]) - 2304.f * xsum[m0 + t]);
      bf16_bits* out = y + (m0 + t) * n_cols + n0 + c;
      store(out, round_to(v, out));
    }
  }
}

void int8_rows(const bf16_bits* x, int64_t x_stride, const uint8_t* codes, const float* scale,
               bf16_bits* y, int64_t m_rows, int64_t n_cols, int64_t k) {
  // contiguous copies of x and 16 x (exact: a power of two), and each row's sum
  std::vector<bf16_bits> xc(m_rows * k), x16(m_rows * k);
  std::vector<float> xsum(m_rows);
  for (int64_t m = 0; m < m_rows; ++m) {
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
      const __m512 v = load16(x + m * x_stride + i);
      total = _mm512_add_ps(total, v);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xc.data() + m * k + i),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * x_stride + i)));
      const __m512i b = _mm512_castps_si512(_mm512_mul_ps(v, _mm512_set1_ps(16.f)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x16.data() + m * k + i),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
    }
    xsum[m] = _mm512_reduce_add_ps(total);
  }
  over_tiles(m_rows, n_cols, [&](auto mt, int64_t m0, int64_t n0) {
    int8_tile<decltype(mt)::value>(xc.data(), x16.data(), k, codes, scale, xsum.data(), y, m0,
                                   n0, n_cols);
  });
}
#endif

bool int4_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  TORCH_CHECK(int4_linear_supported(),
              "int8_linear: this build has no AVX512-BF16 (the CPU lacks avx512_bf16)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              "int8_linear: x must be a bfloat16 [rows, in_features] CPU tensor, unit stride");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "int8_linear: in_features ", k, " must be a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 1,
              "int8_linear: scale must be a contiguous float32 [out_features]");
  const int64_t n = scale.size(0), tiles = (n + kColTile - 1) / kColTile;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == tiles * kColTile * k,
              "int8_linear: codes must be contiguous uint8 [ceil(out_features / 4), "
              "in_features / 32, 4, 32]");
  auto y = at::empty({x.size(0), n}, x.options());
#if defined(__AVX512BF16__)
  int8_rows(ptr<bf16_bits>(x), x.stride(0), codes.data_ptr<uint8_t>(), scale.data_ptr<float>(),
            ptr<bf16_bits>(y), x.size(0), n, k);
#endif
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& offset128) {
  TORCH_CHECK(int4_linear_supported(),
              "int4_linear: this build has no AVX512-BF16 (the CPU lacks avx512_bf16)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              "int4_linear: x must be a bfloat16 [rows, in_features] CPU tensor, unit stride");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "int4_linear: in_features ", k, " must be a multiple of 32");
  const int64_t groups = k / 32;
  TORCH_CHECK(offset128.scalar_type() == at::kFloat && offset128.is_contiguous() &&
                  offset128.dim() == 2 && offset128.size(1) == groups,
              "int4_linear: offset must be a contiguous float32 [out_features, in_features / 32]");
  const int64_t n = offset128.size(0), tiles = (n + kColTile - 1) / kColTile;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == tiles * kColTile * ((groups + 1) / 2) * 32,
              "int4_linear: codes must be contiguous uint8 [ceil(out_features / 4), "
              "ceil(groups / 2), 4, 32]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  scale.numel() == tiles * kColTile * groups,
              "int4_linear: scale must be contiguous float32 [ceil(out_features / 4), groups, 4]");
  auto y = at::empty({x.size(0), n}, x.options());
#if defined(__AVX512BF16__)
  int4_rows(ptr<bf16_bits>(x), x.stride(0), codes.data_ptr<uint8_t>(), scale.data_ptr<float>(),
            offset128.data_ptr<float>(), ptr<bf16_bits>(y), x.size(0), n, k);
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(entropic, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin_signed, Tensor(b!) kv_cache, "
        "Tensor slot_mapping, int num_heads, int num_kv_heads) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor offset128) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor");
  m.def("int4_linear_supported() -> bool", &int4_linear_supported);
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor slots, Tensor? lengths, "
        "float scale, Tensor(a!)? mass) -> Tensor");
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rope_kv_", &rope_kv_);
  m.impl("silu_mul", &silu_mul);
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("paged_decode_attention", &paged_decode_attention);
}
