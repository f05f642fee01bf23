// decode_layers' weights held once (DecodeWeights, cpu_decode_weights.h): each linear's data checked into the
// kernel and pointers the one-region step runs, the layers', the head's (set_head), the greedy head's candidates
// (set_greedy). Built with cpu_fused.cpp by common/models/cpu_fused.py.

#include <algorithm>

#include "cpu_decode_weights.h"

namespace disagg_cpu {

namespace {

bool f32_vector(const c10::optional<at::Tensor>& t, int64_t n) {
  return t.has_value() && t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous() &&
         t->dim() == 1 && t->numel() == n;
}

// weight w, bias b and scale s as a Linear the one-region step runs with `outputs` outputs and `inputs`
// inputs (0: not known here, the call checks them); false where it cannot (another layout, data that does
// not match)
bool as_linear(const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& b,
               const c10::optional<at::Tensor>& s, int64_t outputs, int64_t inputs, Linear& out) {
  if (!w.has_value() || !w->device().is_cpu() || !w->is_contiguous()) return false;
  const at::Tensor& t = *w;
  const at::ScalarType dtype = t.scalar_type();
  int64_t n = 0;  // the outputs, as far as the data says (0: it does not)
  if (t.dim() == 2 && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar)) {
    out.kernel = dtype == at::kFloat ? Kernel::gemv_f32 : dtype == at::kBFloat16 ? Kernel::gemv_bf16 : Kernel::gemv_w8;
    n = t.size(0), out.k = t.size(1), out.count = 0;
    if (n == 0) return false;
  } else if (t.dim() == 3 && t.size(2) == kPanel && (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar)) {
    out.kernel = dtype == at::kFloat      ? Kernel::panels_f32
                 : dtype == at::kBFloat16 ? Kernel::panels_bf16
                                          : Kernel::panels_w8;  // pack_panels' [N / P, K, P]
    out.count = t.size(0), out.k = t.size(1);
  } else if (t.dim() == 4 && t.size(2) == kPanel && (dtype == at::kByte || dtype == at::kBFloat16) &&
             t.size(3) == (dtype == at::kByte ? 4 : 2)) {
    out.kernel = dtype == at::kByte ? Kernel::int8_quads : Kernel::bf16_pairs;
    out.count = t.size(0), out.k = t.size(1) * t.size(3);
  } else {
    return false;
  }
  if (s.has_value() != (dtype == at::kChar || dtype == at::kByte) || out.k == 0) return false;  // int8: a scale
  const bool quads = out.kernel == Kernel::int8_quads;  // its scales: [count, blocks, kPanel] bf16
  if (quads && (s->dim() != 3 || s->scalar_type() != at::kBFloat16 || !s->device().is_cpu() || !s->is_contiguous() ||
                s->size(0) != out.count || s->size(2) != kPanel || s->size(1) == 0 || out.k % s->size(1) != 0))
    return false;
  for (const c10::optional<at::Tensor>* v : {&s, &b}) {
    if (!v->has_value() || (quads && v == &s)) continue;
    if ((n != 0 && (*v)->numel() != n) || (*v)->numel() == 0) return false;
    n = (*v)->numel();
  }
  if (outputs != 0 && n != 0 && n != outputs) return false;
  if (outputs != 0) n = outputs;
  if ((inputs != 0 && out.k != inputs) || (out.count != 0 && n != 0 && (n + kPanel - 1) / kPanel != out.count))
    return false;
  if ((s.has_value() && !quads && !f32_vector(s, n)) || (b.has_value() && !f32_vector(b, n))) return false;
  out.w = t.data_ptr();
  out.scale = s.has_value() && !quads ? s->data_ptr<float>() : nullptr;
  out.scales = quads ? s->data_ptr<c10::BFloat16>() : nullptr;
  out.blocks = quads ? s->size(1) : 0;
  out.bias = b.has_value() ? b->data_ptr<float>() : nullptr;
  out.n = n;
  return true;
}

}  // namespace

DecodeWeights::DecodeWeights(const c10::List<c10::optional<at::Tensor>>& list) {
  TORCH_CHECK(!list.empty() && static_cast<int64_t>(list.size()) % kLayerWeights == 0,
              "DecodeWeights: ", kLayerWeights, " weights per layer expected, got ", list.size());
  w.reserve(list.size());
  for (const c10::optional<at::Tensor>& t : list) w.push_back(t);
  const auto& first = w[0];
  hidden = first.has_value() ? first->numel() : 0;
  for (int64_t l = 0; l < count(); ++l) {
    const auto entry = [&](int64_t i) -> const c10::optional<at::Tensor>& { return w[l * kLayerWeights + i]; };
    Layer layer;
    const c10::optional<at::Tensor>& down = entry(10);
    const int64_t width = !down.has_value()    ? 0
                          : down->dim() == 2 ? down->size(1)
                          : down->dim() == 3 ? down->size(1)
                          : down->dim() == 4 ? down->size(1) * down->size(3)
                                             : 0;  // the MLP's: down_proj's inputs
    if (l == 0) inter = width;
    bool ok = hidden > 0 && inter > 0 && width == inter;  // one scratch size serves every layer
    ok = ok && f32_vector(entry(0), hidden) && f32_vector(entry(1), hidden);
    ok = ok && as_linear(entry(2), entry(3), entry(12), 0, hidden, layer.qkv);
    ok = ok && as_linear(entry(6), entry(7), entry(13), hidden, 0, layer.o);
    ok = ok && as_linear(entry(8), entry(9), entry(14), 2 * inter, hidden, layer.gate_up);
    ok = ok && as_linear(entry(10), entry(11), entry(15), hidden, inter, layer.down);
    for (int64_t i : {4, 5}) ok = ok && (!entry(i).has_value() || f32_vector(entry(i), entry(i)->numel()));
    if (!ok) {
      layers.clear();
      return;
    }
    layer.input_norm = entry(0)->data_ptr<float>(), layer.post_norm = entry(1)->data_ptr<float>();
    layer.q_norm = entry(4).has_value() ? entry(4)->data_ptr<float>() : nullptr;
    layer.k_norm = entry(5).has_value() ? entry(5)->data_ptr<float>() : nullptr;
    layer.q_norm_n = entry(4).has_value() ? entry(4)->numel() : 0;
    layer.k_norm_n = entry(5).has_value() ? entry(5)->numel() : 0;
    layers.push_back(layer);
  }
}

void DecodeWeights::set_head(const at::Tensor& norm, const at::Tensor& weight, const c10::optional<at::Tensor>& scale,
                           int64_t vocab) {
  TORCH_CHECK(f32_vector(norm, hidden) && vocab > 0,
              "DecodeWeights.set_head: a contiguous float32 norm weight of the layers' width and a vocabulary");
  head.reset();
  head_w = {norm, weight, scale}, head_n = vocab;
  Head h;
  if (layers.empty() || !as_linear(weight, c10::nullopt, scale, vocab, hidden, h.lm)) return;
  h.norm = norm.data_ptr<float>();
  head = h;
}

bool DecodeWeights::set_greedy(const at::Tensor& low, int64_t candidates, double weight_err, double low_norm) {
  TORCH_CHECK(candidates > 0 && weight_err >= 0 && low_norm >= 0, "DecodeWeights.set_greedy: candidates > 0 and "
              "bound terms >= 0 expected");
  if (!head.has_value() || head->lm.kernel != Kernel::gemv_f32 || low.scalar_type() != at::kBFloat16) return false;
  Linear approx;
  if (!as_linear(low, c10::nullopt, c10::nullopt, head_n, hidden, approx) || approx.kernel != Kernel::gemv_bf16)
    return false;
  greedy_w = low;
  head->approx = approx, head->candidates = std::min(candidates, head_n);
  head->weight_err = weight_err, head->low_norm = low_norm;
  return true;
}

}  // namespace disagg_cpu
