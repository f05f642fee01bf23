// The greedy token of logits rows (registered here into the fused ops' library; built with cpu_fused.cpp
// by common/models/cpu_fused.py):
//   argmax_rows(x [R, N] float32) -> [R] int64: torch.argmax(x, dim=-1), the first index of each row's
//     largest value, or of its first NaN where it has one.
// torch's took ~21 us per SmolLM2 row (49,152 logits) on a 2-core AMD Zen 4: 1.35 ms of a 64-request decode
// step, and 42 us at one row (79 us after the step's weights streamed past). Here each thread scans a share
// of the rows, or of one row's columns where there are fewer rows than threads: 16 columns at a time with
// AVX-512, one at a time on other builds (the ISA drill holds them to torch's indices).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace disagg_cpu {

// the best of x[0, n) (n > 0), `first` the index of x[0]: one at a time, stopping at the first NaN
inline Best plain_best(const float* x, int64_t n, int64_t first) {
  Best b{x[0], first};
  for (int64_t i = 0; i < n && !std::isnan(b.value); ++i)
    if (std::isnan(x[i]) || x[i] > b.value) b = {x[i], first + i};
  return b;
}

// the same, 16 at a time with AVX-512: each lane's first largest, then the first lane holding the largest;
// where a NaN shows, plain_best finds the first one
Best best_of(const float* x, int64_t n, int64_t first) {
#if defined(__AVX512F__)
  if (n >= 16) {
    const __m512i step = _mm512_set1_epi32(16);
    __m512 top = _mm512_loadu_ps(x);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), lane = at;
    __mmask16 nan = _mm512_cmp_ps_mask(top, top, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n && i < (int64_t{1} << 31) - 16; i += 16) {  // lane indices fit int32 (x is a row)
      const __m512 v = _mm512_loadu_ps(x + i);
      lane = _mm512_add_epi32(lane, step);
      const __mmask16 up = _mm512_cmp_ps_mask(v, top, _CMP_GT_OQ);  // strictly: each lane keeps its first
      top = _mm512_mask_mov_ps(top, up, v), at = _mm512_mask_mov_epi32(at, up, lane);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    if (nan != 0) return plain_best(x, n, first);
    const float m = _mm512_reduce_max_ps(top);
    const __mmask16 holders = _mm512_cmp_ps_mask(top, _mm512_set1_ps(m), _CMP_EQ_OQ);
    Best b{m, first + _mm512_mask_reduce_min_epi32(holders, at)};  // the first of the lanes that hold it
    if (i < n) {
      const Best tail = plain_best(x + i, n - i, first + i);
      if (std::isnan(tail.value) || tail.value > b.value) b = tail;
    }
    return b;
  }
#endif
  return plain_best(x, n, first);
}

// b or c, whichever comes first in a scan that met b's part before c's (an empty part: neither)
Best better(const Best& b, const Best& c) {
  if (c.index < 0) return b;
  if (b.index < 0 || std::isnan(b.value)) return b.index < 0 ? c : b;
  return std::isnan(c.value) || c.value > b.value ? c : b;
}

at::Tensor argmax_rows(const at::Tensor& x) {
  check_f32(x, "argmax_rows: x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: x [R, N] with N > 0 expected");
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* px = x.data_ptr<float>();
  int64_t* po = out.data_ptr<int64_t>();
  const int64_t team = omp_in_parallel() ? 1 : omp_get_max_threads();
  // parts per row: enough for every thread where rows are few, each at least kParallelWork / 8 columns
  const int64_t parts = rows >= team ? 1 : std::max<int64_t>(1, std::min(team / std::max<int64_t>(rows, 1),
                                                                        n / (kParallelWork / 8)));
  std::vector<Best> found(rows * parts);
  parallel_range(0, rows * parts, parts > 1 ? 1 : grain_for(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t r = t / parts, p = t % parts, c0 = p * n / parts, c1 = (p + 1) * n / parts;
      found[t] = best_of(px + r * n + c0, c1 - c0, c0);
    }
  });
  for (int64_t r = 0; r < rows; ++r) {
    Best b = found[r * parts];
    for (int64_t p = 1; p < parts; ++p) b = better(b, found[r * parts + p]);
    po[r] = b.index;
  }
  return out;
}

}  // namespace disagg_cpu

TORCH_LIBRARY_FRAGMENT(disagg_cpu_fused, m) { m.def("argmax_rows(Tensor x) -> Tensor", &disagg_cpu::argmax_rows); }
