// Paged decode attention: one new token per row against the context slots of that row, read
// in place from the paged KV cache (no gather, no padding). Scores and softmax in fp32
// (decode_attention_math.h: the math of one row and KV head, per ISA level).
//   paged_decode_attention(q, kv_cache, slots, lengths, scale, mass) -> out
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using namespace entropic_kernels;

// How many slots of its next row a thread fetches ahead (x 768 bytes for SmolLM2: 192 KB,
// well within a core's L2 next to the current row's working set).
constexpr int64_t kLookaheadSlots = 256;

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
    const auto attend = active().typed<T>().attend;
    const T* qp = ptr<T>(q);
    const T* cache = ptr<T>(kv_cache);
    T* op = ptr<T>(out);
    // Work items are rows, all KV heads of a row in turn: one pass brings the row's slots
    // into cache, whole (with `mass`, a row's heads add into one mass row anyway). With few
    // rows, (row, KV head) pairs instead, so that every thread has work. Rows differ in
    // length: items are handed out one at a time (an atomic counter), so that no thread
    // waits on another's share of long rows.
    const int64_t threads = at::get_num_threads();
    const int64_t per_row = (mass_ptr == nullptr && n < 4 * threads) ? kv_heads : 1;
    const int64_t items = n * per_row;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min(items, threads), 1, [&](int64_t, int64_t) {
      std::vector<float> buf;  // the scratch of one (row, KV head), grown as rows need
      // With whole rows as items, a thread claims its next row before it starts the current
      // one and fetches that row's first kLookaheadSlots slots while it computes: a row's
      // first pass over its scattered blocks would otherwise wait on memory.
      int64_t covered = 0;
      for (int64_t item = next.fetch_add(1); item < items;) {
        const int64_t following = per_row == 1 ? next.fetch_add(1) : items;
        const int64_t r = item / per_row;
        const int64_t g0 = per_row == 1 ? 0 : item % per_row;
        const int64_t g1 = per_row == 1 ? kv_heads : g0 + 1;
        const bool ahead = following < items;  // never with (row, KV head) items
        const int64_t count = ahead ? std::min(len[following], kLookaheadSlots) : 0;
        const int64_t padded = (len[r] + 15) / 16 * 16;
        buf.resize(std::max<int64_t>(buf.size(), rep * (2 * d + padded + 2)));
        const AttendScratch ws{buf.data(), buf.data() + rep * d, buf.data() + rep * (d + padded),
                               buf.data() + rep * (2 * d + padded)};
        for (int64_t g = g0; g < g1; ++g) {
          // the next row's slots, a share per KV head
          const Lookahead la{ahead ? sl + following * ctx + g * count / kv_heads : nullptr,
                             (g + 1) * count / kv_heads - g * count / kv_heads, covered};
          attend(qp + r * q.stride(0) + g * rep * d, d, cache, sl + r * ctx, len[r], g, kv_heads,
                 d, rep, float(scale), op + r * heads * d + g * rep * d,
                 mass_ptr ? mass_ptr + r * ctx : nullptr, ws, la);
        }
        covered = count;
        item = per_row == 1 ? following : next.fetch_add(1);
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor slots, Tensor? lengths, "
        "float scale, Tensor(a!)? mass) -> Tensor");
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
