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
//     the bf16 matmul: cpu_bf16.cpp; pack_int8_quads / gemm_int8, the int8 matmul: cpu_int8.cpp;
//   decode_attention(qkv [T, (H + 2 KV) d], ...)        -> [T, H d]: what the batched backend's path
//     computes between qkv_proj and o_proj for a decode, or a short extend's T new tokens: optional
//     per-head q/k RMSNorm (Qwen3), the half-split rotary with the signed sin of RotaryEmbedding.cos_sin,
//     every token's K and V written at out_loc, then each token's query heads attending over the first
//     seq_lens[t] slots of its request's row of slots (slots [B, S_max], read from req_to_token; the row:
//     requests[t], or t in a decode), GQA heads h -> kv head h / (H / KV) (HF's repeat_kv order),
//     softmax in fp32. In an extend, seq_lens[t] ends at the token's own slot: the causal mask.
//   decode_layers(x, weights, ...)                      -> dense decoder layers' decode step: for each
//     layer the ops above in the modules' order (two norms, four linears, the attention, SiLU-and-mul):
//     cpu_step.cpp;
// Work is split over (token, kv head), or over query heads where those are few (decode_attention), with
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

// the rows a few slots ahead: slots are scattered, so the hardware prefetchers cannot see them coming
constexpr int64_t kAhead = 8;
inline void prefetch_row(const float* p, int64_t d) {
  for (int64_t i = 0; i < d; i += 16) __builtin_prefetch(p + i);
}

// o[i] = inv * sum over j < seq, in j order, of p[j] * v_j[i], for i < d, v_j = base + slots[j] * stride:
// kChunk vectors of o at a time held in registers while the slots go by (a vector of o kept in memory
// waited on its own store every slot). The sums' order is the slots', as each element's own loop would add
constexpr int64_t kChunk = 4;
inline void weighted_rows(const float* p, const float* base, const int64_t* slots, int64_t stride, int64_t seq,
                          int64_t d, float inv, float* o) {
  int64_t i0 = 0;
  for (; i0 + kChunk * kLanes <= d; i0 += kChunk * kLanes) {
    vec acc[kChunk];
    for (int64_t c = 0; c < kChunk; ++c) acc[c] = vzero();
    for (int64_t j = 0; j < seq; ++j) {
      if (i0 == 0 && j + kAhead < seq) prefetch_row(base + slots[j + kAhead] * stride, d);
      const vec pj = vset1(p[j]);
      const float* v = base + slots[j] * stride + i0;
      for (int64_t c = 0; c < kChunk; ++c) acc[c] = vfma(pj, vload(v + c * kLanes), acc[c]);
    }
    for (int64_t c = 0; c < kChunk; ++c) vstore(o + i0 + c * kLanes, vmul(acc[c], vset1(inv)));
  }
  for (; i0 < d; ++i0) {  // what a head size not a multiple of kChunk vectors leaves
    float a = 0.f;
    for (int64_t j = 0; j < seq; ++j) a = std::fma(p[j], base[slots[j] * stride + i0], a);
    o[i0] = a * inv;
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
void write_kv(const Attention& a, int64_t begin, int64_t end) {
  std::vector<float> tmp(a.d);
  const int64_t d = a.d, width = (a.heads + 2 * a.kv_heads) * d, row = a.kv_heads * d;
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / a.kv_heads, h = task % a.kv_heads;  // b: the token
    const float *src = a.qkv + b * width, *k_in = src + (a.heads + h) * d;
    if (a.k_norm != nullptr) {
      rms_row(k_in, a.k_norm, a.eps, d, tmp.data());
      k_in = tmp.data();
    }
    rotary(k_in, a.cos + b * d, a.sin + b * d, d, a.k_cache + a.out_loc[b] * row + h * d);
    std::copy(src + (a.heads + a.kv_heads + h) * d, src + (a.heads + a.kv_heads + h + 1) * d,
              a.v_cache + a.out_loc[b] * row + h * d);
  }
}

// per (token, kv head): the group's queries read each slot's K and V once. Where those are fewer than
// twice the team's threads (a decode of a request or two of a model with few kv heads), per query head: one
// request of SmolLM2 is 3 kv heads, 2 + 1 on 2 threads, against 9 query heads, 5 + 4
int64_t Attention::split(int64_t team) const { return tokens * kv_heads < 2 * team ? heads / kv_heads : 1; }

void attend(const Attention& a, int64_t split, int64_t begin, int64_t end) {
  const int64_t d = a.d, group = a.heads / a.kv_heads, per = group / split;
  const int64_t width = (a.heads + 2 * a.kv_heads) * d, row = a.kv_heads * d;
  std::vector<float> tmp(d), q(per * d), scores, inv_sum(per);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / (a.kv_heads * split), h = task / split % a.kv_heads, g0 = task % split * per;  // b: token
    const int64_t seq = a.seq_lens[b];
    const float *src = a.qkv + b * width, *c = a.cos + b * d, *s = a.sin + b * d;
    // this task's queries: heads h * group + g0 .. + per
    for (int64_t g = 0; g < per; ++g) {
      const float* q_in = src + (h * group + g0 + g) * d;
      if (a.q_norm != nullptr) {
        rms_row(q_in, a.q_norm, a.eps, d, tmp.data());
        q_in = tmp.data();
      }
      rotary(q_in, c, s, d, q.data() + g * d);
    }
    // scores over the request's slots, softmax, weighted V
    scores.resize(per * seq);
    const int64_t* sl = a.slots + (a.requests != nullptr ? a.requests[b] : b) * a.s_max;
    for (int64_t j = 0; j < seq; ++j) {
      if (j + kAhead < seq) prefetch_row(a.k_cache + sl[j + kAhead] * row + h * d, d);
      const float* key = a.k_cache + sl[j] * row + h * d;
      for (int64_t g = 0; g < per; ++g) scores[g * seq + j] = dot(q.data() + g * d, key, d) * a.scale;
    }
    for (int64_t g = 0; g < per; ++g) {
      float* p = scores.data() + g * seq;
      const float m = *std::max_element(p, p + seq);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < seq; ++j) {
        p[j] = exp_approx(p[j] - m);
        sum += p[j];
      }
      inv_sum[g] = 1.f / sum;
    }
    for (int64_t g = 0; g < per; ++g)
      weighted_rows(scores.data() + g * seq, a.v_cache + h * d, sl, row, seq, d, inv_sum[g],
                    a.out + b * a.heads * d + (h * group + g0 + g) * d);
  }
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
  for (auto* t : {&qkv, &cos, &sin, &k_cache, &v_cache}) check_f32(*t, "qkv/cos/sin/k_cache/v_cache");
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
  a.k_cache = k_cache.data_ptr<float>(), a.v_cache = v_cache.data_ptr<float>(), a.out = out.data_ptr<float>();
  a.out_loc = out_loc.data_ptr<int64_t>(), a.slots = slots.data_ptr<int64_t>(), a.seq_lens = seq_lens.data_ptr<int64_t>();
  a.requests = requests.has_value() ? requests->data_ptr<int64_t>() : nullptr;
  a.tokens = batch, a.heads = heads, a.kv_heads = kv_heads, a.d = d, a.s_max = slots.size(1);
  a.eps = static_cast<float>(eps), a.scale = static_cast<float>(scale);
  // this token's K (normed, rotated) and V into the pool, per (request, kv head); then the attention
  parallel_range(0, batch * kv_heads, grain_for(4 * d), [&](int64_t begin, int64_t end) { write_kv(a, begin, end); });
  const int64_t split = a.split(omp_in_parallel() ? 1 : omp_get_max_threads()), per = heads / kv_heads / split;
  parallel_range(0, batch * kv_heads * split, grain_for(a.s_max * d * (per + 1) * 2),
                 [&](int64_t begin, int64_t end) { attend(a, split, begin, end); });
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
  m.def("gemm_int8(Tensor x, Tensor quads, Tensor scale, int n, int block, Tensor? bias, Tensor? residual) -> Tensor",
        &gemm_int8);
  m.def(
      "decode_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float eps, "
      "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor out_loc, Tensor slots, Tensor seq_lens, int heads, "
      "int kv_heads, float scale, Tensor? requests=None) -> Tensor",
      &decode_attention);
}
