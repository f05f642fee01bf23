// The few-row GEMV of the fused CPU ops (registered in cpu_fused.cpp):
//   gemv(x [R, K], w [N, K], bias?, residual?) -> residual + x @ w.T + bias [R, N], for a decode step's
//     rows R (up to 64: packed_linear.GEMV_ROWS): each thread streams its own contiguous run of w's rows
//     once (up to 4 rows as a few sequential streams side by side), every x row dotted against each
//     weight row while it is in cache; w float32, or bfloat16 (weight-only bf16: half the bytes, each
//     weight widened to float exactly in registers, so the products and sums are float32's);
//   gemv_w8(x, w int8 [N, K], scale [N], bias?, residual?) -> the same with w * scale (weight-only
//     int8, a scale per output row): a quarter of the bytes streamed, widened to float in registers;
//   stream_sum(x, streams) -> the sum of x, read the same way (bench/floor.py's bandwidth probe);
//   row_streams(n) -> the streams per thread one row's gemv reads (set when n is 1, 2 or 4; 0 asks).

#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>

#include <type_traits>

#include "cpu_common.h"

namespace disagg_cpu {

// rows [begin, end) of out [R, n] = x [R, k] @ w.T (+ bias, + residual): R x rows (in cache) against
// the weight rows as they stream by, the run split into S parts read side by side (S sequential
// streams, far apart: rows begin + s * part + j). One stream per thread ran at ~0.89x the bandwidth of
// a torch.sum over one large buffer on a 2-core AMD EPYC (AVX2); two 0.97-0.99x, four 1.03-1.13x:
// more independent streams keep more cache-line fills in flight. Two accumulators per (row, stream)
// hide the FMA latency; R * S <= 4 keeps them in registers. One row takes row_streams(), which start-up
// picks by timing (cpu_fused.pick_row_streams) and decode's warm-up times again as whole steps
// (fused_plan.py): hosts differ. On a 2-core AMD Zen 4 (AVX-512) with the
// weights on 2 MiB pages (weight_arena.py), an fp32 decode step of SmolLM2 took 19.65 ms with one stream
// against 21.59 with four (faster in 16 interleaved rounds of 16; two: 21.13), a w8 step 6.75 against 7.67
// (16 of 16), a bf16 step 10.29 against 11.32 (11 of 12); the AVX2 host above measured four the faster.
// W: float, c10::BFloat16, or int8_t with `scale` (each row's dot product times scale[row], before bias and residual).
int64_t g_row_streams = 4;  // until start-up picks (set before any step runs)

int64_t row_streams(int64_t streams) {
  TORCH_CHECK(streams == 0 || streams == 1 || streams == 2 || streams == 4, "row_streams: 1, 2 or 4 (0: ask)");
  if (streams != 0) g_row_streams = streams;
  return g_row_streams;
}

template <int R, int S, typename W>
void gemv_rows(const float* x, const W* w, const float* scale, const float* bias, const float* residual, float* out,
               int64_t n, int64_t k, int64_t begin, int64_t end) {
  constexpr int64_t step = 2 * kLanes;
  const int64_t part = (end - begin) / S;
  for (int64_t j = 0; j < part; ++j) {
    const W* ws[S];
    vec acc[S][R][2];
    for (int s = 0; s < S; ++s) {
      ws[s] = w + (begin + s * part + j) * k;
      for (int r = 0; r < R; ++r) acc[s][r][0] = acc[s][r][1] = vzero();
    }
    int64_t i = 0;
    for (; i + step <= k; i += step) {
      for (int r = 0; r < R; ++r) {
        const vec x0 = vload(x + r * k + i), x1 = vload(x + r * k + i + kLanes);
        for (int s = 0; s < S; ++s) {
          acc[s][r][0] = vfma(vload(ws[s] + i), x0, acc[s][r][0]);
          acc[s][r][1] = vfma(vload(ws[s] + i + kLanes), x1, acc[s][r][1]);
        }
      }
    }
    for (int s = 0; s < S; ++s) {
      const int64_t row = begin + s * part + j;
      for (int r = 0; r < R; ++r) {
        float sum = vsum(vadd(acc[s][r][0], acc[s][r][1]));
        for (int64_t t = i; t < k; ++t) sum += static_cast<float>(ws[s][t]) * x[r * k + t];
        if (scale != nullptr) sum *= scale[row];
        if (bias != nullptr) sum += bias[row];
        if (residual != nullptr) sum += residual[r * n + row];
        out[r * n + row] = sum;
      }
    }
  }
  if constexpr (S > 1) gemv_rows<R, 1>(x, w, scale, bias, residual, out, n, k, begin + S * part, end);  // the rest
}

// One (R x rows) x (J weight rows) tile: out[r, j0 + j] for r < R, j < J.
template <int R, int J, typename W>
inline void tile(const float* x, const W* wj, const float* scale, const float* bias, const float* residual,
                 float* out, int64_t n, int64_t k, int64_t j0, const W* next = nullptr) {
  vec acc[R][J];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < J; ++j) acc[r][j] = vzero();
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    vec wv[J];
    for (int j = 0; j < J; ++j) wv[j] = vload(wj + j * k + i);
    if (next != nullptr)
      for (int j = 0; j < J; ++j) __builtin_prefetch(next + j * k + i);
    for (int r = 0; r < R; ++r) {
      const vec xv = vload(x + r * k + i);
      for (int j = 0; j < J; ++j) acc[r][j] = vfma(wv[j], xv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < J; ++j) {
      const int64_t row = j0 + j;
      float sum = vsum(acc[r][j]);
      for (int64_t t = i; t < k; ++t) sum += static_cast<float>(wj[j * k + t]) * x[r * k + t];
      if (scale != nullptr) sum *= scale[row];
      if (bias != nullptr) sum += bias[row];
      if (residual != nullptr) sum += residual[r * n + row];
      out[r * n + row] = sum;
    }
  }
}

// Many rows (a decode batch above 4): the weight rows [begin, end) stream by J at a time, and each J
// rows, once read, meet every x row in passes of 4 while they sit in L1 (x stays in L1 / L2). Passes of
// 4 rows over the whole run instead read the weights from memory once per pass (16 rows: 4 times); the
// tile of 4 x rows by 2 weight rows loads 6 vectors for 8 FMAs. SmolLM2's layer linears at 8 / 16 / 32
// rows took 46 / 73 / 127 ms against 59 / 101 / 146 in passes (2-core AMD EPYC, AVX2), its lm_head at
// 16 / 64 rows 18 / 50 ms against 33 / 133 (MKL 35 / 87).
template <int J, typename W>
void gemv_many(const float* x, int64_t rows, const W* w, const float* scale, const float* bias,
               const float* residual, float* out, int64_t n, int64_t k, int64_t begin, int64_t end) {
  auto pass = [&](auto jtag, int64_t j0) {
    constexpr int JJ = decltype(jtag)::value;
    const W* wj = w + j0 * k;
    const W* next = j0 + 2 * JJ <= end ? wj + JJ * k : nullptr;  // the next rows, fetched during the first pass
    int64_t r0 = 0;
    for (; r0 + 4 <= rows; r0 += 4) {
      const float* rr = residual == nullptr ? nullptr : residual + r0 * n;
      tile<4, JJ>(x + r0 * k, wj, scale, bias, rr, out + r0 * n, n, k, j0, r0 == 0 ? next : nullptr);
    }
    const float* rr = residual == nullptr ? nullptr : residual + r0 * n;
    const int64_t left = rows - r0;
    if (left == 1) tile<1, JJ>(x + r0 * k, wj, scale, bias, rr, out + r0 * n, n, k, j0);
    else if (left == 2) tile<2, JJ>(x + r0 * k, wj, scale, bias, rr, out + r0 * n, n, k, j0);
    else if (left == 3) tile<3, JJ>(x + r0 * k, wj, scale, bias, rr, out + r0 * n, n, k, j0);
  };
  int64_t j0 = begin;
  for (; j0 + J <= end; j0 += J) pass(std::integral_constant<int, J>{}, j0);
  for (; j0 < end; ++j0) pass(std::integral_constant<int, 1>{}, j0);
}

// The sum of x's elements, each thread's half read as S streams side by side (as the gemv reads its
// weights): bench/floor.py's bandwidth probe, so that the floor it reports is what this host's best
// read reaches and not torch.sum's one stream per thread.
template <int S>
float stream_sum_part(const float* p, int64_t n) {
  const int64_t part = n / S / (2 * kLanes) * (2 * kLanes);
  vec acc[S][2];
  for (int s = 0; s < S; ++s) acc[s][0] = acc[s][1] = vzero();
  for (int64_t i = 0; i < part; i += 2 * kLanes) {
    for (int s = 0; s < S; ++s) {
      acc[s][0] = vadd(acc[s][0], vload(p + s * part + i));
      acc[s][1] = vadd(acc[s][1], vload(p + s * part + i + kLanes));
    }
  }
  float total = 0.f;
  for (int s = 0; s < S; ++s) total += vsum(vadd(acc[s][0], acc[s][1]));
  for (int64_t i = S * part; i < n; ++i) total += p[i];
  return total;
}

at::Tensor stream_sum(const at::Tensor& x, int64_t streams) {
  check_f32(x, "stream_sum: x");
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 4, "stream_sum: 1, 2 or 4 streams");
  const float* p = x.data_ptr<float>();
  const int64_t n = x.numel();
  double total = 0.0;
  parallel_range(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    const float* q = p + begin;
    const float sum = streams == 4 ? stream_sum_part<4>(q, end - begin)
                      : streams == 2 ? stream_sum_part<2>(q, end - begin) : stream_sum_part<1>(q, end - begin);
#pragma omp atomic
    total += sum;
  });
  return at::scalar_tensor(total, x.options());
}

// weight rows [begin, end) of out [R, N] = residual + (x @ w.T) * scale + bias
template <typename W>
void gemv_part(const float* x, int64_t rows, const W* w, const float* scale, const float* bias, const float* residual,
               float* out, int64_t n, int64_t k, int64_t begin, int64_t end) {
  if (rows > 4) return gemv_many<2>(x, rows, w, scale, bias, residual, out, n, k, begin, end);
  if (rows == 1 && g_row_streams == 1) gemv_rows<1, 1>(x, w, scale, bias, residual, out, n, k, begin, end);
  else if (rows == 1 && g_row_streams == 2) gemv_rows<1, 2>(x, w, scale, bias, residual, out, n, k, begin, end);
  else if (rows == 1) gemv_rows<1, 4>(x, w, scale, bias, residual, out, n, k, begin, end);
  else if (rows == 2) gemv_rows<2, 2>(x, w, scale, bias, residual, out, n, k, begin, end);
  else if (rows == 3) gemv_rows<3, 1>(x, w, scale, bias, residual, out, n, k, begin, end);
  else gemv_rows<4, 1>(x, w, scale, bias, residual, out, n, k, begin, end);
}
template void gemv_part<float>(const float*, int64_t, const float*, const float*, const float*, const float*, float*,
                               int64_t, int64_t, int64_t, int64_t);
template void gemv_part<c10::BFloat16>(const float*, int64_t, const c10::BFloat16*, const float*, const float*,
                                       const float*, float*, int64_t, int64_t, int64_t, int64_t);
template void gemv_part<int8_t>(const float*, int64_t, const int8_t*, const float*, const float*, const float*, float*,
                                int64_t, int64_t, int64_t, int64_t);

// out [R, N] = residual + (x @ w.T) * scale + bias, w float or bf16 (scale null) or int8
template <typename W>
at::Tensor gemv_any(const at::Tensor& x, const at::Tensor& w, const W* pw, const float* ps,
                    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  const int64_t rows = x.size(0), n = w.size(0), k = w.size(1);
  const Addends add = checked_addends(bias, residual, rows, n, "gemv: bias / residual");
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* px = x.data_ptr<float>();
  const float* pb = add.bias_data();
  const float* pr = add.residual_data();
  float* po = out.data_ptr<float>();
  // a grain of weight rows per thread: at least ~64 KiB, so each thread streams contiguous memory
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, k));
  parallel_range(0, n, grain,
                 [&](int64_t begin, int64_t end) { gemv_part(px, rows, pw, ps, pb, pr, po, n, k, begin, end); });
  return out;
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: x [R, K], w [N, K]");
  check_f32(x, "gemv: x");
  if (w.scalar_type() == at::kBFloat16) {
    TORCH_CHECK(w.device().is_cpu() && w.is_contiguous(), "gemv: w: contiguous CPU float32 or bfloat16 expected");
    return gemv_any<c10::BFloat16>(x, w, w.data_ptr<c10::BFloat16>(), nullptr, bias, residual);
  }
  check_f32(w, "gemv: w (float32 or bfloat16)");
  return gemv_any<float>(x, w, w.data_ptr<float>(), nullptr, bias, residual);
}

at::Tensor gemv_w8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_w8: x [R, K], w [N, K]");
  check_f32(x, "gemv_w8: x");
  TORCH_CHECK(w.scalar_type() == at::kChar && w.device().is_cpu() && w.is_contiguous(),
              "gemv_w8: w: contiguous CPU int8 expected");
  check_f32(scale, "gemv_w8: scale");
  TORCH_CHECK(scale.numel() == w.size(0), "gemv_w8: scale [N] expected");
  return gemv_any<int8_t>(x, w, w.data_ptr<int8_t>(), scale.data_ptr<float>(), bias, residual);
}

}  // namespace disagg_cpu
