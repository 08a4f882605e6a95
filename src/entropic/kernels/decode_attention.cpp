// Paged decode attention: one new token per row against the context slots of that row, read
// in place from the paged KV cache (no gather, no padding). Scores and softmax in fp32
// (decode_attention_math.h: the math of one row and KV head, per ISA level).
//   paged_decode_attention(q, kv_cache, slots, lengths, scale, mass, keep, block_size,
//                          bounds_offset, sink, recent) -> out
// With `keep`, a row r whose context spans more than keep[r] blocks attends only keep[r] of
// them, chosen here for this layer and each KV head (query-aware selection): its first
// `sink` and last `recent` blocks, and the others of highest score, a block's score being
// max over the KV head's query heads h of bound_h(block), an upper bound on q_h.k over the
// block's keys (the bound rows of block b sit at cache row bounds_offset + b). Skipped blocks are neither read nor
// computed, beyond their bound row.
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"
#include "ops.h"

namespace entropic_ops {

using namespace entropic_kernels;

// How many slots of its next row a thread fetches ahead (x 768 bytes for SmolLM2: 192 KB,
// well within a core's L2 next to the current row's working set).
constexpr int64_t kLookaheadSlots = 256;

// A row of more than kChunkKeys context slots is computed in chunk_count(len) nearly equal
// chunks, each KV head's chunks then merged in order (merge_chunks). The split depends on
// the row's length alone, never on the batch or the threads, so a row's numbers stay the
// same in any batch; what it buys is work for every thread when there are few rows (one
// row has only kv_heads (row, KV head) items: 3 for SmolLM2, on 2 threads).
constexpr int64_t kChunkKeys = 512;
inline int64_t chunk_count(int64_t len) { return (len + kChunkKeys - 1) / kChunkKeys; }

// out (rep heads of d) from `chunks` partials of rep * (d + 2) floats each (finish_heads:
// each head's output scaled by its chunk's exp(-max), that max, and its sum of exps):
// out = sum_c acc_c exp(max_c - M) / sum_c sum_c exp(max_c - M), M the largest max.
template <typename T>
void merge_chunks(const float* part, int64_t chunks, int64_t rep, int64_t d, T* out) {
  const int64_t part_size = rep * (d + 2);
  std::vector<float> acc(d);
  for (int64_t h = 0; h < rep; ++h) {
    const float* ph = part + h * (d + 2);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < chunks; ++c) m = std::max(m, ph[c * part_size + d]);
    float total = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c = 0; c < chunks; ++c) {
      const float* pc = ph + c * part_size;
      const float w = std::exp(pc[d] - m);
      total += pc[d + 1] * w;
      for (int64_t i = 0; i < d; ++i) acc[i] += pc[i] * w;
    }
    const float inv = 1.f / total;
    T* o = out + h * d;
    for (int64_t i = 0; i < d; ++i) store(o + i, round_to(acc[i] * inv, o));
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                                  const at::Tensor& slots, const std::optional<at::Tensor>& lengths,
                                  double scale, const std::optional<at::Tensor>& mass,
                                  const std::optional<at::Tensor>& keep, int64_t block_size,
                                  int64_t bounds_offset, int64_t sink, int64_t recent) {
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
  const int64_t* keep_ptr = nullptr;
  if (keep.has_value()) {
    TORCH_CHECK(keep->scalar_type() == at::kLong && keep->numel() == n && keep->is_contiguous(),
                "paged_decode_attention: keep must be a contiguous int64 [rows] tensor");
    TORCH_CHECK(mass_ptr == nullptr, "paged_decode_attention: keep and mass exclude each other");
    TORCH_CHECK(block_size >= 1 && sink >= 0 && recent >= 1,
                "paged_decode_attention: need block_size >= 1, sink >= 0, recent >= 1");
    keep_ptr = keep->data_ptr<int64_t>();
    for (int64_t r = 0; r < n; ++r) {
      TORCH_CHECK(keep_ptr[r] >= 1, "paged_decode_attention: keep of row ", r, " must be >= 1");
      const int64_t nb = (len[r] + block_size - 1) / block_size;
      if (keep_ptr[r] >= nb) continue;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t s0 = sl[r * ctx + b * block_size];
        TORCH_CHECK(s0 % block_size == 0 && bounds_offset + s0 / block_size < num_slots,
                    "paged_decode_attention: row ", r, " block ", b,
                    " does not start a block, or has no bound row");
      }
    }
  }
  auto out = at::empty({n, heads * d}, q.options());
  const int64_t rep = heads / kv_heads;
  dispatch(q, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const auto attend = active().typed<T>().attend;
    const auto key_bounds = active().typed<T>().key_bounds;
    const T* qp = ptr<T>(q);
    const T* cache = ptr<T>(kv_cache);
    T* op = ptr<T>(out);
    const int64_t threads = at::get_num_threads();
    // Query-aware selection first, for each (row, KV head) whose row attends fewer blocks
    // than it has: the slots it attends, in block order. Such a row is then computed as a
    // row of picked.size() slots, chunked like any other.
    std::vector<std::vector<int64_t>> picked(keep_ptr != nullptr ? n * kv_heads : 0);
    std::vector<int64_t> eff(len);  // the slots each row attends
    if (keep_ptr != nullptr) {
      std::vector<int64_t> todo;  // the selecting rows
      for (int64_t r = 0; r < n; ++r)
        if (keep_ptr[r] < (len[r] + block_size - 1) / block_size) todo.push_back(r);
      const int64_t sel_items = int64_t(todo.size()) * kv_heads;
      std::atomic<int64_t> next{0};
      at::parallel_for(0, std::min(sel_items, threads), 1, [&](int64_t, int64_t) {
        std::vector<float> qf(rep * d), score;
        std::vector<int64_t> rows, chosen;
        for (int64_t item = next.fetch_add(1); item < sel_items; item = next.fetch_add(1)) {
          const int64_t r = todo[item / kv_heads], g = item % kv_heads;
          const int64_t nb = (len[r] + block_size - 1) / block_size;
          const T* qg = qp + r * q.stride(0) + g * rep * d;
          // candidates: every block but the first `sink` and the last `recent`
          const int64_t lo = std::min(sink, nb), hi = std::max(lo, nb - recent);
          const int64_t want = std::max<int64_t>(0, keep_ptr[r] - lo - (nb - hi));
          const int64_t m = hi - lo;
          rows.resize(m);
          score.resize((rep + 1) * m);
          for (int64_t b = lo; b < hi; ++b)
            rows[b - lo] = bounds_offset + sl[r * ctx + b * block_size] / block_size;
          key_bounds(qg, d, cache, rows.data(), m, g, kv_heads, d, rep, qf.data(),
                     score.data() + m);
          // a block's score: its largest bound over the query heads (a head whose bound is
          // high everywhere has peaked attention, where the choice matters most)
          for (int64_t b = 0; b < m; ++b) {
            float best = score[m + b];
            for (int64_t h = 1; h < rep; ++h) best = std::max(best, score[(h + 1) * m + b]);
            score[b] = best;
          }
          chosen.resize(hi - lo);
          for (int64_t b = 0; b < hi - lo; ++b) chosen[b] = b;
          const auto better = [&](int64_t a, int64_t b) {  // higher bound, then earlier
            return score[a] > score[b] || (score[a] == score[b] && a < b);
          };
          if (want < hi - lo)
            std::nth_element(chosen.begin(), chosen.begin() + want, chosen.end(), better);
          chosen.resize(std::min(want, hi - lo));
          std::sort(chosen.begin(), chosen.end());
          std::vector<int64_t>& out_slots = picked[r * kv_heads + g];
          out_slots.reserve((lo + chosen.size() + nb - hi) * block_size);
          const auto take = [&](int64_t b) {
            const int64_t* row = sl + r * ctx;
            out_slots.insert(out_slots.end(), row + b * block_size,
                             row + std::min(len[r], (b + 1) * block_size));
          };
          for (int64_t b = 0; b < lo; ++b) take(b);
          for (int64_t c : chosen) take(lo + c);
          for (int64_t b = hi; b < nb; ++b) take(b);
        }
      });
      // the same count for every KV head: whole blocks but the last, which is always kept
      for (int64_t r : todo) eff[r] = int64_t(picked[r * kv_heads].size());
    }
    // the slots (row r, KV head g) attends
    const auto slots_of = [&](int64_t r, int64_t g) {
      return picked.empty() || picked[r * kv_heads + g].empty() ? sl + r * ctx
                                                                : picked[r * kv_heads + g].data();
    };
    // Work items are rows, all KV heads of a row in turn: one pass brings the row's slots
    // into cache, whole (with `mass`, a row's heads add into one mass row anyway). With few
    // rows, (row, KV head, chunk) triples instead, so that every thread has work. Rows differ
    // in length: items are handed out one at a time (an atomic counter), so that no thread
    // waits on another's share of long rows.
    const bool few = mass_ptr == nullptr && n < 4 * threads;
    const int64_t part_size = rep * (d + 2);  // one chunk's partials (finish_heads)
    // each row's chunks (1: whole), where its KV heads' partials start, its first item
    std::vector<int64_t> chunks(n, 1), part_base(n + 1, 0), first(n + 1, 0);
    for (int64_t r = 0; r < n; ++r) {
      if (mass_ptr == nullptr) chunks[r] = chunk_count(eff[r]);
      part_base[r + 1] = part_base[r] + (chunks[r] > 1 ? kv_heads * chunks[r] * part_size : 0);
      first[r + 1] = first[r] + (few ? kv_heads * chunks[r] : 1);
    }
    const int64_t items = first[n];
    std::vector<float> partials(few ? part_base[n] : 0);
    std::atomic<int64_t> next{0};
    at::parallel_for(0, std::min(items, threads), 1, [&](int64_t, int64_t) {
      std::vector<float> buf;  // the scratch of one (row, KV head), grown as rows need
      std::vector<float> own;  // a whole row's partials, one KV head at a time
      // With whole rows as items, a thread claims its next row before it starts the current
      // one and fetches that row's first kLookaheadSlots slots while it computes: a row's
      // first pass over its scattered blocks would otherwise wait on memory.
      int64_t covered = 0;
      int64_t r = 0;
      for (int64_t item = next.fetch_add(1); item < items;) {
        const int64_t following = few ? items : next.fetch_add(1);
        while (first[r + 1] <= item) ++r;  // a thread's items come in increasing order
        const int64_t local = item - first[r], nc = chunks[r], length = eff[r];
        const int64_t g0 = few ? local / nc : 0, g1 = few ? g0 + 1 : kv_heads;
        const int64_t c0 = few ? local % nc : 0, c1 = few ? c0 + 1 : nc;
        const bool ahead = following < items;  // never with (row, KV head) items
        const int64_t count = ahead ? std::min(len[following], kLookaheadSlots) : 0;
        const int64_t padded = (length + 15) / 16 * 16;
        buf.resize(std::max<int64_t>(buf.size(), rep * (2 * d + padded + 2)));
        AttendScratch ws{buf.data(), buf.data() + rep * d, buf.data() + rep * (d + padded),
                         buf.data() + rep * (2 * d + padded)};
        if (!few && nc > 1) own.resize(std::max<int64_t>(own.size(), nc * part_size));
        for (int64_t g = g0; g < g1; ++g) {
          const T* qg = qp + r * q.stride(0) + g * rep * d;
          T* og = op + r * heads * d + g * rep * d;
          const int64_t* rs = slots_of(r, g);
          // the next row's slots, a share per KV head (fetched during the head's last chunk)
          const Lookahead la{ahead ? sl + following * ctx + g * count / kv_heads : nullptr,
                             (g + 1) * count / kv_heads - g * count / kv_heads,
                             rs == sl + r * ctx ? covered : 0};
          if (nc == 1) {
            attend(qg, d, cache, rs, length, g, kv_heads, d, rep, float(scale), og,
                   mass_ptr ? mass_ptr + r * ctx : nullptr, ws, la);
            continue;
          }
          float* part = few ? partials.data() + part_base[r] + g * nc * part_size : own.data();
          for (int64_t c = c0; c < c1; ++c) {
            const int64_t j0 = c * length / nc, j1 = (c + 1) * length / nc;
            ws.partial = part + c * part_size;
            attend(qg, d, cache, rs + j0, j1 - j0, g, kv_heads, d, rep, float(scale), og,
                   nullptr, ws,
                   Lookahead{c == nc - 1 ? la.slots : nullptr, c == nc - 1 ? la.count : 0,
                             c == 0 ? la.covered : 0});
          }
          ws.partial = nullptr;
          if (!few) merge_chunks(part, nc, rep, d, og);
        }
        covered = count;
        item = few ? next.fetch_add(1) : following;
      }
    });
    // few rows: each split (row, KV head)'s chunks came from any thread; merged here
    if (few)
      for (int64_t r = 0; r < n; ++r)
        for (int64_t g = 0; chunks[r] > 1 && g < kv_heads; ++g)
          merge_chunks(partials.data() + part_base[r] + g * chunks[r] * part_size, chunks[r],
                       rep, d, op + r * heads * d + g * rep * d);
  });
  return out;
}

}  // namespace entropic_ops

TORCH_LIBRARY_FRAGMENT(entropic, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor slots, Tensor? lengths, "
        "float scale, Tensor(a!)? mass, Tensor? keep=None, int block_size=16, "
        "int bounds_offset=0, int sink=0, int recent=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(entropic, CPU, m) {
  m.impl("paged_decode_attention", &entropic_ops::paged_decode_attention);
}
