// The bf16 matmul of the fused CPU ops (`--quantization bf16-matmul`, common/models/low_precision.py;
// registered in cpu_fused.cpp): a linear whose products are bf16 x bf16, summed in float32.
//   pack_bf16_pairs(w [N, K] bf16, K even)  -> [ceil(N / P), K / 2, P, 2]: panels of P output columns
//     (P = two SIMD vectors, as cpu_gemm.cpp's), each k-pair-major: for k = 2i, 2i + 1 the P columns'
//     two weights side by side, (w[c, 2i], w[c, 2i + 1]) as one 32-bit lane; the last panel zero-padded;
//   gemm_bf16(x [R, K] float32, pairs, N, bias?, residual?) -> residual + bf16(x) @ w.T + bias [R, N],
//     bf16(x): x rounded to bf16 to nearest even (as torch's x.bfloat16()).
// Per lane and k pair a tile adds w[2i + 1] x[2i + 1], then w[2i] x[2i], to a float32 sum, in k order:
// with AVX512-BF16 one `vdpbf16ps` per vector does both (what the instruction computes: two fused
// multiply-adds, odd then even), twice the multiply-adds of an fp32 FMA per instruction and half the weight
// bytes (on a 2-core AMD Zen 4, SmolLM2's linears at 64 rows: 36 ms, the fp32 panels 72). Elsewhere
// (AVX-512 without it, AVX2, one lane) the same two FMAs on the weights widened in registers: the same
// sums, at the bf16 panels' speed. A bf16 x bf16 product is exact in float32, so both paths differ only
// where vdpbf16ps flushes denormal inputs and outputs to zero. Tiles of up to 12 rows (4 without 32
// registers) by one panel; one or two rows (a decode step) by one panel, each thread's panels in turn.

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <vector>

#include "cpu_common.h"

namespace disagg_cpu {

// 2T accumulators + 2 weight vectors + the broadcast x within the registers: 32 on AVX-512; AVX2's 16
// hold 4 rows with the fallback's 4 widened weight vectors and 2 x
constexpr int kPairRows = kLanes == 16 ? 12 : 4;
constexpr int64_t kPairChunk = 16 * kPairRows;  // x rows per pass over a thread's panels
constexpr int64_t kPairBytes = 2 * kPanel * sizeof(uint16_t);  // a panel's weights of one k pair
// up to this many rows a thread's panels go by one at a time, read front to back: with the pairs on 2 MiB
// pages (weight_arena.gather) a bf16-matmul decode step of SmolLM2 took 11.06 ms against 11.98 with 4
// panels read side by side, which had been the faster on 4 KiB pages (2-core AMD Zen 4, interleaved)
constexpr int kFewRows = kStepRows;

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kDotBf16 = true;  // x groups hold the rows' bf16 pairs: [K / 2, kPairRows] of 32 bits
#else
constexpr bool kDotBf16 = false;  // x groups hold the rows' rounded floats: [K, kPairRows]
// kLanes lanes of (even, odd) bf16 weights widened to float: even in the low 16 bits of each 32-bit lane
inline void vload_pairs(const uint16_t* p, vec& even, vec& odd) {
#if defined(__AVX512F__)
  const __m512i u = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
#else
  even = static_cast<float>(c10::BFloat16(p[0], c10::BFloat16::from_bits()));
  odd = static_cast<float>(c10::BFloat16(p[1], c10::BFloat16::from_bits()));
#endif
}
#endif

// out[r, col0 + c] for r < T, c < min(P, n - col0): T rows of the x group against one pair panel; `next`:
// the panel after it, fetched into cache meanwhile by the first tile of a run over it
template <int T>
inline void pair_tile(const float* x, const uint16_t* panel, const float* bias, const float* residual, float* out,
                      int64_t n, int64_t k2, int64_t col0, const uint16_t* next) {
  vec acc[T][2];
  for (int r = 0; r < T; ++r)
    for (int j = 0; j < 2; ++j) acc[r][j] = vzero();
  for (int64_t i = 0; i < k2; ++i) {
    if (next != nullptr)
      for (int64_t b = 0; b < kPairBytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(next + i * 2 * kPanel) + b);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
    const __m512bh w[2] = {(__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel),
                           (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel + 2 * kLanes)};
    const uint32_t* xp = reinterpret_cast<const uint32_t*>(x) + i * kPairRows;
    for (int r = 0; r < T; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r]));
      for (int j = 0; j < 2; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], w[j], xv);
    }
#else
    vec e[2], o[2];
    vload_pairs(panel + i * 2 * kPanel, e[0], o[0]);
    vload_pairs(panel + i * 2 * kPanel + 2 * kLanes, e[1], o[1]);
    const float* xe = x + 2 * i * kPairRows;
    const float* xo = xe + kPairRows;
    for (int r = 0; r < T; ++r) {
      const vec ve = vset1(xe[r]), vo = vset1(xo[r]);
      for (int j = 0; j < 2; ++j) acc[r][j] = vfma(e[j], ve, vfma(o[j], vo, acc[r][j]));
    }
#endif
  }
  store_tile(acc, std::min<int64_t>(kPanel, n - col0), nullptr, bias, residual, out, n, col0);
}

// a tile of `rows` (<= T) rows against one panel: pair_tile of that many
template <int T>
inline void pair_tile_of(int64_t rows, const float* x, const uint16_t* panel, const float* bias,
                         const float* residual, float* out, int64_t n, int64_t k2, int64_t col0, const uint16_t* next) {
  if constexpr (T > 0) {
    if (rows == T) return pair_tile<T>(x, panel, bias, residual, out, n, k2, col0, next);
    pair_tile_of<T - 1>(rows, x, panel, bias, residual, out, n, k2, col0, next);
  }
}

at::Tensor pack_bf16_pairs(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu() && w.is_contiguous(),
              "pack_bf16_pairs: w: contiguous CPU bfloat16 [N, K] expected");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(k % 2 == 0, "pack_bf16_pairs: an even K expected, got ", k);
  at::Tensor out = at::zeros({panels, k / 2, kPanel, 2}, w.options());
  pack_groups<2>(reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>()),
                 reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()), n, k, [](uint16_t v) { return v; });
  return out;
}

// x's rows [r0, r1) rounded to bf16 into `packed`, in groups of kPairRows, k-major: with vdpbf16ps each k
// pair's two bf16 in one 32-bit lane per row ([K / 2, kPairRows] per group), else the rounded floats ([K,
// kPairRows]); a short group's missing rows: never read
void round_rows(const float* x, int64_t rows, int64_t k, float* packed) {
  const int64_t k2 = k / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t g = r / kPairRows, t = r % kPairRows;
    const float* row = x + r * k;
    if constexpr (kDotBf16) {
      uint32_t* dst = reinterpret_cast<uint32_t*>(packed + g * k * kPairRows);
      for (int64_t i = 0; i < k2; ++i)
        dst[i * kPairRows + t] = static_cast<uint32_t>(c10::BFloat16(row[2 * i]).x) |
                                 static_cast<uint32_t>(c10::BFloat16(row[2 * i + 1]).x) << 16;
    } else {
      for (int64_t i = 0; i < k; ++i) packed[(g * k + i) * kPairRows + t] = static_cast<float>(c10::BFloat16(row[i]));
    }
  }
}

// panels [begin, end) of a decode step's rows (rows <= kFewRows), x rounded on the calling thread: each
// thread's panels one after another
void bf16_part(const float* x, int64_t rows, const uint16_t* pairs, const float* bias, const float* residual,
               float* out, int64_t n, int64_t k, Claims& panels) {
  int64_t begin, end;
  if (!panels.take(begin, end)) return;
  thread_local std::vector<float> packed;  // the calling thread's, reused
  packed.resize(k * kPairRows);
  round_rows(x, rows, k, packed.data());
  do {
    for (int64_t p = begin; p < end; ++p)
      (rows == 1 ? pair_tile<1> : pair_tile<kFewRows>)(packed.data(), pairs + p * k * kPanel, bias, residual, out, n,
                                                       k / 2, p * kPanel, nullptr);
  } while (panels.take(begin, end));
}

at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& pairs, int64_t n, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& residual) {
  check_groups(x, pairs, n, 2, at::kBFloat16, "gemm_bf16");
  const int64_t rows = x.size(0), k = x.size(1), k2 = k / 2, count = pairs.size(0);
  const Addends add = checked_addends(bias, residual, rows, n, "gemm_bf16: bias / residual");
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* px = x.data_ptr<float>();
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(pairs.data_ptr<c10::BFloat16>());
  const float* pb = add.bias_data();
  const float* pr = add.residual_data();
  float* po = out.data_ptr<float>();
  if (rows <= kFewRows) {  // a decode step of a request or two: each thread's panels one after another
    parallel_range(0, count, 1,
                   [&](int64_t begin, int64_t end) {
                     Claims panels = Claims::range(begin, end);
                     bf16_part(px, rows, pp, pb, pr, po, n, k, panels);
                   });
    return out;
  }
  const int64_t groups = (rows + kPairRows - 1) / kPairRows;
  at::Tensor packed = at::empty({groups, k, kPairRows}, x.options());
  float* pxp = packed.data_ptr<float>();
  parallel_range(0, groups, grain_for(k * kPairRows), [&](int64_t begin, int64_t end) {
    const int64_t r0 = begin * kPairRows, r1 = std::min(rows, end * kPairRows);
    round_rows(px + r0 * k, r1 - r0, k, pxp + begin * k * kPairRows);
  });
  panel_walk(rows, count, kPairRows, kPairChunk, [&](int64_t r, int64_t t, int64_t p, bool fetch) {
    const uint16_t* panel = pp + p * k * kPanel;
    pair_tile_of<kPairRows>(t, pxp + r * k, panel, pb, pr == nullptr ? nullptr : pr + r * n, po + r * n, n, k2,
                            p * kPanel, fetch ? panel + k * kPanel : nullptr);
  });
  return out;
}

}  // namespace disagg_cpu
