// Causal prefill attention over the paged KV cache, flash style (prefill_attention_math.h
// has the math of each ISA level). A chunk of q_len new tokens at positions start ..
// start + q_len - 1 of one sequence attends to the keys at positions 0 .. its own, read from
// the paged cache through `slots` (rope_kv_ has already written the chunk's own).
//   prefill_attention(q, kv_cache, slots, start, scale) -> out   (bfloat16 or float32)
//   prefill_attention_supported() -> bool      whether the level in use has it (AVX2 or better)
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using namespace entropic_kernels;

// The keys and values of every (KV head, block of 64 keys) are packed first, in the level's
// layout; then work items (16 query positions x one KV head) are handed out one at a time,
// the longest (last query blocks) first: the causal work per item grows along the prompt, so
// fixed shares would leave a thread idle.
void prefill_rows(const PrefillKernels& k, const PrefillArgs& args, const void* cache,
                  const int64_t* slots, int64_t nk, char* kp, char* vp) {
  const int64_t kv_heads = args.kv_heads, d = args.d, blocks = args.blocks;
  const int64_t block_bytes = kPfKeys * d * k.elem_bytes;
  at::parallel_for(0, kv_heads * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it)
      k.pack(cache, slots, nk, kv_heads, d, it / blocks, it % blocks, kp + it * block_bytes,
             vp + it * block_bytes);
  });
  const int64_t nqb = (args.q_len + kPfQueries - 1) / kPfQueries, items = nqb * kv_heads;
  const int64_t rows = kPfQueries * (args.heads / kv_heads);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> ws(prefill_ws_floats(rows, d));
    for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1))
      k.item(args, it % kv_heads, nqb - 1 - it / kv_heads, ws.data());
  });
}

bool prefill_attention_supported() { return active().prefill_bf16.item != nullptr; }

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& slots, int64_t start, double scale) {
  const Kernels& k = active();
  TORCH_CHECK(k.prefill_bf16.item != nullptr, "prefill_attention: the ", k.name,
              " level has no prefill attention (it needs AVX2 or better)");
  const bool f32 = q.scalar_type() == at::kFloat;
  const PrefillKernels& path = f32 ? k.prefill_f32 : k.prefill_bf16;
  TORCH_CHECK(q.device().is_cpu() && (f32 || q.scalar_type() == at::kBFloat16) &&
                  q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "prefill_attention: q must be a bfloat16 or float32 [q_len, heads, head_dim] CPU "
              "tensor, heads contiguous");
  const int64_t q_len = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(d % 64 == 0, "prefill_attention: head_dim ", d, " must be a multiple of 64");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous() && kv_cache.size(1) == 2 &&
                  kv_cache.size(3) == d && kv_cache.scalar_type() == q.scalar_type(),
              "prefill_attention: kv_cache must be a contiguous [slots, 2, kv_heads, head_dim] "
              "tensor of q's dtype");
  const int64_t kv_heads = kv_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "prefill_attention: heads (", heads,
              ") must be a multiple of kv_heads (", kv_heads, ")");
  TORCH_CHECK(start >= 0, "prefill_attention: start must be >= 0, got ", start);
  const int64_t nk = start + q_len;
  TORCH_CHECK(slots.dim() == 1 && slots.is_contiguous() && slots.scalar_type() == at::kLong &&
                  slots.numel() == nk,
              "prefill_attention: slots must be a contiguous int64 [start + q_len] = [", nk,
              "] tensor, got ", slots.numel(), " slots");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t num_slots = kv_cache.size(0);
  for (int64_t j = 0; j < nk; ++j)
    TORCH_CHECK(sl[j] >= 0 && sl[j] < num_slots, "prefill_attention: slot ", sl[j],
                " out of range [0, ", num_slots, ")");
  auto out = at::empty({q_len, heads * d}, q.options());
  if (q_len == 0) return out;
  const int64_t blocks = (nk + kPfKeys - 1) / kPfKeys;
  const int64_t bytes = kv_heads * blocks * kPfKeys * d * path.elem_bytes;
  auto kp = at::empty({bytes}, q.options().dtype(at::kByte));
  auto vp = at::empty({bytes}, q.options().dtype(at::kByte));
  const PrefillArgs args{q.data_ptr(), q.stride(0), kp.data_ptr(), vp.data_ptr(),
                         out.data_ptr(), q_len, start, heads, kv_heads, d, blocks, float(scale)};
  prefill_rows(path, args, kv_cache.data_ptr(), sl, nk, ptr<char>(kp), ptr<char>(vp));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("prefill_attention(Tensor q, Tensor kv_cache, Tensor slots, int start, float scale) "
        "-> Tensor");
  m.def("prefill_attention_supported() -> bool", &prefill_attention_supported);
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
}
