// A decode step's whole stack of plain Llama decoder layers in one call, for models whose
// projections are all entropic's int4 linears. Each layer runs exactly the ops the Python
// layer runs (llama.py, LlamaModel._layer), in the same order, so the result is the same to
// the bit; what goes is the Python and dispatcher time around ~11 ops a layer (at batch 1
// on a small model, a tenth or more of a token's time).
//   decode_layers_(x, weights, kv, slot_mapping, cos, sin_signed, slots, lengths, mass,
//                  scale, eps, num_heads, num_kv_heads, keep, block_size, bounds_offset,
//                  sink, recent)
//     x: [rows, hidden], the residual stream, updated in place; rows are decode rows only
//     weights: 14 tensors a layer, layer after layer: in_norm, post_norm, then codes, scale
//       and offset128 (int4_linear's) of qkv, o, gate_up and down
//     kv: [layers, slots, 2, kv_heads, head_dim], every layer's cache
//     slot_mapping, cos, sin_signed: rope_kv_'s; slots, lengths, mass, keep and the
//       selection's block_size, bounds_offset, sink, recent: paged_decode_attention's (one
//       group of every row, in batch order; with `keep`, each layer selects its own blocks)
#include <torch/library.h>

#include <vector>

#include "common.h"
#include "ops.h"

namespace entropic_ops {

constexpr int64_t kTensorsPerLayer = 14;

void decode_layers_(at::Tensor x, at::TensorList weights, const at::Tensor& kv,
                    const at::Tensor& slot_mapping, const at::Tensor& cos,
                    const at::Tensor& sin_signed, const at::Tensor& slots,
                    const std::optional<at::Tensor>& lengths,
                    const std::optional<at::Tensor>& mass, double scale, double eps,
                    int64_t num_heads, int64_t num_kv_heads,
                    const std::optional<at::Tensor>& keep, int64_t block_size,
                    int64_t bounds_offset, int64_t sink, int64_t recent) {
  const int64_t n_weights = static_cast<int64_t>(weights.size());
  TORCH_CHECK(kv.dim() == 5 && kv.is_contiguous(),
              "decode_layers_: kv must be a contiguous [layers, slots, 2, kv_heads, head_dim] "
              "tensor");
  const int64_t layers = kv.size(0);
  TORCH_CHECK(n_weights == layers * kTensorsPerLayer, "decode_layers_: ", n_weights,
              " weights for ", layers, " layers, expected ", kTensorsPerLayer, " a layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers_: x must be a contiguous "
              "[rows, hidden] tensor");
  const int64_t rows = x.size(0), d = kv.size(4);
  const int64_t q_size = num_heads * d;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kTensorsPerLayer;
    const at::Tensor cache = kv.select(0, i);
    const at::Tensor qkv = int4_linear(rms_norm(x, w[0], eps), w[2], w[3], w[4]);
    rope_kv_(qkv, cos, sin_signed, cache, slot_mapping, num_heads, num_kv_heads);
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads, d});
    x.add_(int4_linear(paged_decode_attention(q, cache, slots, lengths, scale, mass, keep,
                                              block_size, bounds_offset, sink, recent),
                       w[5], w[6], w[7]));
    x.add_(int4_linear(silu_mul(int4_linear(rms_norm(x, w[1], eps), w[8], w[9], w[10])),
                       w[11], w[12], w[13]));
  }
}

}  // namespace entropic_ops

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("decode_layers_(Tensor(a!) x, Tensor[] weights, Tensor(b!) kv, Tensor slot_mapping, "
        "Tensor cos, Tensor sin_signed, Tensor slots, Tensor? lengths, Tensor(c!)? mass, "
        "float scale, float eps, int num_heads, int num_kv_heads, Tensor? keep=None, "
        "int block_size=16, int bounds_offset=0, int sink=0, int recent=1) -> ()");
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("decode_layers_", &entropic_ops::decode_layers_);
}
