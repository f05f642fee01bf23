// The GEMM of the fused CPU ops for many rows (a prefill chunk, a large decode batch; registered in
// cpu_fused.cpp):
//   pack_panels(w [N, K])                          -> [ceil(N / P), K, P]: w's rows in panels of P output
//     columns (P = two SIMD vectors), each panel k-major (the P columns' weights of one k side by side,
//     one cache line on AVX2), the last panel zero-padded; made once per weight
//     (common/models/packed_linear.py's `panels` layout), in w's dtype: float32, or bfloat16 or int8 (the
//     weight-only formats: common/models/low_precision.py), whose weights the tiles widen to float as they load;
//   gemm_panels(x [R, K], panels, N, bias?, residual?, scale?) -> residual + (x @ w.T) * scale + bias [R, N]
//     (scale [N]: int8 panels' scale per output row).
// A tile of T x rows by one panel keeps 2T accumulators in registers: per k it loads the panel's two
// vectors and broadcasts T x values, 2T FMAs for 2 + T loads (T up to 6 on AVX2, 12 on AVX-512), the
// register blocking of BLIS-like kernels; x's rows go in tiles as even as that many make them (panel_group:
// 16 rows as 8 + 8, whose FMAs one core kept at its peak on panels in cache, 58.8 GMAC/s, against 47.4 as
// 12 + 4; 64 rows as 11s, 58.9 against 55.4; 2-core AMD Zen 4, one thread). MKL's and oneDNN's GEMMs, called per linear, re-lay the
// weight on every call at these row counts; the panels are laid out once. Each thread owns a run of
// panels; rows go by in chunks that stay in L2 while the thread's panels stream past. Every output is
// one running sum over k in order (another summation order than F.linear's: equal within fp32 rounding).

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <utility>

#include "cpu_common.h"

namespace disagg_cpu {

constexpr int64_t kRowChunk = 16;  // x groups per pass over a thread's panels (16 x 12 rows of K = 1536: 1.2 MB)

int64_t panel_group(int64_t rows) {
  const int64_t groups = (rows + kTileRows - 1) / kTileRows;
  return (rows + groups - 1) / groups;
}

// out[r, col0 + c] for r < T, c < min(P, n - col0): T rows of x against one panel [k, P]; x is a
// group of packed rows [k, g] (the group's T first rows); `next`: the panel to fetch meanwhile
// (panel_walk)
template <int T, typename W>
inline void panel_tile(const float* x, int64_t g, const W* panel, const float* scale, const float* bias,
                       const float* residual, float* out, int64_t n, int64_t k, int64_t col0, const W* next = nullptr) {
  vec acc[T][2];
  for (int r = 0; r < T; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t i = 0; i < k; ++i) {
    const vec w0 = vload(panel + i * kPanel), w1 = vload(panel + i * kPanel + kLanes);
    if (next != nullptr) {
      __builtin_prefetch(next + i * kPanel);
      if constexpr (kPanel * sizeof(W) > 64) __builtin_prefetch(next + i * kPanel + 16);  // two cache lines per k
    }
    for (int r = 0; r < T; ++r) {
      const vec xv = vset1(x[i * g + r]);
      acc[r][0] = vfma(w0, xv, acc[r][0]);
      acc[r][1] = vfma(w1, xv, acc[r][1]);
    }
  }
  store_tile(acc, std::min<int64_t>(kPanel, n - col0), scale, bias, residual, out, n, col0);
}

// a tile of `rows` (<= T) rows: panel_tile of that many
template <int T, typename W>
inline void panel_tile_of(int64_t rows, const float* x, int64_t g, const W* panel, const float* scale,
                          const float* bias, const float* residual, float* out, int64_t n, int64_t k, int64_t col0,
                          const W* next) {
  if constexpr (T > 0) {
    if (rows == T) return panel_tile<T>(x, g, panel, scale, bias, residual, out, n, k, col0, next);
    panel_tile_of<T - 1, W>(rows, x, g, panel, scale, bias, residual, out, n, k, col0, next);
  }
}

template <typename W>
void pack_into(const W* src, W* dst, int64_t n, int64_t k) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  parallel_range(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c)
        for (int64_t i = 0; i < k; ++i) dst[(p * k + i) * kPanel + c] = src[(p * kPanel + c) * k + i];
  });
}

at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "pack_panels: w [N, K]");
  const auto type = w.scalar_type();
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kChar),
              "pack_panels: w: contiguous CPU float32, bfloat16 or int8 expected");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor out = at::zeros({panels, k, kPanel}, w.options());
  if (type == at::kBFloat16) pack_into(w.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), n, k);
  else if (type == at::kChar) pack_into(w.data_ptr<int8_t>(), out.data_ptr<int8_t>(), n, k);
  else pack_into(w.data_ptr<float>(), out.data_ptr<float>(), n, k);
  return out;
}

// out [rows, n] from the packed x groups and the panels (panel_walk: each thread a run of panels)
template <typename W>
void panel_rows(const float* pxp, const W* pp, const float* ps, const float* pb, const float* pr, float* po,
                int64_t rows, int64_t n, int64_t k, int64_t count) {
  const int64_t g = panel_group(rows);
  panel_walk(rows, count, g, kRowChunk * g, [&](int64_t r, int64_t t, int64_t p, bool fetch) {
    const W* panel = pp + p * k * kPanel;
    panel_tile_of<kTileRows>(t, pxp + r * k, g, panel, ps, pb, pr == nullptr ? nullptr : pr + r * n, po + r * n, n,
                             k, p * kPanel, fetch ? panel + k * kPanel : nullptr);
  });
}

int64_t packed_floats(int64_t rows, int64_t k) {
  const int64_t g = panel_group(rows);
  return (rows + g - 1) / g * g * k;
}

void pack_rows(const float* x, int64_t rows, int64_t r0, int64_t r1, int64_t k, float* packed) {
  const int64_t g = panel_group(rows);
  for (int64_t row = r0; row < r1; ++row)
    for (int64_t i = 0; i < k; ++i) packed[((row / g) * k + i) * g + row % g] = x[row * k + i];
}

template <typename W>
void panels_part(const float* packed, int64_t rows, const W* panels, const float* scale, const float* bias,
                 const float* residual, float* out, int64_t n, int64_t k, Claims& claims) {
  const int64_t g = panel_group(rows);
  int64_t begin, end;
  while (claims.take(begin, end))  // each panel read once: every row's tiles while it is in cache (panel_walk's order)
    for (int64_t p = begin; p < end; ++p) {
      const W* panel = panels + p * k * kPanel;
      for (int64_t r = 0; r < rows; r += g)
        panel_tile_of<kTileRows>(std::min(g, rows - r), packed + r * k, g, panel, scale, bias,
                                 residual == nullptr ? nullptr : residual + r * n, out + r * n, n, k, p * kPanel,
                                 r == 0 && p + 1 < end ? panel + k * kPanel : nullptr);
    }
}
template void panels_part<float>(const float*, int64_t, const float*, const float*, const float*, const float*, float*,
                                 int64_t, int64_t, Claims&);
template void panels_part<c10::BFloat16>(const float*, int64_t, const c10::BFloat16*, const float*, const float*,
                                         const float*, float*, int64_t, int64_t, Claims&);
template void panels_part<int8_t>(const float*, int64_t, const int8_t*, const float*, const float*, const float*,
                                  float*, int64_t, int64_t, Claims&);

at::Tensor gemm_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(x.dim() == 2 && panels.dim() == 3, "gemm_panels: x [R, K], panels [N / P, K, P]");
  check_f32(x, "gemm_panels: x");
  const auto type = panels.scalar_type();
  TORCH_CHECK(panels.device().is_cpu() && panels.is_contiguous() &&
                  (type == at::kFloat || type == at::kBFloat16 || type == at::kChar),
              "gemm_panels: panels: contiguous CPU float32, bfloat16 or int8 expected");
  TORCH_CHECK(scale.has_value() == (type == at::kChar), "gemm_panels: a scale [N] with int8 panels, and only then");
  const int64_t rows = x.size(0), k = x.size(1), count = panels.size(0);
  TORCH_CHECK(panels.size(1) == k && panels.size(2) == kPanel, "gemm_panels: panels of this build's pack_panels, K = x's");
  TORCH_CHECK(n > 0 && (n + kPanel - 1) / kPanel == count, "gemm_panels: N does not match the panels");
  const Addends add = checked_addends(bias, residual, rows, n, "gemm_panels: bias / residual");
  at::Tensor sc;
  if (scale.has_value()) {
    sc = scale->contiguous();
    check_f32(sc, "gemm_panels: scale");
    TORCH_CHECK(sc.numel() == n, "gemm_panels: scale [N] expected");
  }
  const float* ps = sc.defined() ? sc.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* px = x.data_ptr<float>();
  const float* pb = add.bias_data();
  const float* pr = add.residual_data();
  float* po = out.data_ptr<float>();
  // x's rows in groups of panel_group(rows), k-major ([k, g] each): a tile's x values for one k side by side
  const int64_t g = panel_group(rows);
  at::Tensor packed = at::empty({packed_floats(rows, k)}, x.options());
  float* pxp = packed.data_ptr<float>();
  parallel_range(0, (rows + g - 1) / g, grain_for(k * g), [&](int64_t begin, int64_t end) {
    pack_rows(px, rows, begin * g, std::min(rows, end * g), k, pxp);
  });
  if (type == at::kBFloat16) panel_rows(pxp, panels.data_ptr<c10::BFloat16>(), ps, pb, pr, po, rows, n, k, count);
  else if (type == at::kChar) panel_rows(pxp, panels.data_ptr<int8_t>(), ps, pb, pr, po, rows, n, k, count);
  else panel_rows(pxp, panels.data_ptr<float>(), ps, pb, pr, po, rows, n, k, count);
  return out;
}

}  // namespace disagg_cpu
