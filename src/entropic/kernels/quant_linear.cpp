// Weight-only int4 and int8 linear layers (bf16 activations, fp32 sums; quant_linear_math.h
// has the math of each ISA level).
//   int4_linear(x, codes, scale, offset128) -> y
//     W in groups of 32 inputs, w = scale * q + offset, q in 0..15; codes two groups per 32
//     bytes (byte j: element j of the even group in the low nibble, of the odd group in the
//     high one), in tiles of 4 output columns, each tile's codes and scales contiguous;
//     offset128 = offset - 128 * scale (the kernels read a code as 128 + q); codes
//     [tiles, pairs, 4, 32]: a tile's pair of groups is its 4 columns' 32 bytes in turn; at
//     a level whose int4_run() is 4 (avx2), [tiles, pairs, 8, 4, 4] instead: the same 128
//     bytes as 8 chunks, chunk i holding bytes 4i..4i+3 of each column, column after column
//     At the avx2 level scale may be float16 instead (same shape), offset128 then being the
//     offsets themselves as float16 [out_features, groups]: for weights whose scales and
//     offsets are exact in fp16 (a GGUF's Q4_0/Q4_1), a sixth fewer bytes to read
//   int4_run() -> int                         32 or 4: which of those layouts the level reads
//                                             (int8's codes, a group per 128 bytes, likewise)
//   int8_linear(x, codes, scale) -> y
//     w = scale * (c - 128), c = q + 128 in 0..255 stored as a byte, in tiles of 4 columns
//   int4_linear_supported() -> bool           whether the level in use has them (AVX2 or better)
//   quant_activations() -> str                "bf16" where both multiply the activations as
//                                             given, "int16" where they round each group of
//                                             32 to int16 first (avx2), "none" (generic)
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "common.h"
#include "ops.h"

namespace entropic_ops {

using namespace entropic_kernels;

// Threads split blocks of output columns; a block is every row of its columns, tile by tile
// (quant_linear_math.h). The split decides only who computes an output, never the order of
// its sum.
template <typename Cols>
void over_column_blocks(int64_t m_rows, int64_t n_cols, Cols&& cols) {
  const int64_t col_block = m_rows > 4 ? 64 : 16;
  at::parallel_for(0, (n_cols + col_block - 1) / col_block, 1, [&](int64_t b0, int64_t b1) {
    cols(b0 * col_block, std::min(n_cols, b1 * col_block));
  });
}

bool int4_linear_supported() { return active().int4_cols != nullptr; }
int64_t int4_run() { return active().int4_run; }
std::string quant_activations() {
  const char* f = active().quant_activations;
  return f ? f : "none";
}

// The activation checks both quantized linears share; returns in_features.
int64_t check_activations(const at::Tensor& x, const char* op) {
  const Kernels& level = active();
  TORCH_CHECK(level.int4_cols != nullptr, op, ": the ", level.name,
              " level has no quantized linears (they need AVX2 or better)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  x.stride(1) == 1,
              op, ": x must be a bfloat16 [rows, in_features] CPU tensor, unit stride");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % 32 == 0, op, ": in_features ", k, " must be a multiple of 32");
  return k;
}

// The order of the codes within a tile's 128 bytes, as the level in use reads it (int4_run):
// [tiles, n, 4, 32] in 32-byte column runs, or [tiles, n, 8, 4, 4] in 4-column chunks.
void check_code_layout(const at::Tensor& codes, const char* op, const char* what) {
  const int run = active().int4_run;
  TORCH_CHECK(run == 32 ? codes.dim() == 4 && codes.size(2) == kColTile && codes.size(3) == 32
                        : codes.dim() == 5 && codes.size(2) == 8 && codes.size(3) == kColTile &&
                              codes.size(4) == 4,
              op, ": the ", active().name, " level reads codes of shape [tiles, ", what, ", ",
              run == 32 ? "4, 32" : "8, 4, 4", "], got ", codes.sizes(), " (codes packed for "
              "another level: build the linear at the level it runs at, int4_run() says which)");
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
  check_code_layout(codes, "int8_linear", "groups");
  auto y = at::empty({x.size(0), n}, x.options());
  const int64_t m = x.size(0);
  const Int8Args a{ptr<bf16_bits>(x), x.stride(0), codes.data_ptr<uint8_t>(),
                   scale.data_ptr<float>(), ptr<bf16_bits>(y), m, n, k};
  const Kernels& level = active();
  // (the avx2 level's is the largest: scales and 4 int16 copies of x)
  auto ws = at::empty({m * (2 * k + k / 32 + 1)}, x.options().dtype(at::kFloat));
  level.int8_prepare(a, ws.data_ptr<float>());
  over_column_blocks(m, n, [&](int64_t n0, int64_t n1) {
    level.int8_cols(a, ws.data_ptr<float>(), n0, n1);
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                       const at::Tensor& offset128) {
  const int64_t k = check_activations(x, "int4_linear");
  const int64_t groups = k / 32;
  const bool half = scale.scalar_type() == at::kHalf;
  const int run = active().int4_run;
  TORCH_CHECK(!half || run == 4, "int4_linear: fp16 scales are read at the avx2 level only, "
              "the level in use is ", active().name, " (build the linear at the level it runs at)");
  TORCH_CHECK(offset128.scalar_type() == (half ? at::kHalf : at::kFloat) &&
                  offset128.is_contiguous() && offset128.dim() == 2 && offset128.size(1) == groups,
              "int4_linear: offset must be a contiguous ", half ? "float16" : "float32",
              " [out_features, in_features / 32] (with fp16 scales the offsets themselves, "
              "else offset - 128 * scale)");
  const int64_t n = offset128.size(0), tiles = (n + kColTile - 1) / kColTile;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.numel() == tiles * kColTile * ((groups + 1) / 2) * 32,
              "int4_linear: codes must be contiguous uint8 [ceil(out_features / 4), "
              "ceil(groups / 2), 4, 32]");
  check_code_layout(codes, "int4_linear", "pairs");
  TORCH_CHECK((half || scale.scalar_type() == at::kFloat) && scale.is_contiguous() &&
                  scale.numel() == tiles * kColTile * groups,
              "int4_linear: scale must be contiguous float32 (or float16 at the avx2 level) "
              "[ceil(out_features / 4), groups, 4]");
  auto y = at::empty({x.size(0), n}, x.options());
  const int64_t m = x.size(0);
  const auto half_ptr = [](const at::Tensor& t) {
    return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
  };
  const Int4Args a{ptr<bf16_bits>(x), x.stride(0), codes.data_ptr<uint8_t>(), (groups + 1) / 2 * 32,
                   half ? nullptr : scale.data_ptr<float>(),
                   half ? nullptr : offset128.data_ptr<float>(), ptr<bf16_bits>(y), m, n, groups,
                   half ? half_ptr(scale) : nullptr, half ? half_ptr(offset128) : nullptr};
  const Kernels& level = active();
  // (the avx2 level's is the largest: group sums, scales, and 4 int16 copies of x)
  auto ws = at::empty({m * (2 * groups + 2 * k)}, x.options().dtype(at::kFloat));
  level.int4_prepare(a, ws.data_ptr<float>());
  over_column_blocks(m, n, [&](int64_t n0, int64_t n1) {
    level.int4_cols(a, ws.data_ptr<float>(), n0, n1);
  });
  return y;
}

}  // namespace entropic_ops

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scale, Tensor offset128) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scale) -> Tensor");
  m.def("int4_linear_supported() -> bool", &entropic_ops::int4_linear_supported);
  m.def("quant_activations() -> str", &entropic_ops::quant_activations);
  m.def("int4_run() -> int", &entropic_ops::int4_run);
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("int4_linear", &entropic_ops::int4_linear);
  m.impl("int8_linear", &entropic_ops::int8_linear);
}
