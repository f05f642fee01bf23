// Fused CPU fp32 ops for small decode batches (common/models/cpu_fused.py builds and loads this file
// with cpu_gemv.cpp, cpu_gemm.cpp, cpu_bf16.cpp, cpu_int8.cpp and cpu_step.cpp; cpu_common.h is what they
// share).
//
// A batch-1 decode forward on CPU is the weights streamed once plus ~2,000 small dispatched torch ops
// (norm, rotary, KV write, paged gather, SDPA, SiLU-mul): each costs a few microseconds whatever its
// size. These ops do the same arithmetic in one call each:
//   rms_norm(x [N, D], w [D], eps)                      -> x * rsqrt(mean(x^2) + eps) * w
//   silu_and_mul(gate_up [N, 2I])                       -> silu(gate) * up  [N, I]
//   gemv(x [R, K], w [N, K], bias?, residual?)         -> residual + x @ w.T + bias [R, N], for a few
//     rows R (a decode step's), and stream_sum: cpu_gemv.cpp; pack_panels / gemm_panels, the GEMM of
//     many rows (prefill chunks) on weights laid out once: cpu_gemm.cpp; pack_bf16_pairs / gemm_bf16,
//     the bf16 matmul: cpu_bf16.cpp; pack_int8_quads / pack_int8_scales / gemm_int8, the int8 matmul:
//     cpu_int8.cpp;
//   decode_attention(qkv [T, (H + 2 KV) d], ...)        -> [T, H d]: what the batched backend's path
//     computes between qkv_proj and o_proj for a decode, or a short extend's T new tokens: optional
//     per-head q/k RMSNorm (Qwen3), the half-split rotary with the signed sin of RotaryEmbedding.cos_sin,
//     every token's K and V written at out_loc (the caches float32, or bf16: --kv-cache-dtype, each value
//     rounded to nearest as it is written, widened exactly as it is read), then each token's query heads
//     attending over the first seq_lens[t] slots of its request's row of slots (slots [B, S_max], read from
//     req_to_token; the row: requests[t], or t in a decode), GQA heads h -> kv head h / (H / KV) (HF's
//     repeat_kv order), softmax in fp32. In an extend, seq_lens[t] ends at the token's own slot: the causal mask.
//   decode_layers(x, weights, ...)                      -> dense decoder layers' decode step: for each
//     layer the ops above in the modules' order (two norms, four linears, the attention, SiLU-and-mul):
//     cpu_step.cpp;
// Work is split over (token, kv head), the attention's over parts of each token's slots, with
// parallel_range (cpu_common.h) once it is large enough to pay for a parallel region; the inner loops are
// cpu_common.h's vectors or left to the compiler (-O3 -march=native, omp simd).
// Padded lanes may share out_loc 0 (the padding slot, never read for a real request).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common.h"

namespace disagg_cpu {

// out = x * cos + [x2, x1] * sin (sin's first half already negated), as rope.apply_rotary
inline void rotary(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + x[i + half] * sin[i];
#pragma omp simd
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// o[g d + i] += p[g ld + j] * v_j[i] for g < G (query heads sharing a kv head), j < n in j order, i < d
// (v_j = base + slots[j] * stride): kChunk vectors of each head's o held in registers while the slots go by,
// each vector of V loaded once for the G heads, whose sums are independent chains (one head's alone waited
// on its own multiply-adds every slot); each element's sum in the slots' order, as its own loop would add
constexpr int64_t kChunk = 4, kHeadsAtOnce = 4;
template <int G, typename T>
inline void add_rows(const float* p, int64_t ld, const T* base, const int64_t* slots, int64_t stride, int64_t n,
                     int64_t d, float* o) {
  int64_t i0 = 0;
  for (; i0 + kChunk * kLanes <= d; i0 += kChunk * kLanes) {
    vec acc[G][kChunk];
    for (int g = 0; g < G; ++g)
      for (int64_t c = 0; c < kChunk; ++c) acc[g][c] = vload(o + g * d + i0 + c * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      const T* v = base + slots[j] * stride + i0;
      vec vj[kChunk];
      for (int64_t c = 0; c < kChunk; ++c) vj[c] = vload(v + c * kLanes);
      for (int g = 0; g < G; ++g) {
        const vec pj = vset1(p[g * ld + j]);
        for (int64_t c = 0; c < kChunk; ++c) acc[g][c] = vfma(pj, vj[c], acc[g][c]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int64_t c = 0; c < kChunk; ++c) vstore(o + g * d + i0 + c * kLanes, acc[g][c]);
  }
  for (; i0 < d; ++i0) {  // what a head size not a multiple of kChunk vectors leaves
    for (int g = 0; g < G; ++g) {
      float acc = o[g * d + i0];
      for (int64_t j = 0; j < n; ++j)
        acc = std::fma(p[g * ld + j], static_cast<float>(base[slots[j] * stride + i0]), acc);
      o[g * d + i0] = acc;
    }
  }
}

// add_rows for `heads` query heads (any count) sharing a kv head, at most kHeadsAtOnce at a time
template <typename T>
inline void add_rows_of(const float* p, int64_t ld, int64_t heads, const T* base, const int64_t* slots,
                        int64_t stride, int64_t n, int64_t d, float* o) {
  for (int64_t g = 0; g < heads; g += kHeadsAtOnce) {
    const float* pg = p + g * ld;
    float* og = o + g * d;
    switch (std::min(kHeadsAtOnce, heads - g)) {
      case 1: add_rows<1>(pg, ld, base, slots, stride, n, d, og); break;
      case 2: add_rows<2>(pg, ld, base, slots, stride, n, d, og); break;
      case 3: add_rows<3>(pg, ld, base, slots, stride, n, d, og); break;
      default: add_rows<4>(pg, ld, base, slots, stride, n, d, og); break;
    }
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_f32(x, "x");
  check_f32(w, "weight");
  const int64_t d = x.size(-1), n = d ? x.numel() / d : 0;
  TORCH_CHECK(w.numel() == d, "weight: ", d, " elements expected");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const float *px = x.data_ptr<float>(), *pw = w.data_ptr<float>();
  float* po = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  parallel_range(0, n, grain_for(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_row(px + r * d, pw, e, d, po + r * d);
  });
  return out;
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_f32(gate_up, "gate_up");
  const int64_t two_i = gate_up.size(-1), inter = two_i / 2, n = two_i ? gate_up.numel() / two_i : 0;
  TORCH_CHECK(two_i % 2 == 0, "gate_up: an even last dimension expected");
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = inter;
  at::Tensor out = at::empty(shape, gate_up.options());
  const float* pg = gate_up.data_ptr<float>();
  float* po = out.data_ptr<float>();
  parallel_range(0, n, grain_for(two_i), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      silu_row(pg + r * two_i, inter, po + r * inter);
    }
  });
  return out;
}

// The attention's passes, each over its tasks [begin, end) (decode_attention runs them as two parallel
// ranges, decode_layers' one-region step as each thread's share)
// (T: the caches' element type; a bf16 cache takes each value rounded to nearest even, as torch's .to does)
template <typename T>
void write_kv_as(const Attention& a, int64_t begin, int64_t end) {
  std::vector<float> tmp(a.d), k_out(std::is_same_v<T, float> ? 0 : a.d);
  const int64_t d = a.d, width = (a.heads + 2 * a.kv_heads) * d, row = a.kv_heads * d;
  T *k_cache = static_cast<T*>(a.k_cache), *v_cache = static_cast<T*>(a.v_cache);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / a.kv_heads, h = task % a.kv_heads;  // b: the token
    const float *src = a.qkv + b * width, *k_in = src + (a.heads + h) * d;
    if (a.k_norm != nullptr) {
      rms_row(k_in, a.k_norm, a.eps, d, tmp.data());
      k_in = tmp.data();
    }
    const float* v_in = src + (a.heads + a.kv_heads + h) * d;
    T *k_dst = k_cache + a.out_loc[b] * row + h * d, *v_dst = v_cache + a.out_loc[b] * row + h * d;
    if constexpr (std::is_same_v<T, float>) {  // straight into the cache
      rotary(k_in, a.cos + b * d, a.sin + b * d, d, k_dst);
      std::copy(v_in, v_in + d, v_dst);
    } else {
      rotary(k_in, a.cos + b * d, a.sin + b * d, d, k_out.data());
      for (int64_t i = 0; i < d; ++i) k_dst[i] = static_cast<T>(k_out[i]), v_dst[i] = static_cast<T>(v_in[i]);
    }
  }
}

void write_kv(const Attention& a, int64_t begin, int64_t end) {
  a.kv_bf16 ? write_kv_as<c10::BFloat16>(a, begin, end) : write_kv_as<float>(a, begin, end);
}

// The attention's tasks: per token, one part of its slots, every query head over them. Each slot's row
// of K (all kv heads) and then of V is read once, kLanes slots at a time. A part's result (each head's
// largest score, sum of exponentials and unnormalized weighted V) is merged with the token's other parts by
// `merge`. A decode token's parts depend on its own slot count only, never on the batch or the team, so its
// bits do too; an extend's tokens are one part each (they are tasks enough, and parts would keep results in
// proportion to tokens times parts).
// One request of SmolLM2 (3 kv heads, w8a8, 2-core AMD Zen 4): 5.1 / 9.4 / 23.5 ms a step at 64 / 1,024 /
// 4,096 slots when the work was split over its 9 query heads, each reading its kv head's K and V from memory
constexpr int64_t kPartSlots = 32, kMaxParts = 16;
inline int64_t parts_of(int64_t seq) { return std::min(kMaxParts, (seq + kPartSlots - 1) / kPartSlots); }

std::vector<int64_t> task_starts(const Attention& a) {
  std::vector<int64_t> starts(a.tokens + 1, 0);
  for (int64_t b = 0; b < a.tokens; ++b) starts[b + 1] = starts[b] + (a.requests != nullptr ? 1 : parts_of(a.seq_lens[b]));
  return starts;
}

int64_t partial_floats(const Attention& a) { return a.heads * (a.d + 2); }

// w[g Q] = vsums4 of dot(q_g, k_r)'s kLanes products for g < G query heads and four rows k_r = rows[r] + offset
// (Q = kLanes / 4 such vectors make each head's block of scores): each vector of K loaded once for the G heads
template <int G, typename T>
inline void chunk_sums(const float* q, const T* const* rows, int64_t offset, int64_t d, vec* w) {
  vec acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < 4; ++r) acc[g][r] = vzero();
  for (int64_t i = 0; i < d; i += kLanes) {
    vec k[4];
    for (int r = 0; r < 4; ++r) k[r] = vload(rows[r] + offset + i);
    for (int g = 0; g < G; ++g) {
      const vec qi = vload(q + g * d + i);
      for (int r = 0; r < 4; ++r) acc[g][r] = vfma(qi, k[r], acc[g][r]);
    }
  }
  for (int g = 0; g < G; ++g) w[g * (kLanes / 4)] = vsums4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
}

// the query heads chunk_sums takes at once: its G x 4 sums and four rows' vectors in registers
constexpr int kScoreHeads = kLanes >= 16 ? 4 : 2;

// s[h ld + j] = dot(q_h, k_j[h / group]) * scale for the heads query heads (kv heads x group), j < n (k_j =
// k + slots[j] stride, the slot's row of every kv head), n <= kLanes, the lanes past n holding copies of the
// last score (the last row read again). Four rows at a time, each read whole (every kv head's part, as it lies)
// before the next four, their sums to vsums4 and, once all are done, to vsums_of: vsum's tree, so each score
// has dot's bits. One dot at a time where the vectors cannot take the head size.
// In decode_attention alone (SmolLM2's heads, 16 requests of 164 slots, the caches hot; perf, 2-core AMD Zen 4),
// reading one kv head's part of 16 rows at a time, each K vector once per query head, its sums in registers and
// the 16 row pointers on the stack, took ~40% of the op
template <typename T>
inline void scores_of(const float* q, int64_t kv_heads, int64_t group, const T* k, const int64_t* slots,
                      int64_t stride, int64_t n, int64_t d, float scale, float* s, int64_t ld) {
  const int64_t heads = kv_heads * group;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  if (d % kLanes == 0) {
    constexpr int64_t Q = kLanes / 4;
    thread_local std::vector<vec> w;  // [heads][Q]: each head's four rows' partial sums
    w.resize(heads * Q);
    const T* rows[kLanes];
    for (int64_t r = 0; r < kLanes; ++r) rows[r] = k + slots[std::min(r, n - 1)] * stride;
    for (int64_t c = 0; c < Q; ++c)
      for (int64_t h = 0; h < kv_heads; ++h)
        for (int64_t g = 0; g < group; g += kScoreHeads) {
          const float* qg = q + (h * group + g) * d;
          vec* wg = w.data() + (h * group + g) * Q + c;
          switch (std::min<int64_t>(kScoreHeads, group - g)) {
            case 1: chunk_sums<1>(qg, rows + 4 * c, h * d, d, wg); break;
            case 2: chunk_sums<2>(qg, rows + 4 * c, h * d, d, wg); break;
            case 3: chunk_sums<3>(qg, rows + 4 * c, h * d, d, wg); break;
            default: chunk_sums<kScoreHeads>(qg, rows + 4 * c, h * d, d, wg); break;
          }
        }
    for (int64_t h = 0; h < heads; ++h) {
      vec wh[Q];
      std::copy(w.data() + h * Q, w.data() + (h + 1) * Q, wh);
      vstore(s + h * ld, vmul(vsums_of(wh), vset1(scale)));
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < heads; ++h) s[h * ld + j] = dot(q + h * d, k + slots[j] * stride + h / group * d, d) * scale;
  for (int64_t h = 0; h < heads; ++h) std::fill(s + h * ld + n, s + h * ld + kLanes, s[h * ld + n - 1]);
}

// p[j] = e^(p[j] - max p) for j < n and 0 past n up to ld (a whole number of vectors; p's lanes past n copy
// p[n - 1], so they leave the max alone); returns (max, sum of p), the sum in vectors, then vsum's tree
inline std::pair<float, float> softmax_numerators(float* p, int64_t n, int64_t ld) {
  float top = p[0];
#pragma omp simd reduction(max : top)
  for (int64_t j = 0; j < ld; ++j) top = std::max(top, p[j]);
#pragma omp simd
  for (int64_t j = 0; j < ld; ++j) p[j] = exp_approx(p[j] - top);
  std::fill(p + n, p + ld, 0.f);
  vec acc = vzero();
  for (int64_t j = 0; j < ld; j += kLanes) acc = vadd(acc, vload(p + j));
  return {top, vsum(acc)};
}

// Reads the n rows (row elements each) at slots once, front to back, before a pass uses them. A part's passes read
// each kv head's 256 B of 16 rows in turn, a pattern the hardware's prefetchers do not follow; rows read whole
// and in order stream in together. Reading a part's K and V rows first made decode_attention 15-25% faster
// at 1-64 requests and 100-4,000 slots of SmolLM2 (w8a8 step's shapes, float32 and bf16 caches, 2-core AMD
// Zen 4); software prefetches of the same lines did nothing there. Up to kTouchBytes a part (K and V): the
// rows must still be in the core's cache when the passes come to them. Decode parts only: an extend's tokens
// read their request's rows one after another, so after the first they are in cache already
constexpr int64_t kTouchBytes = 256 * 1024;
template <typename T>
inline void touch_rows(const T* base, const int64_t* slots, int64_t n, int64_t row) {
  vec acc = vzero();
  for (int64_t j = 0; j < n; ++j) {
    const T* r = base + slots[j] * row;
    int64_t i = 0;
    for (; i + kLanes <= row; i += kLanes) acc = vadd(acc, vload(r + i));
    for (; i < row; ++i) acc = vadd(acc, vset1(static_cast<float>(r[i])));
  }
  float sink[kLanes];
  vstore(sink, acc);
  asm volatile("" : : "r"(sink) : "memory");  // the loads are the point: kept
}

template <typename T>
void attend_as(const Attention& a, int64_t begin, int64_t end) {
  const T *k_cache = static_cast<const T*>(a.k_cache), *v_cache = static_cast<const T*>(a.v_cache);
  const int64_t d = a.d, heads = a.heads, group = heads / a.kv_heads, row = a.kv_heads * d;
  const int64_t width = (heads + 2 * a.kv_heads) * d, size = partial_floats(a);
  std::vector<float> tmp(d), q(heads * d), scores;
  int64_t b = 0;
  for (int64_t task = begin; task < end; ++task) {
    while (a.starts[b + 1] <= task) ++b;  // b: the token
    const int64_t parts = a.starts[b + 1] - a.starts[b], part = task - a.starts[b], seq = a.seq_lens[b];
    const int64_t j0 = part * seq / parts, n = (part + 1) * seq / parts - j0;
    const float *src = a.qkv + b * width, *c = a.cos + b * d, *s = a.sin + b * d;
    if (a.write_own && part == parts - 1) write_kv(a, b * a.kv_heads, (b + 1) * a.kv_heads);  // its last slot
    for (int64_t h = 0; h < heads; ++h) {  // the queries
      const float* q_in = src + h * d;
      if (a.q_norm != nullptr) {
        rms_row(q_in, a.q_norm, a.eps, d, tmp.data());
        q_in = tmp.data();
      }
      rotary(q_in, c, s, d, q.data() + h * d);
    }
    const int64_t* sl = a.slots + (a.requests != nullptr ? a.requests[b] : b) * a.s_max + j0;
    if (a.requests == nullptr) {  // a decode: its part's rows are read by it alone (an extend's tokens share theirs)
      const int64_t touched = std::min(n, kTouchBytes / (2 * row * static_cast<int64_t>(sizeof(T))));
      touch_rows(k_cache, sl, touched, row);
      touch_rows(v_cache, sl, touched, row);
    }
    const int64_t ld = (n + kLanes - 1) / kLanes * kLanes;  // each head's scores: n, then copies to a vector's end
    scores.resize(heads * ld);
    for (int64_t j = 0; j < n; j += kLanes)  // scores: query head h = kv head h / group's g
      scores_of(q.data(), a.kv_heads, group, k_cache, sl + j, row, std::min(kLanes, n - j), d, a.scale,
                scores.data() + j, ld);
    float* out = a.partial + task * size;  // [heads d] weighted V, [heads] largest score, [heads] sum
    for (int64_t h = 0; h < heads; ++h)  // softmax numerators
      std::tie(out[heads * d + h], out[heads * d + heads + h]) = softmax_numerators(scores.data() + h * ld, n, ld);
    std::fill(out, out + heads * d, 0.f);
    for (int64_t j = 0; j < n; j += kLanes) {  // unnormalized weighted V
      const int64_t m = std::min(kLanes, n - j);
      for (int64_t h = 0; h < a.kv_heads; ++h)
        add_rows_of(scores.data() + h * group * ld + j, ld, group, v_cache + h * d, sl + j, row, m, d, out + h * group * d);
    }
  }
}

void attend(const Attention& a, int64_t begin, int64_t end) {
  a.kv_bf16 ? attend_as<c10::BFloat16>(a, begin, end) : attend_as<float>(a, begin, end);
}

// tokens [begin, end) of out [tokens, heads d]: each query head's parts merged, each scaled by e^(its largest
// score - the largest of all) (one part: out = its weighted V / its sum, as a single pass computes it)
void merge(const Attention& a, int64_t begin, int64_t end, float* out) {
  const int64_t d = a.d, heads = a.heads, size = partial_floats(a);
  std::vector<float> acc(d);
  for (int64_t b = begin; b < end; ++b) {
    const int64_t parts = a.starts[b + 1] - a.starts[b];
    const float* first = a.partial + a.starts[b] * size;
    for (int64_t h = 0; h < heads; ++h) {
      float top = first[heads * d + h];
      for (int64_t c = 1; c < parts; ++c) top = std::max(top, first[c * size + heads * d + h]);
      std::fill(acc.begin(), acc.end(), 0.f);
      float sum = 0.f;
      for (int64_t c = 0; c < parts; ++c) {
        const float* part = first + c * size;
        const float w = exp_approx(part[heads * d + h] - top), *o = part + h * d;
        sum = std::fma(w, part[heads * d + heads + h], sum);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) acc[i] = std::fma(w, o[i], acc[i]);
      }
      const float inv = 1.f / sum;
      float* dst = out + (b * heads + h) * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) dst[i] = acc[i] * inv;
    }
  }
}

// An extend over bf16 caches: each request's slots (up to its longest token's length) widened once into
// float32 rows of the calling thread's reused buffers, and `a` pointed at them (`slots`: each request's
// rows there). Every new token then reads float32 rows: widening a bf16 row for each token that reads it
// made a 2,000-token SmolLM2 prefill 10% slower than over float32 caches (2826 against 3120 ms, w8a8, 2-core
// Zen 4), the rows being in cache and the extend bound by its arithmetic; widened once, 2918 against 3073 (bf16
// faster in 4 of 10 interleaved rounds). The same values, so the same bits.
void widen_requests(Attention& a, int64_t requests, std::vector<int64_t>& slots) {
  const int64_t row = a.kv_heads * a.d;
  std::vector<int64_t> first(requests + 1, 0);
  for (int64_t t = 0; t < a.tokens; ++t)
    first[a.requests[t] + 1] = std::max(first[a.requests[t] + 1], a.seq_lens[t]);
  for (int64_t r = 0; r < requests; ++r) first[r + 1] += first[r];
  std::vector<int64_t> source(first.back());  // each widened row's slot in the caches
  slots.assign(requests * a.s_max, 0);
  for (int64_t r = 0; r < requests; ++r)
    for (int64_t j = 0; j < first[r + 1] - first[r]; ++j) {
      source[first[r] + j] = a.slots[r * a.s_max + j];
      slots[r * a.s_max + j] = first[r] + j;
    }
  thread_local std::vector<float> wide_k, wide_v;
  wide_k.resize(first.back() * row), wide_v.resize(first.back() * row);
  const auto *k = static_cast<const c10::BFloat16*>(a.k_cache), *v = static_cast<const c10::BFloat16*>(a.v_cache);
  float *wk = wide_k.data(), *wv = wide_v.data();
  parallel_range(0, first.back(), grain_for(4 * row), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const c10::BFloat16 *ki = k + source[i] * row, *vi = v + source[i] * row;
      int64_t e = 0;
      for (; e + kLanes <= row; e += kLanes)
        vstore(wk + i * row + e, vload(ki + e)), vstore(wv + i * row + e, vload(vi + e));
      for (; e < row; ++e) wk[i * row + e] = static_cast<float>(ki[e]), wv[i * row + e] = static_cast<float>(vi[e]);
    }
  });
  a.k_cache = wk, a.v_cache = wv, a.kv_bf16 = false, a.slots = slots.data();
}

// a K and a V cache of one dtype, contiguous on the CPU: true where it is bf16, false where float32
bool check_kv_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* op) {
  for (const at::Tensor* c : {&k_cache, &v_cache}) {
    TORCH_CHECK(c->device().is_cpu() && c->is_contiguous() && c->scalar_type() == k_cache.scalar_type() &&
                    (c->scalar_type() == at::kFloat || c->scalar_type() == at::kBFloat16),
                op, ": contiguous CPU K and V caches, both float32 or both bfloat16, expected");
  }
  return k_cache.scalar_type() == at::kBFloat16;
}

// the slot tensors' checks (decode_attention's, and decode_layers' once per step)
void check_slots(const at::Tensor& out_loc, const at::Tensor& slots, const at::Tensor& seq_lens,
                 const c10::optional<at::Tensor>& requests, int64_t tokens, int64_t num_slots) {
  for (auto* t : {&out_loc, &slots, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "out_loc / slots / seq_lens / requests: contiguous int64 expected");
  }
  TORCH_CHECK(out_loc.numel() == tokens && seq_lens.numel() == tokens && slots.dim() == 2,
              "out_loc [T], slots [B, S_max], seq_lens [T] expected");
  const int64_t s_max = slots.size(1);
  const int64_t *ploc = out_loc.data_ptr<int64_t>(), *pseq = seq_lens.data_ptr<int64_t>(), *preq = nullptr;
  if (requests.has_value()) {
    TORCH_CHECK(requests->scalar_type() == at::kLong && requests->is_contiguous() && requests->device().is_cpu() &&
                    requests->numel() == tokens,
                "requests: contiguous int64 [T] expected");
    preq = requests->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(slots.size(0) == tokens, "slots: a row per token expected (or requests)");
  }
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pseq[t] >= 1 && pseq[t] <= s_max, "seq_lens out of range");
    TORCH_CHECK(ploc[t] >= 0 && ploc[t] < num_slots, "out_loc out of range");
    TORCH_CHECK(preq == nullptr || (preq[t] >= 0 && preq[t] < slots.size(0)), "requests out of range");
  }
}

at::Tensor decode_attention(
    const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
    const c10::optional<at::Tensor>& k_norm, double eps, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& out_loc, const at::Tensor& slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale, const c10::optional<at::Tensor>& requests) {
  for (auto* t : {&qkv, &cos, &sin}) check_f32(*t, "qkv/cos/sin");
  const bool kv_bf16 = check_kv_caches(k_cache, v_cache, "decode_attention");
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  const int64_t batch = qkv.size(0), d = k_cache.size(-1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * d,
              "qkv: [B, (heads + 2 kv_heads) head_dim] expected");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == kv_heads && v_cache.sizes() == k_cache.sizes(),
              "k_cache / v_cache: [slots, kv_heads, head_dim] expected");
  TORCH_CHECK(cos.numel() == batch * d && sin.numel() == batch * d, "cos / sin: [B, head_dim] expected");
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  check_slots(out_loc, slots, seq_lens, requests, batch, k_cache.size(0));
  Attention a;
  if (q_norm.has_value()) {
    check_f32(*q_norm, "q_norm");
    a.q_norm = q_norm->data_ptr<float>();
  }
  if (k_norm.has_value()) {
    check_f32(*k_norm, "k_norm");
    a.k_norm = k_norm->data_ptr<float>();
  }
  at::Tensor out = at::empty({batch, heads * d}, qkv.options());
  a.qkv = qkv.data_ptr<float>(), a.cos = cos.data_ptr<float>(), a.sin = sin.data_ptr<float>();
  a.k_cache = k_cache.data_ptr(), a.v_cache = v_cache.data_ptr(), a.kv_bf16 = kv_bf16;
  a.out_loc = out_loc.data_ptr<int64_t>(), a.slots = slots.data_ptr<int64_t>(), a.seq_lens = seq_lens.data_ptr<int64_t>();
  a.requests = requests.has_value() ? requests->data_ptr<int64_t>() : nullptr;
  a.tokens = batch, a.heads = heads, a.kv_heads = kv_heads, a.d = d, a.s_max = slots.size(1);
  a.eps = static_cast<float>(eps), a.scale = static_cast<float>(scale);
  // this token's K (normed, rotated) and V into the pool, per (request, kv head); then the attention
  parallel_range(0, batch * kv_heads, grain_for(4 * d), [&](int64_t begin, int64_t end) { write_kv(a, begin, end); });
  std::vector<int64_t> wide_slots;
  if (a.kv_bf16 && a.requests != nullptr) widen_requests(a, slots.size(0), wide_slots);
  const std::vector<int64_t> starts = task_starts(a);
  thread_local std::vector<float> partial;  // the calling thread's, reused (attend writes all that merge reads)
  partial.resize(starts.back() * partial_floats(a));
  a.starts = starts.data(), a.partial = partial.data();
  parallel_claims(starts.back(), 1, [&](int64_t begin, int64_t end) { attend(a, begin, end); });
  parallel_range(0, batch, grain_for(heads * d * kMaxParts),
                 [&](int64_t begin, int64_t end) { merge(a, begin, end, out.data_ptr<float>()); });
  return out;
}

}  // namespace disagg_cpu

using namespace disagg_cpu;

TORCH_LIBRARY(disagg_cpu_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", &silu_and_mul);
  m.def("gemv(Tensor x, Tensor w, Tensor? bias, Tensor? residual) -> Tensor", &gemv);
  m.def("gemv_w8(Tensor x, Tensor w, Tensor scale, Tensor? bias, Tensor? residual) -> Tensor", &gemv_w8);
  m.def("stream_sum(Tensor x, int streams) -> Tensor", &stream_sum);
  m.def("row_streams(int streams=0) -> int", &row_streams);
  m.def("pack_panels(Tensor w) -> Tensor", &pack_panels);
  m.def("gemm_panels(Tensor x, Tensor panels, int n, Tensor? bias, Tensor? residual, Tensor? scale=None) -> Tensor",
        &gemm_panels);
  m.def("pack_bf16_pairs(Tensor w) -> Tensor", &pack_bf16_pairs);
  m.def("gemm_bf16(Tensor x, Tensor pairs, int n, Tensor? bias, Tensor? residual) -> Tensor", &gemm_bf16);
  m.def("pack_int8_quads(Tensor w) -> Tensor", &pack_int8_quads);
  m.def("pack_int8_scales(Tensor scale) -> Tensor", &pack_int8_scales);
  m.def("int8_streams(int streams=0) -> int", &int8_streams);
  m.def("gemm_int8(Tensor x, Tensor quads, Tensor scales, int n, int block, Tensor? bias, Tensor? residual) -> Tensor",
        &gemm_int8);
  m.def(
      "decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_loc, Tensor slots, Tensor seq_lens, int heads, "
      "int kv_heads, float scale, Tensor? requests=None) -> Tensor",
      &decode_attention);
}
