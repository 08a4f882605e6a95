// Paged decode attention: one new token per row against the context slots of that row, read
// in place from the paged KV cache (no gather, no padding). Scores and softmax in fp32.
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

// ---------------------------------------------------------------------------------------------
// Paged decode attention

// How many slots of its next row a thread fetches ahead (x 768 bytes for SmolLM2: 192 KB,
// well within a core's L2 next to the current row's working set).
constexpr int64_t kLookaheadSlots = 256;

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

// Slots to fetch into cache while a (row, KV head) is computed: `count` slots of the row
// that comes next, and how many leading slots of this row an earlier lookahead fetched.
struct Lookahead {
  const int64_t* slots = nullptr;
  int64_t count = 0;
  int64_t covered = 0;
};

#if defined(__AVX512BF16__)

// Asks for one whole slot (every KV head's K and V: `slot_size` elements of 2 bytes) in L2.
inline void prefetch_slot(const bf16_bits* slot, int64_t slot_size) {
  const char* p = reinterpret_cast<const char*>(slot);
  for (int64_t b = 0; b < slot_size * 2; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// Sums of 16 vectors: lane j of the result is the sum of the 16 lanes of v[j]. A transpose-
// and-add tree (45 shuffles and adds) instead of 16 horizontal reductions (~8 dependent ops
// each); the order of the additions is fixed.
inline __m512 sum16x16(__m512* v) {
  __m512 u[8], w[4], z[2];
  for (int i = 0; i < 8; ++i)  // lane L: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of its 4 floats
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // lane L: the sums of keys 4i .. 4i + 3 over lane L
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // lanes: keys 8i..+3 (L0+L1, L2+L3), keys 8i+4..+7 (same)
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88),
                       _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
}

// bf16 cache and queries, head_dim = 16 * NV (NV in 2, 4, 8, 16). Scores: each key against a
// query head is d / 32 AVX512-BF16 dot products (exact products, fp32 sums) and 16 keys'
// partial sums are reduced together; softmax in fp32; P.V in fp32 with the output of up to
// 16 / NV heads in registers. The same numbers for a row whatever the other rows are.
template <int NV>
void attend_bf16(const bf16_bits* q, int64_t q_head_stride, const bf16_bits* cache,
                 const int64_t* slots, int64_t len, int64_t kv_head, int64_t kv_heads,
                 int64_t rep, float scale, bf16_bits* out, float* mass, std::vector<float>& sc,
                 std::vector<float>& acc, const Lookahead& ahead) {
  constexpr int64_t d = 16 * NV, nz = d / 32;  // nz: 32-wide bf16 vectors per head
  constexpr int64_t heads_per_group = NV >= 16 ? 1 : 16 / NV;
  const int64_t slot_size = 2 * kv_heads * d;
  const int64_t padded = (len + 15) / 16 * 16;
  sc.resize(rep * padded);
  acc.resize(rep * d);
  float mx[kMaxRep], sum[kMaxRep];
  for (int64_t h = 0; h < rep; ++h) {
    __m512bh qz[nz];
    for (int64_t z = 0; z < nz; ++z)
      qz[z] = (__m512bh)_mm512_loadu_si512(q + h * q_head_stride + 32 * z);
    float* s = sc.data() + h * padded;
    for (int64_t j0 = 0; j0 < len; j0 += 16) {
      __m512 v[16];
      const int64_t n = std::min<int64_t>(16, len - j0);
      if (h == 0) {
        // A row's slots are scattered blocks, which the hardware prefetcher does not follow:
        // while a KV head's first scores are computed, fetch whole slots (every head's K and
        // V) 16 to 32 keys ahead, past those the lookahead already fetched; the passes after
        // it over this row then read from cache. The next row's share is spread over the
        // score passes of every query head, below.
        for (int64_t j = std::max(j0 + 16, ahead.covered); j < std::min(len, j0 + 32); ++j)
          prefetch_slot(cache + slots[j] * slot_size, slot_size);
      }
      {
        const int64_t chunks = rep * padded / 16, c = h * padded / 16 + j0 / 16;
        for (int64_t j = c * ahead.count / chunks; j < (c + 1) * ahead.count / chunks; ++j)
          prefetch_slot(cache + ahead.slots[j] * slot_size, slot_size);
      }
      for (int64_t j = 0; j < 16; ++j) {
        v[j] = _mm512_setzero_ps();
        if (j < n) {
          const bf16_bits* k = cache + slots[j0 + j] * slot_size + kv_head * d;
          for (int64_t z = 0; z < nz; ++z)
            v[j] = _mm512_dpbf16_ps(v[j], (__m512bh)_mm512_loadu_si512(k + 32 * z), qz[z]);
        }
      }
      _mm512_storeu_ps(s + j0, _mm512_mul_ps(sum16x16(v), _mm512_set1_ps(scale)));
    }
    __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 lanes = len - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (len - j)) - 1);
      m = _mm512_mask_max_ps(m, lanes, m, _mm512_loadu_ps(s + j));
    }
    mx[h] = _mm512_reduce_max_ps(m);
    const __m512 mv = _mm512_set1_ps(mx[h]);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; j += 16) {
      const __mmask16 lanes = len - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (len - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(lanes, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv)));
      _mm512_storeu_ps(s + j, e);
      total = _mm512_add_ps(total, e);
    }
    sum[h] = _mm512_reduce_add_ps(total);
  }
  for (int64_t h0 = 0; h0 < rep; h0 += heads_per_group) {
    const int64_t hn = std::min<int64_t>(heads_per_group, rep - h0);
    __m512 a[heads_per_group][NV];
    for (int64_t h = 0; h < heads_per_group; ++h)
      for (int c = 0; c < NV; ++c) a[h][c] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const bf16_bits* vr = cache + slots[j] * slot_size + (kv_heads + kv_head) * d;
      __m512 vv[NV];
      for (int c = 0; c < NV; ++c) vv[c] = load16(vr + 16 * c);
      for (int64_t h = 0; h < heads_per_group; ++h) {
        if (h >= hn) break;
        const __m512 p = _mm512_set1_ps(sc[(h0 + h) * padded + j]);
        for (int c = 0; c < NV; ++c) a[h][c] = _mm512_fmadd_ps(p, vv[c], a[h][c]);
      }
    }
    for (int64_t h = 0; h < hn; ++h)
      for (int c = 0; c < NV; ++c) _mm512_storeu_ps(acc.data() + (h0 + h) * d + 16 * c, a[h][c]);
  }
  // finish_heads reads each head's probabilities at stride len
  if (mass != nullptr && padded != len)
    for (int64_t h = 1; h < rep; ++h)
      std::memmove(sc.data() + h * len, sc.data() + h * padded, len * sizeof(float));
  finish_heads<bf16_bits>(acc.data(), sc.data(), sum, len, d, rep, out, mass);
}
#endif

template <typename T>
void attend(const T* q, int64_t q_head_stride, const T* cache, const int64_t* slots, int64_t len,
            int64_t kv_head, int64_t kv_heads, int64_t d, int64_t rep, float scale, T* out,
            float* mass, std::vector<float>& qf, std::vector<float>& sc, std::vector<float>& acc,
            const Lookahead& ahead) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, bf16_bits>) {
    if (rep <= kMaxRep && (d == 32 || d == 64 || d == 128 || d == 256)) {
      switch (d) {
        case 32: attend_bf16<2>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                scale, out, mass, sc, acc, ahead); return;
        case 64: attend_bf16<4>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                scale, out, mass, sc, acc, ahead); return;
        case 128: attend_bf16<8>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                 scale, out, mass, sc, acc, ahead); return;
        default: attend_bf16<16>(q, q_head_stride, cache, slots, len, kv_head, kv_heads, rep,
                                 scale, out, mass, sc, acc, ahead); return;
      }
    }
  }
#endif
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
      std::vector<float> qf, sc, acc;
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
        for (int64_t g = g0; g < g1; ++g) {
          // the next row's slots, a share per KV head
          const Lookahead la{ahead ? sl + following * ctx + g * count / kv_heads : nullptr,
                             (g + 1) * count / kv_heads - g * count / kv_heads, covered};
          attend<T>(qp + r * q.stride(0) + g * rep * d, d, cache, sl + r * ctx, len[r], g,
                    kv_heads, d, rep, float(scale), op + r * heads * d + g * rep * d,
                    mass_ptr ? mass_ptr + r * ctx : nullptr, qf, sc, acc, la);
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
