// Weight-only int4 and int8 linear layers on AVX512-BF16 (bf16 activations, fp32 sums).
//   int4_linear(x, codes, scale, offset128) -> y
//   int8_linear(x, codes, scale) -> y
//   int4_linear_supported() -> bool           whether this build has them (avx512_bf16)
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using namespace entropic_kernels;

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
      // the offsets meet the group sums 16 groups at a time (a scalar chain of one fma per
      // group cost ~as much as the codes' dot products at batch 1)
      __m512 o = _mm512_setzero_ps();
      int64_t g = 0;
      for (; g + 16 <= a.groups; g += 16)
        o = _mm512_fmadd_ps(_mm512_loadu_ps(on + g), _mm512_loadu_ps(xs + g), o);
      if (g < a.groups) {
        const __mmask16 rest = __mmask16((1u << (a.groups - g)) - 1);
        o = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(rest, on + g),
                            _mm512_maskz_loadu_ps(rest, xs + g), o);
      }
      const float v = _mm512_reduce_add_ps(acc[c][t]) + _mm512_reduce_add_ps(o);
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

bool int4_linear_supported() { return has_avx512_bf16(); }

// The activation checks both quantized linears share; returns in_features.
int64_t check_activations(const at::Tensor& x, const char* op) {
  TORCH_CHECK(has_avx512_bf16(), op, ": this build has no AVX512-BF16 (the CPU lacks avx512_bf16)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              op, ": x must be a bfloat16 [rows, in_features] CPU tensor, unit stride");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 32 == 0, op, ": in_features ", k, " must be a multiple of 32");
  return k;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale) {
  const int64_t k = check_activations(x, "int8_linear");
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
  const int64_t k = check_activations(x, "int4_linear");
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

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor offset128) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor");
  m.def("int4_linear_supported() -> bool", &int4_linear_supported);
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
}
