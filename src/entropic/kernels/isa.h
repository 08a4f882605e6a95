// The ISA levels of entropic's native kernels and the table of functions each level provides.
//
// Every level is one translation unit (level_<name>.cpp) compiled for exactly that level's
// instruction set (a `#pragma GCC target` over a baseline build), from the same math headers
// (*_math.h); the op files (*.cpp) check their arguments, split the work between threads and
// call the active level's table. The level is chosen once, at load, as the best this CPU runs;
// `set_level` forces a lower one (ENTROPIC_ISA, tests, benchmarks).
//   amx         avx512bf16 plus AMX-BF16 tiles (Sapphire Rapids and later, where the OS grants
//               the tile state): prefill attention's products on tiles, the rest as avx512bf16
//   avx512bf16  AVX-512 F/BW/VL/DQ + BF16: bf16 dot products (VDPBF16PS)
//   avx512      AVX-512 F/BW/VL/DQ: fp32 FMA
//   avx2        AVX2 + FMA: fp32 FMA
//   generic     plain C++ for the machine's default target; no int4/int8 linear and no
//               prefill attention (the model then runs torch's)
// This header is shared by both sides, so it holds only types and declarations.
#pragma once

#include <cstdint>

namespace entropic_kernels {

using bf16_bits = uint16_t;  // a bfloat16 number's bits

constexpr int kNumLevels = 5;
constexpr const char* kLevelNames[kNumLevels] = {"amx", "avx512bf16", "avx512", "avx2",
                                                 "generic"};

// Slots to fetch into cache while a (row, KV head) is computed: `count` slots of the row
// that comes next, and how many leading slots of this row an earlier lookahead fetched.
struct Lookahead {
  const int64_t* slots = nullptr;
  int64_t count = 0;
  int64_t covered = 0;
};

// Decode attention's per-thread scratch, sized by the caller for one (row, KV head):
// qf and acc rep * head_dim floats, sc rep * (len rounded up to 16), stat 2 * rep.
// `partial`: where a chunk of a split row leaves its rep * (head_dim + 2) floats (each head's
// unnormalized output, max and sum) instead of writing `out` (null: a whole row).
struct AttendScratch {
  float* qf;
  float* sc;
  float* acc;
  float* stat;
  float* partial = nullptr;
};

// Weight-only int4 linear (quant_linear.cpp describes the layout).
struct Int4Args {
  const bf16_bits* x;
  int64_t x_stride;
  const uint8_t* codes;
  int64_t row_bytes;  // code bytes of one output column
  const float* scale;
  const float* offset;  // offset128
  bf16_bits* y;
  int64_t m_rows, n_cols, groups;
  // or (avx2 only, scale and offset null): fp16 scales [tiles, groups, 4] and the offsets
  // themselves (not offset128) as fp16 [out_features, groups], where they are exact in fp16
  const uint16_t* scale16;
  const uint16_t* offset16;
};

// Weight-only int8 linear, one scale per output column.
struct Int8Args {
  const bf16_bits* x;
  int64_t x_stride;
  const uint8_t* codes;
  const float* scale;
  bf16_bits* y;
  int64_t m_rows, n_cols, k;
};

constexpr int64_t kColTile = 4;    // quantized codes and scales are stored in tiles of 4 columns
constexpr int64_t kPfKeys = 64;    // prefill attention: keys per packed block
constexpr int64_t kPfQueries = 16; // prefill attention: query positions per work item

struct PrefillArgs {
  const void* q;  // q[i][h][dim] at q + i * q_stride + h * d + dim (the model's dtype)
  int64_t q_stride;
  const void* kp;  // packed keys, the level's layout
  const void* vp;  // packed values
  void* out;  // [q_len][heads * d], the model's dtype
  int64_t q_len, start, heads, kv_heads, d, blocks;
  float scale;
  const uint8_t* keep;  // the blocks this item attends (keep[b] != 0), null: all
};

// Prefill attention for one model dtype: bytes per packed K (or V) element; pack one block
// of 64 keys of one KV head; one work item (query block qb x KV head g), ws
// prefill_ws_floats floats. Null where the level has none.
struct PrefillKernels {
  int64_t elem_bytes;
  void (*pack)(const void* cache, const int64_t* slots, int64_t nk, int64_t kv_heads,
               int64_t d, int64_t g, int64_t b, void* kp, void* vp);
  void (*item)(const PrefillArgs& a, int64_t g, int64_t qb, float* ws);
};

template <typename T>
struct TypedKernels {
  // RMSNorm, RoPE + KV write and SiLU * up of rows [begin, end)
  void (*rms_norm)(const T* x, const T* w, T* y, int64_t begin, int64_t end, int64_t n,
                   int64_t x_stride, float eps);
  void (*rope_kv)(T* qkv, const T* cos, const T* sin, T* cache, const int64_t* slots,
                  int64_t begin, int64_t end, int64_t row_stride, int64_t heads,
                  int64_t kv_heads, int64_t d, float* tmp /* d floats */);
  void (*silu_mul)(const T* gate_up, T* y, int64_t begin, int64_t end, int64_t n,
                   int64_t stride);
  // decode attention of one row against one KV head and its `rep` query heads
  void (*attend)(const T* q, int64_t q_head_stride, const T* cache, const int64_t* slots,
                 int64_t len, int64_t kv_head, int64_t kv_heads, int64_t d, int64_t rep,
                 float scale, T* out, float* mass, const AttendScratch& scratch,
                 const Lookahead& ahead);
  // query-aware selection: the key-score bound of `n` blocks (decode_attention_math.h)
  void (*key_bounds)(const T* q, int64_t q_head_stride, const T* cache, const int64_t* rows,
                     int64_t n, int64_t kv_head, int64_t kv_heads, int64_t d, int64_t rep,
                     float* qf, float* out);
};

struct Kernels {
  const char* name;
  TypedKernels<float> f32;
  TypedKernels<bf16_bits> bf16;
  void (*logit_stats_row)(const float* x, int64_t n, float* mx, float* lse, float* ent,
                          int64_t* arg);
  float (*tempered_entropy_row)(const float* x, int64_t n, float m, float t);
  // The rest is null where the level has none (generic).
  // int4: prepare fills ws (m_rows * (groups + k) floats) from x; cols computes the output
  // columns [n_begin, n_end) (multiples of kColTile but for the last) of every row.
  void (*int4_prepare)(const Int4Args& a, float* ws);
  void (*int4_cols)(const Int4Args& a, const float* ws, int64_t n_begin, int64_t n_end);
  // int8: ws is m_rows * (k + 1) floats
  void (*int8_prepare)(const Int8Args& a, float* ws);
  void (*int8_cols)(const Int8Args& a, const float* ws, int64_t n_begin, int64_t n_end);
  // what the int4 and int8 linears multiply the codes with: "bf16" (the activations as
  // given) or "int16" (each group of 32 rounded to int16 with its own scale); null where
  // there are none
  const char* quant_activations;
  // how the int4 codes of a tile's pair of groups (128 bytes: 4 columns x 32 elements)
  // are ordered (quant_linear.cpp): 32 (each column's 32 bytes in turn) or 4 (runs of 4
  // bytes, column after column, for elements 4i..4i+3); 0 where there are none
  int int4_run;
  // prefill attention of bf16 and of float32 models
  PrefillKernels prefill_bf16;
  PrefillKernels prefill_f32;

  template <typename T>
  const TypedKernels<T>& typed() const;
};

template <>
inline const TypedKernels<float>& Kernels::typed<float>() const { return f32; }
template <>
inline const TypedKernels<bf16_bits>& Kernels::typed<bf16_bits>() const { return bf16; }

// Floats of PrefillKernels::item's workspace for `rows` rows (query positions x heads) of head_dim d.
inline int64_t prefill_ws_floats(int64_t rows, int64_t d) {
  return rows * (2 * d + 2 * kPfKeys + 4) + 16;
}

// Each level TU defines its getter: its table, or null where it was not built.
const Kernels* kernels_amx();
const Kernels* kernels_avx512bf16();
const Kernels* kernels_avx512();
const Kernels* kernels_avx2();
const Kernels* kernels_generic();

// The level in use (the best this CPU runs unless set_level chose another).
const Kernels& active();

}  // namespace entropic_kernels
