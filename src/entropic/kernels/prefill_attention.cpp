// Causal prefill attention over the paged KV cache, flash style (prefill_attention_math.h
// has the math of each ISA level). A chunk of q_len new tokens at positions start ..
// start + q_len - 1 of one sequence attends to the keys at positions 0 .. its own, read from
// the paged cache through `slots` (rope_kv_ has already written the chunk's own).
//   prefill_attention(q, kv_cache, slots, start, scale) -> out   (bfloat16 or float32)
//   prefill_attention_sparse(q, kv_cache, slots, start, scale, delta, sink, recent)
//       -> (out, pairs)   the same over the blocks of 64 keys each work item selects (below)
//   prefill_attention_supported() -> bool      whether the level in use has it (AVX2 or better)
//
// Block-sparse prefill: each work item (16 query positions x one KV head) attends a block
// of 64 keys only where the block's score clears -delta, or where it is one of the first
// `sink` blocks or one of the `recent` blocks ending with the item's first position's own.
// A block's score is the largest over the item's rows (query positions x the KV head's
// query heads) of bound - max bound, where a row's bound for a block is scale * sum_i
// max(q_i min_i, q_i max_i) over the elementwise minimum and maximum of the block's keys
// (an upper bound on every key's score in the block) and the max runs over the blocks the
// row may attend: a block is left out only where every row's best key there scores at
// least delta below that row's best bound. A NaN score keeps its block. `pairs`: the
// (query position, key) pairs attended, summed over KV heads.
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
struct Sparsity {
  float delta;
  int64_t sink, recent;
};

// The elementwise center (max + min) / 2 and radius (max - min) / 2 of the keys of block b
// (positions b * 64 .. below nk) of KV head g: box[0 .. d) and box[d .. 2d).
template <typename T>
void key_box(const T* cache, const int64_t* slots, int64_t nk, int64_t kv_heads, int64_t d,
             int64_t g, int64_t b, float* box) {
  float* lo = box;
  float* hi = box + d;
  std::fill(lo, lo + d, std::numeric_limits<float>::infinity());
  std::fill(hi, hi + d, -std::numeric_limits<float>::infinity());
  for (int64_t j = b * kPfKeys; j < std::min(nk, (b + 1) * kPfKeys); ++j) {
    const T* key = cache + (slots[j] * 2 * kv_heads + g) * d;
    for (int64_t i = 0; i < d; ++i) {
      const float v = load(key + i);
      lo[i] = std::min(lo[i], v);
      hi[i] = std::max(hi[i], v);
      if (std::isnan(v)) lo[i] = hi[i] = v;  // (min and max drop NaNs; the box keeps them)
    }
  }
  for (int64_t i = 0; i < d; ++i) {
    const float c = 0.5f * (hi[i] + lo[i]), r = 0.5f * (hi[i] - lo[i]);
    lo[i] = c;
    hi[i] = r;
  }
}

// Which blocks work item (g, qb) attends (keep[b], b below the item's last block + 1), and
// the (query position, key) pairs that makes. ws: 2 * d + 2 * blocks floats.
template <typename T>
int64_t select_blocks(const PrefillArgs& a, const Sparsity& sp, const float* boxes, int64_t g,
                      int64_t qb, float* ws, uint8_t* keep) {
  const int64_t rep = a.heads / a.kv_heads, d = a.d;
  const int64_t i0 = qb * kPfQueries, nq = std::min(kPfQueries, a.q_len - i0);
  const int64_t nblk = (a.start + i0 + nq - 1) / kPfKeys + 1;
  float* qf = ws;
  float* qa = qf + d;  // |q|
  float* bound = qa + d;
  float* score = bound + a.blocks;
  std::fill(score, score + nblk, -std::numeric_limits<float>::infinity());
  const T* q = static_cast<const T*>(a.q);
  for (int64_t r = 0; r < nq * rep; ++r) {
    const int64_t i = i0 + r / rep, h = g * rep + r % rep;
    const int64_t nb = (a.start + i) / kPfKeys + 1;  // the blocks this row may attend
    for (int64_t k = 0; k < d; ++k) {
      qf[k] = load(q + i * a.q_stride + h * d + k);
      qa[k] = std::fabs(qf[k]);
    }
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t b = 0; b < nb; ++b) {
      const float* c = boxes + (g * a.blocks + b) * 2 * d;
      const float* rad = c + d;
      float acc[8] = {};  // 8 independent sums (d is a multiple of 64): the compiler's lanes
      for (int64_t k = 0; k < d; k += 8)
        for (int l = 0; l < 8; ++l) acc[l] += qf[k + l] * c[k + l] + qa[k + l] * rad[k + l];
      const float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                      ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      bound[b] = s * a.scale;
      best = std::isnan(bound[b]) || std::isnan(best) ? std::numeric_limits<float>::quiet_NaN()
                                                      : std::max(best, bound[b]);
    }
    for (int64_t b = 0; b < nb; ++b) {
      const float v = bound[b] - best;
      if (std::isnan(v) || score[b] < v) score[b] = v;
    }
  }
  const int64_t first_recent = (a.start + i0) / kPfKeys - (sp.recent - 1);
  int64_t pairs = 0;
  for (int64_t b = 0; b < nblk; ++b) {
    keep[b] = b < sp.sink || b >= first_recent || !(score[b] < -sp.delta);
    if (!keep[b]) continue;
    for (int64_t i = i0; i < i0 + nq; ++i)  // the keys of block b up to position start + i
      pairs += std::clamp<int64_t>(a.start + i - b * kPfKeys + 1, 0, kPfKeys);
  }
  return pairs;
}

int64_t prefill_rows(const PrefillKernels& k, const PrefillArgs& args, const void* cache,
                     const int64_t* slots, int64_t nk, char* kp, char* vp, bool f32,
                     const Sparsity* sparse) {
  const int64_t kv_heads = args.kv_heads, d = args.d, blocks = args.blocks;
  const int64_t block_bytes = kPfKeys * d * k.elem_bytes;
  std::vector<float> boxes(sparse ? kv_heads * blocks * 2 * d : 0);
  at::parallel_for(0, kv_heads * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      k.pack(cache, slots, nk, kv_heads, d, it / blocks, it % blocks, kp + it * block_bytes,
             vp + it * block_bytes);
      if (sparse == nullptr) continue;
      float* box = boxes.data() + it * 2 * d;
      if (f32)
        key_box(static_cast<const float*>(cache), slots, nk, kv_heads, d, it / blocks,
                it % blocks, box);
      else
        key_box(static_cast<const bf16_bits*>(cache), slots, nk, kv_heads, d, it / blocks,
                it % blocks, box);
    }
  });
  const int64_t nqb = (args.q_len + kPfQueries - 1) / kPfQueries, items = nqb * kv_heads;
  const int64_t rows = kPfQueries * (args.heads / kv_heads);
  std::atomic<int64_t> next{0}, pairs{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> ws(prefill_ws_floats(rows, d));
    std::vector<float> sel_ws(sparse ? 2 * d + 2 * blocks : 0);
    std::vector<uint8_t> keep(sparse ? blocks : 0);
    PrefillArgs a = args;
    int64_t mine = 0;
    for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1)) {
      const int64_t g = it % kv_heads, qb = nqb - 1 - it / kv_heads;
      if (sparse != nullptr) {
        mine += f32 ? select_blocks<float>(a, *sparse, boxes.data(), g, qb, sel_ws.data(),
                                           keep.data())
                    : select_blocks<bf16_bits>(a, *sparse, boxes.data(), g, qb, sel_ws.data(),
                                               keep.data());
        a.keep = keep.data();
      }
      k.item(a, g, qb, ws.data());
    }
    pairs += mine;
  });
  return pairs.load();
}

bool prefill_attention_supported() { return active().prefill_bf16.item != nullptr; }

std::tuple<at::Tensor, int64_t> prefill_attention_impl(const at::Tensor& q,
                                                       const at::Tensor& kv_cache,
                                                       const at::Tensor& slots, int64_t start,
                                                       double scale, const Sparsity* sparse) {
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
  if (q_len == 0) return {out, 0};
  const int64_t blocks = (nk + kPfKeys - 1) / kPfKeys;
  const int64_t bytes = kv_heads * blocks * kPfKeys * d * path.elem_bytes;
  auto kp = at::empty({bytes}, q.options().dtype(at::kByte));
  auto vp = at::empty({bytes}, q.options().dtype(at::kByte));
  const PrefillArgs args{q.data_ptr(), q.stride(0), kp.data_ptr(), vp.data_ptr(),
                         out.data_ptr(), q_len, start, heads, kv_heads, d, blocks, float(scale),
                         nullptr};
  const int64_t pairs = prefill_rows(path, args, kv_cache.data_ptr(), sl, nk, ptr<char>(kp),
                                     ptr<char>(vp), f32, sparse);
  return {out, pairs};
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& slots, int64_t start, double scale) {
  return std::get<0>(prefill_attention_impl(q, kv_cache, slots, start, scale, nullptr));
}

std::tuple<at::Tensor, int64_t> prefill_attention_sparse(const at::Tensor& q,
                                                         const at::Tensor& kv_cache,
                                                         const at::Tensor& slots, int64_t start,
                                                         double scale, double delta,
                                                         int64_t sink, int64_t recent) {
  TORCH_CHECK(delta >= 0, "prefill_attention_sparse: delta must be >= 0, got ", delta);
  TORCH_CHECK(sink >= 0 && recent >= 1, "prefill_attention_sparse: sink must be >= 0 and "
              "recent >= 1, got sink ", sink, " and recent ", recent);
  const Sparsity sp{float(delta), sink, recent};
  return prefill_attention_impl(q, kv_cache, slots, start, scale, &sp);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("prefill_attention(Tensor q, Tensor kv_cache, Tensor slots, int start, float scale) "
        "-> Tensor");
  m.def("prefill_attention_sparse(Tensor q, Tensor kv_cache, Tensor slots, int start, "
        "float scale, float delta, int sink, int recent) -> (Tensor, int)");
  m.def("prefill_attention_supported() -> bool", &prefill_attention_supported);
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_sparse", &prefill_attention_sparse);
}
