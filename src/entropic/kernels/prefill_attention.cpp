// Causal prefill attention over the paged KV cache (AVX512-BF16).
//   prefill_attention(q, kv_cache, slots, start, scale) -> out
//       a chunk of new tokens against its context (cached prefix and itself), read from the
//       cache through its slots
//   prefill_attention_supported() -> bool      whether this build has it (avx512_bf16)
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
// Causal prefill attention, flash style (AVX512-BF16). A chunk of q_len new tokens at positions
// start .. start + q_len - 1 of one sequence attends to the keys at positions 0 .. its own,
// read from the paged cache through `slots` (rope_kv_ has already written the chunk's own).
// Q.K and P.V are bf16 dot products summed in fp32 (a product of two bf16 numbers is exact in
// fp32); scores, the running max, the softmax sums and the output accumulators are fp32; the
// probabilities are rounded to bf16 for P.V, and the sums add the rounded values, so the
// weights that meet V sum exactly to the divisor.
// Each KV head's keys and values are first packed into the dot-product layout, in blocks of
// 64 keys: keys [dim pair][64 keys][2 dims], values [key pair][dim][2 keys]. Key blocks are
// aligned to position 0, so a row's sum runs over the same blocks in the same order however
// the prompt was split into chunks.

constexpr int64_t kPfKeys = 64;     // keys per block: four vectors of 16 scores
constexpr int64_t kPfQueries = 16;  // query positions per work item
constexpr int kPfRowTile = 4;       // rows (query position x head) per register tile

#if defined(__AVX512BF16__)

struct PrefillArgs {
  const bf16_bits* q;  // q[i][h][dim] at q + i * q_stride + h * d + dim
  int64_t q_stride;
  const bf16_bits* kp;  // packed keys [kv_heads][blocks][d / 2][64][2]
  const bf16_bits* vp;  // packed values [kv_heads][blocks][32][d][2]
  bf16_bits* out;       // [q_len][heads * d]
  int64_t q_len, start, heads, kv_heads, d, blocks;
  float scale;
};

void pf_pack_block(const bf16_bits* cache, const int64_t* slots, int64_t nk, int64_t kv_heads,
                   int64_t d, int64_t g, int64_t b, bf16_bits* kp, bf16_bits* vp) {
  const int64_t slot_size = 2 * kv_heads * d, pairs = d / 2;
  uint32_t* kw = reinterpret_cast<uint32_t*>(kp);
  for (int64_t j = 0; j < kPfKeys; ++j) {
    const int64_t key = b * kPfKeys + j;
    if (key >= nk) {
      for (int64_t p = 0; p < pairs; ++p) kw[p * kPfKeys + j] = 0;
      for (int64_t i = 0; i < d; ++i) vp[((j / 2) * d + i) * 2 + (j & 1)] = 0;
      continue;
    }
    const bf16_bits* slot = cache + slots[key] * slot_size;
    const uint32_t* kr = reinterpret_cast<const uint32_t*>(slot + g * d);
    for (int64_t p = 0; p < pairs; ++p) kw[p * kPfKeys + j] = kr[p];
    const bf16_bits* vr = slot + (kv_heads + g) * d;
    for (int64_t i = 0; i < d; ++i) vp[((j / 2) * d + i) * 2 + (j & 1)] = vr[i];
  }
}

// Scores of RT rows against one block of 64 keys: s[r][64] (unscaled).
template <int RT>
void pf_scores(const uint32_t* const* qw, const bf16_bits* kblk, int64_t pairs, float* s) {
  __m512 acc[RT][4];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh k[4];
    for (int c = 0; c < 4; ++c)
      k[c] = (__m512bh)_mm512_loadu_si512(kblk + (p * kPfKeys + 16 * c) * 2);
    for (int r = 0; r < RT; ++r) {
      const __m512bh qv = (__m512bh)_mm512_set1_epi32(int(qw[r][p]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qv, k[c]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s + r * kPfKeys + 16 * c, acc[r][c]);
}

// o[r] = alpha[r] * o[r] + P[r] . V for RT rows; P as bf16 key pairs pw[r][32].
template <int RT>
void pf_values(const uint32_t* pw, const bf16_bits* vblk, int64_t d, float* o,
               const float* alpha) {
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    __m512 acc[RT][4];
    for (int r = 0; r < RT; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int c = 0; c < 4; ++c)
        acc[r][c] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * d + c0 + 16 * c));
    }
    for (int64_t kp = 0; kp < kPfKeys / 2; ++kp) {
      __m512bh v[4];
      for (int c = 0; c < 4; ++c)
        v[c] = (__m512bh)_mm512_loadu_si512(vblk + (kp * d + c0 + 16 * c) * 2);
      for (int r = 0; r < RT; ++r) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(int(pw[r * (kPfKeys / 2) + kp]));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pv, v[c]);
      }
    }
    for (int r = 0; r < RT; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + r * d + c0 + 16 * c, acc[r][c]);
  }
}

template <typename F>
void pf_tiles(int64_t rows, F&& f) {
  for (int64_t r0 = 0; r0 < rows; r0 += kPfRowTile) {
    switch (std::min<int64_t>(kPfRowTile, rows - r0)) {
      case 4: f(std::integral_constant<int, 4>{}, r0); break;
      case 3: f(std::integral_constant<int, 3>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      default: f(std::integral_constant<int, 1>{}, r0); break;
    }
  }
}

// One work item: query positions [qb * 16, +16) with the heads of KV head g.
void pf_item(const PrefillArgs& a, int64_t g, int64_t qb, std::vector<float>& ws,
             std::vector<uint32_t>& pws) {
  const int64_t rep = a.heads / a.kv_heads, d = a.d, pairs = d / 2;
  const int64_t i0 = qb * kPfQueries, nq = std::min(kPfQueries, a.q_len - i0), rows = nq * rep;
  ws.assign(rows * (d + kPfKeys + 4), 0.f);
  float* o = ws.data();
  float* s = o + rows * d;
  float* mx = s + rows * kPfKeys;
  float* sum = mx + rows;
  float* alpha = sum + rows;
  pws.resize(rows * (kPfKeys / 2));
  std::vector<const uint32_t*> qw(rows);
  std::vector<int64_t> limit(rows);  // last key position each row may attend
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r / rep, h = g * rep + r % rep;
    qw[r] = reinterpret_cast<const uint32_t*>(a.q + i * a.q_stride + h * d);
    limit[r] = a.start + i;
    mx[r] = -std::numeric_limits<float>::infinity();
  }
  const int64_t nblk = (a.start + i0 + nq - 1) / kPfKeys + 1;
  const __m512 scale = _mm512_set1_ps(a.scale);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int64_t b = 0; b < nblk; ++b) {
    const bf16_bits* kblk = a.kp + (g * a.blocks + b) * pairs * kPfKeys * 2;
    const bf16_bits* vblk = a.vp + (g * a.blocks + b) * (kPfKeys / 2) * d * 2;
    pf_tiles(rows, [&](auto rt, int64_t r0) {
      pf_scores<decltype(rt)::value>(qw.data() + r0, kblk, pairs, s + r0 * kPfKeys);
    });
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t valid = std::min<int64_t>(kPfKeys, limit[r] - b * kPfKeys + 1);
      uint32_t* pr = pws.data() + r * (kPfKeys / 2);
      if (valid <= 0) {  // the whole block lies after this row's position
        alpha[r] = 1.f;
        std::memset(pr, 0, kPfKeys / 2 * sizeof(uint32_t));
        continue;
      }
      __m512 x[4];
      __mmask16 m[4];
      __m512 bm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int c = 0; c < 4; ++c) {
        m[c] = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(int(valid - 16 * c)));
        x[c] = _mm512_mul_ps(_mm512_loadu_ps(s + r * kPfKeys + 16 * c), scale);
        bm = _mm512_mask_max_ps(bm, m[c], bm, x[c]);
      }
      const float m_new = std::max(mx[r], _mm512_reduce_max_ps(bm));
      alpha[r] = std::exp(mx[r] - m_new);  // exp(-inf) = 0 on the first block
      mx[r] = m_new;
      __m512 total = _mm512_setzero_ps();
      __m512 e[4];
      for (int c = 0; c < 4; ++c) {
        e[c] = _mm512_maskz_mov_ps(m[c], exp16(_mm512_sub_ps(x[c], _mm512_set1_ps(m_new))));
      }
      for (int c = 0; c < 4; c += 2) {
        const __m512bh pb = _mm512_cvtne2ps_pbh(e[c + 1], e[c]);  // keys 16c .. 16c + 31
        const __m512i pi = (__m512i)pb;
        _mm512_storeu_si512(pr + 8 * c, pi);
        // the sum takes the rounded probabilities, the ones P.V uses
        total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm512_castsi512_si256(pi)), 16)));
        total = _mm512_add_ps(total, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pi, 1)), 16)));
      }
      sum[r] = sum[r] * alpha[r] + _mm512_reduce_add_ps(total);
    }
    pf_tiles(rows, [&](auto rt, int64_t r0) {
      pf_values<decltype(rt)::value>(pws.data() + r0 * (kPfKeys / 2), vblk, d, o + r0 * d,
                                     alpha + r0);
    });
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = i0 + r / rep, h = g * rep + r % rep;
    bf16_bits* dst = a.out + i * a.heads * d + h * d;
    const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
    for (int64_t c = 0; c < d; c += 16)
      store16(dst + c, round16(_mm512_mul_ps(_mm512_loadu_ps(o + r * d + c), inv), dst));
  }
}

void prefill_rows(const PrefillArgs& args, const bf16_bits* cache, const int64_t* slots,
                  int64_t nk, bf16_bits* kp, bf16_bits* vp) {
  const int64_t kv_heads = args.kv_heads, d = args.d, blocks = args.blocks;
  at::parallel_for(0, kv_heads * blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t g = it / blocks, b = it % blocks;
      pf_pack_block(cache, slots, nk, kv_heads, d, g, b, kp + it * (d / 2) * kPfKeys * 2,
                    vp + it * (kPfKeys / 2) * d * 2);
    }
  });
  // Items are handed out one at a time, the longest (last query blocks) first: the causal
  // work per item grows along the prompt, so fixed shares would leave a thread idle.
  const int64_t nqb = (args.q_len + kPfQueries - 1) / kPfQueries, items = nqb * kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> ws;
    std::vector<uint32_t> pws;
    for (int64_t it = next.fetch_add(1); it < items; it = next.fetch_add(1))
      pf_item(args, it % kv_heads, nqb - 1 - it / kv_heads, ws, pws);
  });
}
#endif

bool prefill_attention_supported() { return has_avx512_bf16(); }

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& kv_cache,
                             const at::Tensor& slots, int64_t start, double scale) {
  TORCH_CHECK(prefill_attention_supported(),
              "prefill_attention: this build has no AVX512-BF16 (the CPU lacks avx512_bf16)");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kBFloat16 && q.dim() == 3 &&
                  q.stride(2) == 1 && q.stride(1) == q.size(2),
              "prefill_attention: q must be a bfloat16 [q_len, heads, head_dim] CPU tensor, "
              "heads contiguous");
  const int64_t q_len = q.size(0), heads = q.size(1), d = q.size(2);
  TORCH_CHECK(d % 64 == 0, "prefill_attention: head_dim ", d, " must be a multiple of 64");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.is_contiguous() && kv_cache.size(1) == 2 &&
                  kv_cache.size(3) == d && kv_cache.scalar_type() == at::kBFloat16,
              "prefill_attention: kv_cache must be a contiguous bfloat16 [slots, 2, kv_heads, "
              "head_dim] tensor");
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
#if defined(__AVX512BF16__)
  const int64_t blocks = (nk + kPfKeys - 1) / kPfKeys;
  auto kp = at::empty({kv_heads * blocks * kPfKeys * d}, q.options());
  auto vp = at::empty({kv_heads * blocks * kPfKeys * d}, q.options());
  const PrefillArgs args{ptr<bf16_bits>(q), q.stride(0), ptr<bf16_bits>(kp), ptr<bf16_bits>(vp),
                         ptr<bf16_bits>(out), q_len, start, heads, kv_heads, d, blocks,
                         float(scale)};
  prefill_rows(args, ptr<bf16_bits>(kv_cache), sl, nk, ptr<bf16_bits>(kp), ptr<bf16_bits>(vp));
#endif
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
