// decode_layers' weights held once and checked into what the one-region step runs (cpu_decode_weights.cpp;
// cpu_step.cpp runs the step): the linears' kernels and data as pointers, the layers', the head's.
#pragma once

#include <torch/custom_class.h>

#include <vector>

#include "cpu_common.h"

namespace disagg_cpu {

constexpr int64_t kLayerWeights = 16;

// A linear as the one-region step runs it: its kernel, its data and sizes (n: its outputs; 0 where only
// the call knows them: a packed qkv_proj without bias or scale; count: the packed panels)
enum class Kernel { gemv_f32, gemv_bf16, gemv_w8, int8_quads, bf16_pairs, panels_f32, panels_bf16, panels_w8 };
struct Linear {
  Kernel kernel = Kernel::gemv_f32;
  const void* w = nullptr;
  const float *scale = nullptr, *bias = nullptr;  // scale: gemv_w8's and panels_w8's per output row
  const c10::BFloat16* scales = nullptr;           // int8_quads': pack_int8_scales' per column and block
  int64_t n = 0, k = 0, count = 0, blocks = 0;     // blocks: int8_quads' blocks of k
};
struct Layer {
  const float *input_norm = nullptr, *post_norm = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  int64_t q_norm_n = 0, k_norm_n = 0;  // their sizes (a head's, checked by the call)
  Linear qkv, o, gate_up, down;
};
struct Head {  // after the last layer: the final norm, then the lm_head's logits
  const float* norm = nullptr;
  Linear lm;
  // with set_greedy, a greedy step's candidates (cpu_candidates.cpp): the lm_head in bf16 (the gemv's), how many
  // candidates, the bound's weight terms
  Linear approx;
  int64_t candidates = 0;
  double weight_err = 0, low_norm = 0;
};

// decode_layers' weights, held once: per layer input_norm, post_norm, qkv_w, qkv_b?, q_norm?, k_norm?, o_w,
// o_b?, gate_up_w, gate_up_b?, down_w, down_b?, and the four linears' int8 scales? (qkv, o, gate_up, down:
// given with int8 weights, low_precision.py); a linear's weight may be its panels instead (the layout the
// plan picks at the batch's rows). Built once per mix of layouts (cpu_fused.FusedLayers): a Python list of
// them, converted on every call, cost ~0.25 ms of a batch-1 step (its objects cold after the weights
// streamed past: 2-core AMD Zen 4). Where every layer's data is what the one-region step runs, `layers`
// holds it as pointers (the tensors, held in `w`, keep it alive); else it is empty.
struct DecodeWeights : torch::CustomClassHolder {
  std::vector<c10::optional<at::Tensor>> w, head_w;  // head_w: set_head's norm, weight and scale?
  at::Tensor greedy_w;                                // set_greedy's bf16 lm_head
  std::vector<Layer> layers;
  c10::optional<Head> head;  // head_w as pointers, where the one-region step runs it
  int64_t head_n = 0;        // the head's outputs (the vocabulary)
  int64_t hidden = 0, inter = 0;  // every layer's: the model's width and its MLP's
  explicit DecodeWeights(const c10::List<c10::optional<at::Tensor>>& list);
  int64_t count() const { return static_cast<int64_t>(w.size()) / kLayerWeights; }
  // The final norm's weight and the lm_head (weight, int8 scale?, `vocab` outputs, in any layout decode_layer
  // runs) for decode_logits; `head` holds them where the one-region step runs them too
  void set_head(const at::Tensor& norm, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                int64_t vocab);
  // A float32 lm_head's greedy steps by candidates (cpu_candidates.cpp): `low` its weight in bf16 [vocab, hidden],
  // `candidates` how many, e and b the bound's largest row norms of w - bf16(w) and of bf16(w) (greedy_head.py).
  // Held where the one-region step runs the head as the float32 gemv; false (nothing held) elsewhere.
  bool set_greedy(const at::Tensor& low, int64_t candidates, double weight_err, double low_norm);
  // whether a greedy step of `rows` rows finds its tokens by candidates (set_greedy, the one-region step)
  bool greedy_by_candidates(int64_t rows) const {
    return head.has_value() && head->candidates > 0 && !layers.empty() && rows >= 1 && rows <= kStepRows;
  }
};

}  // namespace disagg_cpu
