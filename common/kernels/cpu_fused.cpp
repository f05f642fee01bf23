// Fused CPU fp32 ops for small decode batches (common/models/cpu_fused.py builds and loads this file
// with cpu_gemv.cpp, cpu_gemm.cpp, cpu_bf16.cpp and cpu_int8.cpp; cpu_common.h is what they share).
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
//   decode_attention(qkv [B, (H + 2 KV) d], ...)        -> [B, H d]: what the batched backend's decode
//     path computes between qkv_proj and o_proj: optional per-head q/k RMSNorm (Qwen3), the half-split
//     rotary with the signed sin of RotaryEmbedding.cos_sin, K and V written at out_loc, and each
//     request's query heads attending over its first seq_lens[b] slots (slots [B, S_max], read from
//     req_to_token), GQA heads h -> kv head h / (H / KV) (HF's repeat_kv order), softmax in fp32.
//   decode_layers(x, weights, ...)                      -> dense decoder layers' decode step: for each
//     layer the ops above in the modules' order (two norms, four gemvs, the attention, SiLU-and-mul);
// Work is split over (request, kv head), or over query heads where those are few (decode_attention), with
// parallel_range (cpu_common.h) once it is large enough to pay for a parallel region; the inner loops are
// cpu_common.h's vectors or left to the compiler (-O3 -march=native, omp simd).
// Padded lanes may share out_loc 0 (the padding slot, never read for a real request).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/custom_class.h>
#include <torch/library.h>


#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace disagg_cpu {

// a . b as kLanes partial sums, summed by vsum (a tree on the SIMD forms): the norms' sums of squares and
// the decode attention's scores. An `omp simd` reduction ended in a sequential sum of its lanes through
// memory, which was ~2/3 of the attention's time at one request (perf, 2-core AMD Zen 4)
inline float dot(const float* a, const float* b, int64_t n) {
  vec acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// e^x within ~2 ulp, branch-free so that loops over it vectorize (std::exp does not without
// -ffast-math): x = n ln2 + r, |r| <= ln2 / 2 (Cody-Waite: ln2 in two parts), e^r by Cephes' expf
// polynomial, 2^n built in the exponent bits. x is clamped to [-87.3, 88.3] (2^n stays a normal float).
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (|n| < 2^22)
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const int32_t bits = (static_cast<int32_t>(n == n ? n : 0.f) + 127) << 23;  // NaN: r carries it
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return (p * r * r + r + 1.f) * scale;
}

inline void rms_row(const float* x, const float* w, float eps, int64_t d, float* out) {
  const float inv = 1.f / std::sqrt(dot(x, x, d) / static_cast<float>(d) + eps);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) out[i] = x[i] * inv * w[i];
}

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
      const float *g = pg + r * two_i, *u = g + inter;
      float* o = po + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.f + exp_approx(-g[i])) * u[i];
    }
  });
  return out;
}

at::Tensor decode_attention(
    const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
    const c10::optional<at::Tensor>& k_norm, double eps, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& out_loc, const at::Tensor& slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale) {
  for (auto* t : {&qkv, &cos, &sin, &k_cache, &v_cache}) check_f32(*t, "qkv/cos/sin/k_cache/v_cache");
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  const int64_t batch = qkv.size(0), d = k_cache.size(-1), group = heads / kv_heads;
  const int64_t width = (heads + 2 * kv_heads) * d;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == width, "qkv: [B, (heads + 2 kv_heads) head_dim] expected");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == kv_heads && v_cache.sizes() == k_cache.sizes(),
              "k_cache / v_cache: [slots, kv_heads, head_dim] expected");
  TORCH_CHECK(cos.numel() == batch * d && sin.numel() == batch * d, "cos / sin: [B, head_dim] expected");
  TORCH_CHECK(d % 2 == 0, "head_dim must be even");
  for (auto* t : {&out_loc, &slots, &seq_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "out_loc / slots / seq_lens: contiguous int64 expected");
  }
  TORCH_CHECK(out_loc.numel() == batch && seq_lens.numel() == batch && slots.dim() == 2 && slots.size(0) == batch,
              "out_loc [B], slots [B, S_max], seq_lens [B] expected");
  const float *qn = nullptr, *kn = nullptr;
  if (q_norm.has_value()) {
    check_f32(*q_norm, "q_norm");
    qn = q_norm->data_ptr<float>();
  }
  if (k_norm.has_value()) {
    check_f32(*k_norm, "k_norm");
    kn = k_norm->data_ptr<float>();
  }
  const int64_t s_max = slots.size(1), num_slots = k_cache.size(0);
  const int64_t *ploc = out_loc.data_ptr<int64_t>(), *pslots = slots.data_ptr<int64_t>();
  const int64_t* pseq = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(pseq[b] >= 1 && pseq[b] <= s_max, "seq_lens out of range");
    TORCH_CHECK(ploc[b] >= 0 && ploc[b] < num_slots, "out_loc out of range");
  }
  at::Tensor out = at::empty({batch, heads * d}, qkv.options());
  const float *pqkv = qkv.data_ptr<float>(), *pcos = cos.data_ptr<float>(), *psin = sin.data_ptr<float>();
  float *pk = k_cache.data_ptr<float>(), *pv = v_cache.data_ptr<float>(), *pout = out.data_ptr<float>();
  const float e = static_cast<float>(eps), sc = static_cast<float>(scale);
  const int64_t row = kv_heads * d;  // one slot's K (or V) of one layer

  // this token's K (normed, rotated) and V into the pool, per (request, kv head)
  parallel_range(0, batch * kv_heads, grain_for(4 * d), [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const float *src = pqkv + b * width, *k_in = src + (heads + h) * d;
      if (kn != nullptr) {
        rms_row(k_in, kn, e, d, tmp.data());
        k_in = tmp.data();
      }
      rotary(k_in, pcos + b * d, psin + b * d, d, pk + ploc[b] * row + h * d);
      std::copy(src + (heads + kv_heads + h) * d, src + (heads + kv_heads + h + 1) * d, pv + ploc[b] * row + h * d);
    }
  });
  // the attention, per (request, kv head): the group's queries read each slot's K and V once. Where those
  // are fewer than twice the threads (a request or two of a model with few kv heads), per query head: one
  // request of SmolLM2 is 3 kv heads, 2 + 1 on 2 threads, against 9 query heads, 5 + 4
  const int64_t team = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t split = batch * kv_heads < 2 * team ? group : 1, per = group / split;
  parallel_range(0, batch * kv_heads * split, grain_for(s_max * d * (per + 1) * 2), [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(d), q(per * d), scores, inv_sum(per);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (kv_heads * split), h = task / split % kv_heads, g0 = task % split * per;
      const int64_t seq = pseq[b];
      const float *src = pqkv + b * width, *c = pcos + b * d, *s = psin + b * d;
      // this task's queries: heads h * group + g0 .. + per
      for (int64_t g = 0; g < per; ++g) {
        const float* q_in = src + (h * group + g0 + g) * d;
        if (qn != nullptr) {
          rms_row(q_in, qn, e, d, tmp.data());
          q_in = tmp.data();
        }
        rotary(q_in, c, s, d, q.data() + g * d);
      }
      // scores over the request's slots, softmax, weighted V
      scores.resize(per * seq);
      const int64_t* sl = pslots + b * s_max;
      for (int64_t j = 0; j < seq; ++j) {
        if (j + kAhead < seq) prefetch_row(pk + sl[j + kAhead] * row + h * d, d);
        const float* key = pk + sl[j] * row + h * d;
        for (int64_t g = 0; g < per; ++g) scores[g * seq + j] = dot(q.data() + g * d, key, d) * sc;
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
        weighted_rows(scores.data() + g * seq, pv + h * d, sl, row, seq, d, inv_sum[g],
                      pout + b * heads * d + (h * group + g0 + g) * d);
    }
  });
  return out;
}

// A dense decoder layer's decode step for a few rows (a Llama / Qwen2 / Qwen3 layer whose linears
// run as the gemv or the panel GEMM), as the torch modules compute it:
//   h = x + o_proj(decode_attention(qkv_proj(rms_norm(x))))
//   out = h + down_proj(silu_and_mul(gate_up_proj(rms_norm(h))))
// w: the layer's kLayerWeights entries of decode_layers' list, in the order named there. A linear given
// as panels runs the panel GEMM, as bf16 pairs the bf16 matmul, as int8 quads the int8 matmul (its input
// quantized per `block` of k), else the gemv; with a scale its weight is int8 (w8 or w8a8), else float32
// or bf16.
constexpr int64_t kLayerWeights = 16;
at::Tensor decode_layer(const at::Tensor& x, const std::vector<c10::optional<at::Tensor>>& w, int64_t first,
                        double eps, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& out_loc, const at::Tensor& slots,
                        const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads, double scale, int64_t block) {
  const auto opt = [&](int64_t i) -> const c10::optional<at::Tensor>& { return w[first + i]; };
  const auto need = [&](int64_t i) -> const at::Tensor& {
    const c10::optional<at::Tensor>& t = opt(i);
    TORCH_CHECK(t.has_value(), "decode_layers: weight ", i, " of a layer is required");
    return *t;
  };
  const c10::optional<at::Tensor> none;
  // the linear of weight w_i, bias b_i and scale s_i with n outputs: the panel GEMM where the weight is
  // panels (3-D: pack_panels), the bf16 matmul where it is pairs (4-D bf16: pack_bf16_pairs), the int8
  // matmul where it is quads (4-D uint8: pack_int8_quads), else the gemv (gemv_w8 where it has a scale)
  const auto linear = [&](const at::Tensor& in, int64_t wi, int64_t bi, int64_t si, int64_t n,
                          const c10::optional<at::Tensor>& residual) {
    const c10::optional<at::Tensor>& s = opt(si);
    const at::Tensor& weight = need(wi);
    if (weight.dim() == 3) return gemm_panels(in, weight, n, opt(bi), residual, s);
    if (weight.dim() == 4 && weight.scalar_type() == at::kByte) {
      TORCH_CHECK(s.has_value(), "decode_layers: int8 quads need their scale");
      return gemm_int8(in, weight, *s, n, block, opt(bi), residual);
    }
    if (weight.dim() == 4) return gemm_bf16(in, weight, n, opt(bi), residual);
    return s.has_value() ? gemv_w8(in, weight, *s, opt(bi), residual) : gemv(in, weight, opt(bi), residual);
  };
  const int64_t hidden = x.size(1), width = (heads + 2 * kv_heads) * k_cache.size(-1);
  const at::Tensor& down = need(10);  // its in-features: the MLP's width (gate_up has twice as many outputs)
  const int64_t inter = down.dim() == 4   ? down.size(1) * down.size(3)  // bf16 pairs or int8 quads of k
                        : down.dim() == 3 ? down.size(1)
                                          : down.size(-1);
  const at::Tensor qkv = linear(rms_norm(x, need(0), eps), 2, 3, 12, width, none);
  const at::Tensor attn =
      decode_attention(qkv, cos, sin, opt(4), opt(5), eps, k_cache, v_cache, out_loc, slots, seq_lens, heads, kv_heads, scale);
  const at::Tensor h = linear(attn, 6, 7, 13, hidden, x);
  const at::Tensor gate_up = linear(rms_norm(h, need(1), eps), 8, 9, 14, 2 * inter, none);
  return linear(silu_and_mul(gate_up), 10, 11, 15, hidden, h);
}

// decode_layers' weights, held once: per layer input_norm, post_norm, qkv_w, qkv_b?, q_norm?, k_norm?, o_w,
// o_b?, gate_up_w, gate_up_b?, down_w, down_b?, and the four linears' int8 scales? (qkv, o, gate_up, down:
// given with int8 weights, low_precision.py); a linear's weight may be its panels instead (the layout the
// plan picks at the batch's rows). Built once per mix of layouts (cpu_fused.FusedLayers): a Python list of
// them, converted on every call, cost ~0.25 ms of a batch-1 step (its objects cold after the weights
// streamed past: 2-core AMD Zen 4).
struct DecodeWeights : torch::CustomClassHolder {
  std::vector<c10::optional<at::Tensor>> w;
  explicit DecodeWeights(const c10::List<c10::optional<at::Tensor>>& list) {
    TORCH_CHECK(!list.empty() && static_cast<int64_t>(list.size()) % kLayerWeights == 0,
                "DecodeWeights: ", kLayerWeights, " weights per layer expected, got ", list.size());
    w.reserve(list.size());
    for (const c10::optional<at::Tensor>& t : list) w.push_back(t);
  }
  int64_t layers() const { return static_cast<int64_t>(w.size()) / kLayerWeights; }
};

// Every layer's decode step in turn, in one call: between layers no Python runs (measured on a 2-core
// AMD EPYC: ~60 us of interpreter per layer when each layer was its own call, the weights' stream
// having pushed the interpreter's working set out of the caches). block: the int8 matmul's block of k
// (w8a8; unused by the other layouts).
at::Tensor decode_layers(const at::Tensor& x, const c10::intrusive_ptr<DecodeWeights>& weights,
                         at::TensorList k_caches, at::TensorList v_caches, double eps, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& out_loc, const at::Tensor& slots,
                         const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads, double scale, int64_t block) {
  const int64_t layers = weights->layers();
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && v_caches.size() == k_caches.size(),
              "decode_layers: a K and V cache per layer of the weights expected");
  at::Tensor h = x.contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    h = decode_layer(h, weights->w, l * kLayerWeights, eps, cos, sin, k_caches[l], v_caches[l], out_loc, slots,
                     seq_lens, heads, kv_heads, scale, block);
  }
  return h;
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
      "int kv_heads, float scale) -> Tensor",
      &decode_attention);
  m.class_<DecodeWeights>("DecodeWeights").def(torch::init<c10::List<c10::optional<at::Tensor>>>());
  m.def(
      "decode_layers(Tensor x, __torch__.torch.classes.disagg_cpu_fused.DecodeWeights weights, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, float eps, Tensor cos, "
      "Tensor sin, Tensor out_loc, Tensor slots, Tensor seq_lens, int heads, int kv_heads, float scale, int block=0) "
      "-> Tensor",
      &decode_layers);
}
