// The greedy head in the one-region step (cpu_step.cpp; built with cpu_fused.cpp by common/models/cpu_fused.py):
// the argmax of a float32 model's logits found from approximate logits computed with the lm_head in bf16,
// half its bytes, as common/models/greedy_head.py finds it from Python (its docstring has the bound):
//   each thread keeps the K largest approximate logits of its share of the vocabulary (`top_candidates`);
//   one thread merges them (`settle_candidates`): where the bound proves that the exact argmax is among the K,
//   their exact logits (the float32 lm_head's rows, by the gemv) pick it, the lowest id among equals; else
//   (or where a value is not finite) the row takes the whole float32 lm_head.
// Here the approximate logits are float32 sums of float32 inputs times bf16 weights, so the bound has only the
// weights' rounding and the float32 sum: D = (e + gamma b) |h|, e and b the largest row norms of w - bf16(w) and
// of bf16(w), gamma = 4 H 2^-24. From Python, the head's ~20 torch ops after a batch-1 step took ~1.4 ms
// beyond its bf16 pass (SmolLM2, 2-core AMD Zen 4).

#include <algorithm>
#include <cmath>

#include "cpu_common.h"

namespace disagg_cpu {

namespace {

// the order of candidates: the larger value first, the lower id among equals
inline bool ahead(const Best& a, const Best& b) { return a.value > b.value || (a.value == b.value && a.index < b.index); }

}  // namespace

bool top_candidates(const float* x, int64_t n, int64_t first, int64_t k, Best* out) {
  int64_t held = 0, low = 0;  // out[low]: the smallest held once k are
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    finite = finite && std::isfinite(v);
    if (held < k) {
      out[held++] = {v, first + i};
      if (held == k) low = std::min_element(out, out + k, [](const Best& a, const Best& b) { return ahead(b, a); }) - out;
    } else if (v > out[low].value) {  // equal values keep the lower id: the one already held
      out[low] = {v, first + i};
      low = std::min_element(out, out + k, [](const Best& a, const Best& b) { return ahead(b, a); }) - out;
    }
  }
  for (int64_t i = held; i < k; ++i) out[i] = {-INFINITY, -1};  // a share of fewer than k columns
  return finite;
}

int64_t settle_candidates(Best* found, int64_t count, int64_t k, double bound, const float* h, int64_t hidden,
                          const float* weight, float* logits, int64_t vocab) {
  std::sort(found, found + count, ahead);
  if (found[k - 1].index < 0) return -1;  // fewer than k candidates: the whole head decides
  if (!(static_cast<double>(found[0].value) - found[k - 1].value > 2 * bound)) return -1;
  Best pick{0.f, -1};
  for (int64_t c = 0; c < k; ++c) {  // each candidate's float32 logit, by the gemv as the whole head computes it
    const int64_t id = found[c].index;
    gemv_part(h, 1, weight, nullptr, nullptr, nullptr, logits, vocab, hidden, id, id + 1);
    const Best exact{logits[id], id};
    if (!std::isfinite(exact.value)) return -1;
    if (pick.index < 0 || ahead(exact, pick)) pick = exact;
  }
  return pick.index;
}

double candidates_bound(const float* h, int64_t hidden, double weight_err, double low_norm) {
  double sq = 0;
  for (int64_t i = 0; i < hidden; ++i) sq += static_cast<double>(h[i]) * h[i];
  const double gamma = 4.0 * static_cast<double>(hidden) * std::ldexp(1.0, -24);
  return (weight_err + gamma * low_norm) * std::sqrt(sq) * 1.001 + 1e-6;
}

}  // namespace disagg_cpu
