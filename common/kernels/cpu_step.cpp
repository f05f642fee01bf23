// A dense decoder stack's decode step in one call (registered here into the fused ops' library; built
// with cpu_fused.cpp and the kernels' sources by common/models/cpu_fused.py):
//   DecodeWeights(list)                      -> the stack's weights, held once per mix of layouts
//     (cpu_decode_weights.h / .cpp: checked there into what the one-region step runs)
//   decode_layers(x [R, D], weights, ...)    -> every layer's decode step in turn, for R rows
//   decode_logits(x [R, D], weights, ...)    -> the same, then the final norm and the lm_head the weights hold
//     (DecodeWeights.set_head), and with `greedy` each row's argmax: the whole step's model in one region
//   greedy_step(token_ids, rows, ...)        -> decode_logits' greedy step whose tokens are read from and
//     written to the decode service's token buffer, its inputs made by cpu_token_step.cpp
// It runs in one of two forms, with the same bits:
//   one region: at up to kRegionRows rows (a decode batch) where every linear is a gemv or the panel GEMM
//     (float32, bf16 or int8 weights), the int8 matmul or, at up to kStepRows rows, the bf16 matmul. The whole stack is one
//     OpenMP parallel region: each thread takes its share of nine tenths of each linear's outputs and of
//     the attention's tasks and claims parts of the rest as it finishes (the lm_head: a fixed share), with a
//     barrier where the next op reads what all threads wrote (five per layer). At up to kStepRows rows each
//     thread makes its own copy of a linear's input (the norms, the attention's merged parts, SiLU-and-mul,
//     the int8 matmul's quantized input, the panel GEMM's packed input); at more, each thread makes its share of
//     the rows in the team's one buffer (whole groups of the panel GEMM's tile rows), and a barrier follows (nine
//     per layer). The data's pointers and sizes are checked once, when DecodeWeights is built.
//   op by op: otherwise (the bf16 matmul above kStepRows rows), each op of cpu_fused.cpp called in turn on
//     tensors.
// At one row the op-by-op form left the second thread waiting ~45% of a w8a8 step of SmolLM2 (perf, 2-core
// AMD Zen 4): each of the 120 linears' calls checked its tensors, allocated its output and quantized its
// input on one thread, every cache cold after the weights streamed past, and forked a parallel region. At 16
// rows the second thread still waited 16% of the step in libgomp, and the one region made it 5% shorter (15.98
// against 15.10 ms; 4 rows 6.88 against 6.39, 64 rows 64.27 against 61.07; w8a8, interleaved processes).

#include <ATen/ops/empty.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "cpu_common.h"
#include "cpu_decode_weights.h"

namespace disagg_cpu {

// A linear op by op, for any rows: the panel GEMM where the weight is panels (3-D: pack_panels), the bf16
// matmul where it is pairs (4-D bf16: pack_bf16_pairs), the int8 matmul where it is quads (4-D uint8:
// pack_int8_quads; its input quantized per `block` of k), else the gemv (gemv_w8 where it has a scale); n: its
// outputs
at::Tensor run_linear(const at::Tensor& in, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      const c10::optional<at::Tensor>& scale, int64_t n, int64_t block,
                      const c10::optional<at::Tensor>& residual) {
  if (weight.dim() == 3) return gemm_panels(in, weight, n, bias, residual, scale);
  if (weight.dim() == 4 && weight.scalar_type() == at::kByte) {
    TORCH_CHECK(scale.has_value(), "decode_layers: int8 quads need their scale");
    return gemm_int8(in, weight, *scale, n, block, bias, residual);
  }
  if (weight.dim() == 4) return gemm_bf16(in, weight, n, bias, residual);
  return scale.has_value() ? gemv_w8(in, weight, *scale, bias, residual) : gemv(in, weight, bias, residual);
}

// A dense decoder layer's decode step for a few rows (a Llama / Qwen2 / Qwen3 layer whose linears
// run as the gemv or the panel GEMM), as the torch modules compute it:
//   h = x + o_proj(decode_attention(qkv_proj(rms_norm(x))))
//   out = h + down_proj(silu_and_mul(gate_up_proj(rms_norm(h))))
// w: the layer's kLayerWeights entries of decode_layers' list, in the order named there; with a scale a
// linear's weight is int8 (w8 or w8a8), else float32 or bf16 (run_linear).
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
  // the linear of weight w_i, bias b_i and scale s_i with n outputs
  const auto linear = [&](const at::Tensor& in, int64_t wi, int64_t bi, int64_t si, int64_t n,
                          const c10::optional<at::Tensor>& residual) {
    return run_linear(in, need(wi), opt(bi), opt(si), n, block, residual);
  };
  const int64_t hidden = x.size(1), width = (heads + 2 * kv_heads) * k_cache.size(-1);
  const at::Tensor& down = need(10);  // its in-features: the MLP's width (gate_up has twice as many outputs)
  const int64_t inter = down.dim() == 4   ? down.size(1) * down.size(3)  // bf16 pairs or int8 quads of k
                        : down.dim() == 3 ? down.size(1)
                                          : down.size(-1);
  const at::Tensor qkv = linear(rms_norm(x, need(0), eps), 2, 3, 12, width, none);
  const at::Tensor attn =
      decode_attention(qkv, cos, sin, opt(4), opt(5), eps, k_cache, v_cache, out_loc, slots, seq_lens, heads, kv_heads, scale, c10::nullopt);
  const at::Tensor h = linear(attn, 6, 7, 13, hidden, x);
  const at::Tensor gate_up = linear(rms_norm(h, need(1), eps), 8, 9, 14, 2 * inter, none);
  return linear(silu_and_mul(gate_up), 10, 11, 15, hidden, h);
}

// What a linear of the one-region step reads: x [rows, L.k]; where L is the panel GEMM, x's rows packed for its
// tiles (pack_rows); at more than kStepRows rows where L is the int8 matmul, x quantized by the team (else each
// thread quantizes or rounds x itself)
struct LinearInput {
  const float* x;
  const QuantizedRows* q = nullptr;
  const float* packed = nullptr;
};

bool is_panels(const Linear& L) {
  return L.kernel == Kernel::panels_f32 || L.kernel == Kernel::panels_bf16 || L.kernel == Kernel::panels_w8;
}

// linear L's outputs (n of them) for `in`'s rows over the ranges the calling thread takes from `claims`
void linear_part(const Linear& L, int64_t n, LinearInput in, int64_t rows, const float* residual, float* out,
                 int64_t block, Claims& claims) {
  const float* x = in.x;
  int64_t begin, end;
  switch (L.kernel) {
    case Kernel::gemv_f32:
      while (claims.take(begin, end))
        gemv_part(x, rows, static_cast<const float*>(L.w), nullptr, L.bias, residual, out, n, L.k, begin, end);
      return;
    case Kernel::gemv_bf16:
      while (claims.take(begin, end))
        gemv_part(x, rows, static_cast<const c10::BFloat16*>(L.w), nullptr, L.bias, residual, out, n, L.k, begin, end);
      return;
    case Kernel::gemv_w8:
      while (claims.take(begin, end))
        gemv_part(x, rows, static_cast<const int8_t*>(L.w), L.scale, L.bias, residual, out, n, L.k, begin, end);
      return;
    case Kernel::int8_quads:
      if (in.q != nullptr)
        return int8_rows_part(*in.q, rows, static_cast<const uint8_t*>(L.w), L.scales, L.blocks, L.bias, residual, out,
                              n, L.k, block, claims);
      return int8_part(x, rows, static_cast<const uint8_t*>(L.w), L.scales, L.blocks, L.bias, residual, out, n, L.k,
                       block, claims);
    case Kernel::bf16_pairs:
      return bf16_part(x, rows, static_cast<const uint16_t*>(L.w), L.bias, residual, out, n, L.k, claims);
    case Kernel::panels_f32:
      return panels_part(in.packed, rows, static_cast<const float*>(L.w), nullptr, L.bias, residual, out, n, L.k, claims);
    case Kernel::panels_bf16:
      return panels_part(in.packed, rows, static_cast<const c10::BFloat16*>(L.w), nullptr, L.bias, residual, out, n,
                         L.k, claims);
    case Kernel::panels_w8:
      return panels_part(in.packed, rows, static_cast<const int8_t*>(L.w), L.scale, L.bias, residual, out, n, L.k,
                         claims);
  }
}

// thread t's part of linear L's n outputs: its static share (the head's, whose argmax reads its own columns)
void linear_share(const Linear& L, int64_t n, LinearInput in, int64_t rows, const float* residual, float* out,
                  int64_t block, int64_t t, int64_t team) {
  int64_t begin, end;
  share(L.count != 0 ? L.count : n, t, team, begin, end);
  Claims mine = Claims::range(begin, end);
  linear_part(L, n, in, rows, residual, out, block, mine);
}

// The one-region step's phases whose work its threads claim as they go (kOwned their own), per layer:
// qkv_proj, the attention's tasks, o_proj, gate_up_proj, down_proj
constexpr int64_t kClaimedPhases = 5;

// A linear's outputs claimed by the team as it goes (Claims::guided): the matmuls' panels at least two at a time
// (the int8 matmul's two streams at one row), the gemv's weight rows eight
Claims linear_claims(const Linear& L, int64_t n, std::atomic<int64_t>& next, int64_t t, int64_t team) {
  return L.count != 0 ? Claims::guided(next, L.count, 2, t, team) : Claims::guided(next, n, 8, t, team);
}

// thread t of `team`: the columns [c0, c1) of linear L's n outputs that linear_share gives it
void share_columns(const Linear& L, int64_t n, int64_t t, int64_t team, int64_t& c0, int64_t& c1) {
  share(L.count != 0 ? L.count : n, t, team, c0, c1);
  if (L.count != 0) c0 = std::min(c0 * kPanel, n), c1 = std::min(c1 * kPanel, n);
}

// What the one-region step writes after the last layer, where decode_logits asks: the normed rows [rows,
// hidden], their logits [rows, vocab] and, where `tokens` is given, each row's argmax
struct HeadOut {
  const Head* head = nullptr;
  float *normed = nullptr, *logits = nullptr;
  int64_t* tokens = nullptr;
};

// The one-region step (see the top): x [rows, hidden] through every layer into out, then `ho`'s head where
// it has one; `a`: the attention's batch-wide data (the layers' caches, norms, qkv and output set per layer
// here). A linear's input (a norm's rows, the attention's merged parts, SiLU-and-mul's) is made by each thread
// for all rows in its own buffer at up to kStepRows rows; at more, each thread makes its share of the rows in
// one buffer of the team's (quantized there where the linear is the int8 matmul), and a barrier follows.
void step_in_one_region(const std::vector<Layer>& layers, const float* x, int64_t rows, int64_t hidden, int64_t width,
                        float eps, at::TensorList k_caches, at::TensorList v_caches, Attention a, int64_t block,
                        float* out, const HeadOut& ho) {
  const int64_t inter = layers[0].down.k, heads_d = a.heads * a.d, count = static_cast<int64_t>(layers.size());
  // (every layer's MLP is that wide: DecodeWeights takes no other for this step)
  const bool many = rows > kStepRows;
  const int64_t widest = std::max({hidden, inter, heads_d});  // of a linear's inputs
  const std::vector<int64_t> starts = task_starts(a);
  const int64_t tasks = starts.back(), partial = tasks * partial_floats(a);
  thread_local std::vector<float> scratch;  // the calling thread's, reused: what every thread reads
  const int64_t packed_size = packed_floats(rows, widest);  // a linear's input packed for the panel GEMM
  scratch.resize(rows * (width + 2 * hidden + 2 * inter) + partial + (many ? rows * widest + packed_size : 0));
  float *qkv = scratch.data(), *h = qkv + rows * width, *tmp = h + rows * hidden, *gate_up = tmp + rows * hidden;
  a.starts = starts.data(), a.partial = gate_up + rows * 2 * inter;
  float* shared = a.partial + partial;  // many rows: the linears' inputs, made by the team (and packed)
  float* shared_packed = shared + (many ? rows * widest : 0);
  thread_local QuantizedRows quantized_rows;  // and quantized, where a linear is the int8 matmul
  QuantizedRows& quantized = quantized_rows;  // (the calling thread's, for the whole team)
  if (many && block > 0) quantized.size(rows, widest, block);
  // a decode (this step's only kind): each token's new K and V are read by its own last part only, which writes
  // them first (no pass and barrier of their own: 4.95 against 5.03 ms a step at 64 slots, 7.74 against 7.94 at
  // 1,024, faster in 8 of 12 interleaved rounds each; w8a8 SmolLM2, 2-core Zen 4)
  a.write_own = true;
  std::vector<void*> kc(count), vc(count);
  for (int64_t l = 0; l < count; ++l) kc[l] = k_caches[l].data_ptr(), vc[l] = v_caches[l].data_ptr();
  const int team = omp_in_parallel() ? 1 : omp_get_max_threads();
  std::vector<Best> found(ho.tokens != nullptr ? rows * team : 0);  // the argmax: each thread's best, per row
  const int64_t k = ho.tokens != nullptr && ho.head != nullptr && !many ? ho.head->candidates : 0;
  std::vector<Best> found_k(rows * team * k);  // by candidates: each thread's k best, per row
  std::vector<char> finite(k > 0 ? rows * team : 0);  // and whether its share of the row was all finite
  std::vector<std::atomic<int64_t>> claimed(count * kClaimedPhases);  // each phase's claims' counter, from 0
#pragma omp parallel num_threads(team)
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    thread_local std::vector<float> mine, attn, packed;  // few rows: this thread's normed rows, then its SiLU-and-mul
    mine.resize(many ? 0 : rows * std::max(hidden, inter));  // rows; its attention; a linear's input packed
    attn.resize(many ? 0 : rows * heads_d);
    packed.resize(many ? 0 : packed_size);
    int64_t r0 = 0, r1 = 0;  // many rows: the rows this thread made of the last input
    // linear L's input of `cols` columns, its rows [b, e) made into `dst` by fill(b, e, dst)
    const auto input = [&](const Linear& L, int64_t cols, float* own, const auto& fill) -> LinearInput {
      const bool panels = is_panels(L);
      if (!many) {
        fill(0, rows, own);
        if (panels) pack_rows(own, rows, 0, rows, cols, packed.data());
        return {own, nullptr, panels ? packed.data() : nullptr};
      }
      // the panel GEMM's packed input: whole groups of its tile's rows each (rows split between two threads
      // wrote the same cache lines: a 16-row fp32 step of SmolLM2 took 37.6 ms against 32.1 op by op; 30.6 by
      // groups, 2-core AMD Zen 4, interleaved in one process). The int8 matmul's quads, whose groups are smaller
      // and their words four bytes, go by rows: by groups, 14.19 against 13.89 ms at 16 rows (w8a8)
      const int64_t unit = panels ? panel_group(rows) : 1;
      share((rows + unit - 1) / unit, t, threads, r0, r1);
      r0 = std::min(rows, r0 * unit), r1 = std::min(rows, r1 * unit);
      fill(r0, r1, shared);
      const bool quads = L.kernel == Kernel::int8_quads;
      if (quads) quantize_into(shared, r0, r1, cols, block, quantized);
      if (panels) pack_rows(shared, rows, r0, r1, cols, shared_packed);
#pragma omp barrier
      return {shared, quads ? &quantized : nullptr, panels ? shared_packed : nullptr};
    };
    const auto normed = [&](const float* rows_in, const float* weight) {
      return [=](int64_t b, int64_t e, float* dst) {
        for (int64_t r = b; r < e; ++r) rms_row(rows_in + r * hidden, weight, eps, hidden, dst + r * hidden);
      };
    };
    int64_t begin, end;
    for (int64_t l = 0; l < count; ++l) {
      const Layer& L = layers[l];
      const float* in = l == 0 ? x : ((count - l) % 2 == 0 ? out : tmp);  // the previous layer's `out_l`
      float* out_l = (count - 1 - l) % 2 == 0 ? out : tmp;
      std::atomic<int64_t>* counters = claimed.data() + l * kClaimedPhases;
      LinearInput li = input(L.qkv, hidden, mine.data(), normed(in, L.input_norm));
      Claims claims = linear_claims(L.qkv, width, counters[0], t, threads);
      linear_part(L.qkv, width, li, rows, nullptr, qkv, block, claims);
#pragma omp barrier
      Attention la = a;
      la.qkv = qkv, la.k_cache = kc[l], la.v_cache = vc[l], la.q_norm = L.q_norm, la.k_norm = L.k_norm;
      claims = Claims::guided(counters[1], tasks, 1, t, threads);
      while (claims.take(begin, end)) attend(la, begin, end);
#pragma omp barrier
      li = input(L.o, heads_d, attn.data(), [&](int64_t b, int64_t e, float* dst) { merge(la, b, e, dst); });
      claims = linear_claims(L.o, hidden, counters[2], t, threads);
      linear_part(L.o, hidden, li, rows, in, h, block, claims);
#pragma omp barrier
      li = input(L.gate_up, hidden, mine.data(), normed(h, L.post_norm));
      claims = linear_claims(L.gate_up, 2 * inter, counters[3], t, threads);
      linear_part(L.gate_up, 2 * inter, li, rows, nullptr, gate_up, block, claims);
#pragma omp barrier
      li = input(L.down, inter, mine.data(), [&](int64_t b, int64_t e, float* dst) {
        for (int64_t r = b; r < e; ++r) silu_row(gate_up + r * 2 * inter, inter, dst + r * inter);
      });
      claims = linear_claims(L.down, hidden, counters[4], t, threads);
      linear_part(L.down, hidden, li, rows, h, out_l, block, claims);
#pragma omp barrier
    }
    if (ho.head != nullptr) {  // the last layer wrote `out`
      const Head& hd = *ho.head;
      const Linear& lm = hd.lm;
      const LinearInput li = input(lm, hidden, mine.data(), normed(out, hd.norm));
      if (t == 0 && !many) std::copy(mine.data(), mine.data() + rows * hidden, ho.normed);
      if (many) std::copy(shared + r0 * hidden, shared + r1 * hidden, ho.normed + r0 * hidden);
      bool whole = true;  // the float32 head over the whole vocabulary (else the candidates settled every row)
      if (k > 0) {  // each thread's candidates from the bf16 head's logits
        linear_share(hd.approx, lm.n, li, rows, nullptr, ho.logits, block, t, threads);
        int64_t c0, c1;
        share_columns(hd.approx, lm.n, t, threads, c0, c1);
        for (int64_t r = 0; r < rows; ++r) {
          Best* tops = found_k.data() + (r * threads + t) * k;
          finite[r * threads + t] = top_candidates(ho.logits + r * lm.n + c0, std::max<int64_t>(c1 - c0, 0), c0, k, tops);
        }
#pragma omp barrier
        if (t == 0) {
          for (int64_t r = 0; r < rows; ++r) {
            const float* hr = mine.data() + r * hidden;
            const bool ok = std::all_of(finite.begin() + r * threads, finite.begin() + (r + 1) * threads,
                                        [](char f) { return f != 0; });
            ho.tokens[r] = !ok ? -1
                               : settle_candidates(found_k.data() + r * threads * k, threads * k, k,
                                                   candidates_bound(hr, hidden, hd.weight_err, hd.low_norm), hr, hidden,
                                                   static_cast<const float*>(lm.w), ho.logits + r * lm.n, lm.n);
          }
        }
#pragma omp barrier
        whole = std::any_of(ho.tokens, ho.tokens + rows, [](int64_t id) { return id < 0; });
      }
      if (whole) {
        linear_share(lm, lm.n, li, rows, nullptr, ho.logits, block, t, threads);
      }
      if (whole && ho.tokens != nullptr) {  // the best of this thread's columns, while they are in its cache
        int64_t c0, c1;
        share_columns(lm, lm.n, t, threads, c0, c1);
        for (int64_t r = 0; r < rows; ++r)
          found[r * threads + t] = c0 < c1 ? best_of(ho.logits + r * lm.n + c0, c1 - c0, c0) : Best{0.f, -1};
#pragma omp barrier
        if (t == 0) {  // the threads' columns in order: the first of equals is the lowest thread's
          for (int64_t r = 0; r < rows; ++r) {
            if (k > 0 && ho.tokens[r] >= 0) continue;  // settled by its candidates
            Best b = found[r * threads];
            for (int64_t u = 1; u < threads; ++u) b = better(b, found[r * threads + u]);
            ho.tokens[r] = b.index;
          }
        }
      }
    }
  }
}

// whether the one-region step runs linear L at `rows` rows (the bf16 matmul: at up to kStepRows, which it rounds
// per thread)
bool region_runs(const Linear& L, int64_t rows) { return rows <= kStepRows || L.kernel != Kernel::bf16_pairs; }

// decode_layers' checks of the one-region step's call (the weights' own were made when they were built)
bool one_region_takes(const DecodeWeights& weights, const at::Tensor& x, at::TensorList k_caches,
                      at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                      int64_t kv_heads, int64_t block) {
  const int64_t rows = x.size(0);
  if (weights.layers.empty() || rows < 1 || rows > kRegionRows) return false;
  for (const Layer& L : weights.layers)
    for (const Linear* lin : {&L.qkv, &L.o, &L.gate_up, &L.down})
      if (!region_runs(*lin, rows)) return false;
  check_f32(x, "decode_layers: x");
  check_f32(cos, "decode_layers: cos");
  check_f32(sin, "decode_layers: sin");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == weights.hidden, "decode_layers: x [R, hidden] expected");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "decode_layers: heads must be a multiple of kv_heads");
  const at::Tensor& k0 = k_caches[0];
  TORCH_CHECK(k0.dim() == 3 && k0.size(1) == kv_heads && k0.size(2) % 2 == 0,
              "decode_layers: caches [slots, kv_heads, head_dim] expected, head_dim even");
  for (size_t l = 0; l < k_caches.size(); ++l) {
    check_kv_caches(k_caches[l], v_caches[l], "decode_layers");
    for (const at::Tensor* c : {&k_caches[l], &v_caches[l]}) {
      TORCH_CHECK(c->sizes() == k0.sizes() && c->scalar_type() == k0.scalar_type(),
                  "decode_layers: every cache of one shape and dtype expected");
    }
  }
  const int64_t d = k0.size(2), width = (heads + 2 * kv_heads) * d;
  TORCH_CHECK(cos.numel() == rows * d && sin.numel() == rows * d, "decode_layers: cos / sin [R, head_dim] expected");
  for (const Layer& L : weights.layers) {
    const Linear& q = L.qkv;
    TORCH_CHECK(q.n != 0 ? q.n == width : q.count == (width + kPanel - 1) / kPanel,
                "decode_layers: qkv_proj's outputs are not (heads + 2 kv_heads) head_dim");
    TORCH_CHECK(L.o.k == heads * d, "decode_layers: o_proj's inputs are not heads * head_dim");
    TORCH_CHECK(L.q_norm == nullptr || L.q_norm_n == d, "decode_layers: q_norm [head_dim] expected");
    TORCH_CHECK(L.k_norm == nullptr || L.k_norm_n == d, "decode_layers: k_norm [head_dim] expected");
    for (const Linear* lin : {&L.qkv, &L.o, &L.gate_up, &L.down})
      TORCH_CHECK(
          lin->kernel != Kernel::int8_quads || (block > 0 && block % 4 == 0 && (lin->k / lin->blocks) % block == 0),
          "decode_layers: the int8 matmul's block must be a multiple of 4 dividing its scales' blocks of k, got ",
          block);
  }
  return true;
}

// The attention's batch-wide data of a one-region step (its per-layer fields are set in the step)
Attention step_attention(const at::Tensor& x, at::TensorList k_caches, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& out_loc, const at::Tensor& slots, const at::Tensor& seq_lens, int64_t heads,
                         int64_t kv_heads, double eps, double scale) {
  const int64_t rows = x.size(0);
  check_slots(out_loc, slots, seq_lens, c10::nullopt, rows, k_caches[0].size(0));
  Attention a;
  a.cos = cos.data_ptr<float>(), a.sin = sin.data_ptr<float>();
  a.out_loc = out_loc.data_ptr<int64_t>(), a.slots = slots.data_ptr<int64_t>(), a.seq_lens = seq_lens.data_ptr<int64_t>();
  a.kv_bf16 = k_caches[0].scalar_type() == at::kBFloat16;
  a.tokens = rows, a.heads = heads, a.kv_heads = kv_heads, a.d = k_caches[0].size(2), a.s_max = slots.size(1);
  a.eps = static_cast<float>(eps), a.scale = static_cast<float>(scale);
  return a;
}

// Every layer's decode step in turn, in one call: between layers no Python runs (measured on a 2-core
// AMD EPYC: ~60 us of interpreter per layer when each layer was its own call, the weights' stream
// having pushed the interpreter's working set out of the caches). block: the int8 matmul's block of k
// (w8a8; unused by the other layouts).
at::Tensor decode_layers(const at::Tensor& x, const c10::intrusive_ptr<DecodeWeights>& weights,
                         at::TensorList k_caches, at::TensorList v_caches, double eps, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& out_loc, const at::Tensor& slots,
                         const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads, double scale, int64_t block) {
  const int64_t layers = weights->count();
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && v_caches.size() == k_caches.size(),
              "decode_layers: a K and V cache per layer of the weights expected");
  if (one_region_takes(*weights, x, k_caches, v_caches, cos, sin, heads, kv_heads, block)) {
    const Attention a = step_attention(x, k_caches, cos, sin, out_loc, slots, seq_lens, heads, kv_heads, eps, scale);
    at::Tensor out = at::empty({x.size(0), weights->hidden}, x.options());
    step_in_one_region(weights->layers, x.data_ptr<float>(), x.size(0), weights->hidden, (heads + 2 * kv_heads) * a.d,
                       static_cast<float>(eps), k_caches, v_caches, a, block, out.data_ptr<float>(), HeadOut{});
    return out;
  }
  at::Tensor h = x.contiguous();
  for (int64_t l = 0; l < layers; ++l) {
    h = decode_layer(h, weights->w, l * kLayerWeights, eps, cos, sin, k_caches[l], v_caches[l], out_loc, slots,
                     seq_lens, heads, kv_heads, scale, block);
  }
  return h;
}

// decode_layers' step, then the final norm and the lm_head the weights hold (set_head): (the normed rows
// [R, D], their logits [R, vocab], with `greedy` each row's argmax [R] (torch.argmax's: the first of the
// largest, or the first NaN), else an empty tensor). A greedy step that finds its tokens by candidates
// (set_greedy) leaves in the logits the bf16 head's approximate ones, but at the candidates' ids. In the
// one-region form the head runs in the same region, each thread finding the best of its own share of the
// logits (or its candidates); op by op, after the layers' ops. At
// one row of a w8a8 SmolLM2 the final norm, the lm_head's call and the argmax, each a call of its own, cost
// ~0.14 ms after the step's weights streamed past (2-core AMD Zen 4).
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_logits(
    const at::Tensor& x, const c10::intrusive_ptr<DecodeWeights>& weights, at::TensorList k_caches,
    at::TensorList v_caches, double eps, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& out_loc,
    const at::Tensor& slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads, double scale, int64_t block,
    bool greedy) {
  TORCH_CHECK(!weights->head_w.empty(), "decode_logits: the weights hold no head (set_head)");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == weights->count() && v_caches.size() == k_caches.size(),
              "decode_logits: a K and V cache per layer of the weights expected");
  const int64_t rows = x.size(0), hidden = weights->hidden, vocab = weights->head_n;
  const Head* head = weights->head.has_value() ? &*weights->head : nullptr;
  if (head == nullptr || !region_runs(head->lm, rows) ||
      !one_region_takes(*weights, x, k_caches, v_caches, cos, sin, heads, kv_heads, block)) {
    const at::Tensor h = decode_layers(x, weights, k_caches, v_caches, eps, cos, sin, out_loc, slots, seq_lens, heads,
                                       kv_heads, scale, block);
    const std::vector<c10::optional<at::Tensor>>& hw = weights->head_w;  // norm, weight, scale?
    at::Tensor normed = rms_norm(h, *hw[0], eps);
    at::Tensor logits = run_linear(normed, *hw[1], c10::nullopt, hw[2], vocab, block, c10::nullopt);
    return {normed, logits, greedy ? argmax_rows(logits) : at::empty({0}, x.options().dtype(at::kLong))};
  }
  TORCH_CHECK(head->lm.kernel != Kernel::int8_quads || (head->lm.k / head->lm.blocks) % block == 0,
              "decode_logits: the int8 matmul's block must divide the lm_head's scales' blocks of k, got ", block);
  const Attention a = step_attention(x, k_caches, cos, sin, out_loc, slots, seq_lens, heads, kv_heads, eps, scale);
  at::Tensor last = at::empty({rows, hidden}, x.options()), normed = at::empty({rows, hidden}, x.options());
  at::Tensor logits = at::empty({rows, vocab}, x.options());
  at::Tensor tokens = at::empty({greedy ? rows : 0}, x.options().dtype(at::kLong));
  HeadOut ho;
  ho.head = head, ho.normed = normed.data_ptr<float>(), ho.logits = logits.data_ptr<float>();
  ho.tokens = greedy ? tokens.data_ptr<int64_t>() : nullptr;
  step_in_one_region(weights->layers, x.data_ptr<float>(), rows, hidden, (heads + 2 * kv_heads) * a.d,
                     static_cast<float>(eps), k_caches, v_caches, a, block, last.data_ptr<float>(), ho);
  return {normed, logits, tokens};
}

// A greedy decode step on the decode service's own buffers: each row's pending token read from token_ids [N] at
// `rows` [B], its position the row's committed KV length (kv_lens [B]), its slots the row of req_to_token; the
// step as decode_logits runs it, with `embed` [V, hidden] for the input and the rotary tables (cos and signed
// sin [P, head_dim]) for its position; each row's argmax written back to token_ids at its row and returned [B].
// k_all / v_all: every layer's cache [layers, slots, kv_heads, head_dim] (the pool's one buffer each).
at::Tensor greedy_step(const at::Tensor& token_ids, const at::Tensor& rows, const at::Tensor& req_to_token,
                       const at::Tensor& kv_lens, const at::Tensor& embed, const at::Tensor& cos_table,
                       const at::Tensor& sin_table, const c10::intrusive_ptr<DecodeWeights>& weights,
                       const at::Tensor& k_all, const at::Tensor& v_all, double eps, int64_t heads, int64_t kv_heads,
                       double scale, int64_t block) {
  TORCH_CHECK(k_all.dim() == 4 && k_all.size(0) == weights->count() && v_all.dim() == 4 && v_all.size(0) == k_all.size(0),
              "greedy_step: caches [layers, slots, kv_heads, head_dim] for every layer of the weights expected");
  const StepInputs in = step_inputs(token_ids, rows, req_to_token, kv_lens, embed, cos_table, sin_table, k_all.size(1));
  const std::vector<at::Tensor> k_caches = k_all.unbind(0), v_caches = v_all.unbind(0);
  const at::Tensor tokens = std::get<2>(decode_logits(in.x, weights, k_caches, v_caches, eps, in.cos, in.sin, in.out_loc,
                                                      in.slots, in.seq_lens, heads, kv_heads, scale, block, true));
  stash_tokens(token_ids, rows, tokens);
  return tokens;
}

}  // namespace disagg_cpu

using namespace disagg_cpu;

TORCH_LIBRARY_FRAGMENT(disagg_cpu_fused, m) {
  m.class_<DecodeWeights>("DecodeWeights")
      .def(torch::init<c10::List<c10::optional<at::Tensor>>>())
      .def("one_region", [](const c10::intrusive_ptr<DecodeWeights>& self) { return !self->layers.empty(); })
      .def("set_head", &DecodeWeights::set_head)
      .def("set_greedy", &DecodeWeights::set_greedy)
      .def("greedy_by_candidates", &DecodeWeights::greedy_by_candidates);
  m.def(
      "decode_layers(Tensor x, __torch__.torch.classes.disagg_cpu_fused.DecodeWeights weights, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, float eps, Tensor cos, Tensor sin, Tensor out_loc, Tensor slots, Tensor seq_lens, "
      "int heads, int kv_heads, float scale, int block=0) -> Tensor",
      &decode_layers);
  m.def(
      "decode_logits(Tensor x, __torch__.torch.classes.disagg_cpu_fused.DecodeWeights weights, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, float eps, Tensor cos, Tensor sin, Tensor out_loc, Tensor slots, Tensor seq_lens, "
      "int heads, int kv_heads, float scale, int block, bool greedy) -> (Tensor, Tensor, Tensor)",
      &decode_logits);
  m.def(
      "greedy_step(Tensor(c!) token_ids, Tensor rows, Tensor req_to_token, Tensor kv_lens, Tensor embed, "
      "Tensor cos_table, Tensor sin_table, __torch__.torch.classes.disagg_cpu_fused.DecodeWeights weights, "
      "Tensor(a!) k_all, Tensor(b!) v_all, float eps, int heads, int kv_heads, float scale, int block) -> Tensor",
      &greedy_step);
}
