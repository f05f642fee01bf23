// The int8 matmul of the fused CPU ops (`--quantization w8a8`, common/models/low_precision.py; registered
// in cpu_fused.cpp): int8 weights with a bf16 scale per output row and block of k, each linear's input
// quantized to int8 per (smaller or equal) block of k as it arrives, the integer products summed exactly in
// int32 per input block, and the blocks' sums scaled and added in float32.
//   pack_int8_quads(w [N, K] int8, K % 4 == 0) -> [ceil(N / P), K / 4, P, 4] uint8: panels of P output
//     columns (as cpu_gemm.cpp's), k-quad-major: for k = 4i .. 4i + 3 each column's four weights plus 128
//     (so unsigned: 1 .. 255) in one 32-bit lane; the last panel padded with 128 (zero weights);
//   pack_int8_scales(scale [N, B] bf16) -> [ceil(N / P), B, P] bf16: the scales of each panel's columns,
//     block-major (the last panel padded with zeros);
//   gemm_int8(x [R, K] float32, quads, scales, N, block, bias?, residual?) -> [R, N], the scales' blocks of
//     K / B k each a multiple of `block`: residual + bias[c] + sum over x's blocks b of
//     fma(dot_b(xq[r], wq[c]), sx[r, b] * scale[c, b'], acc), b' the scales' block holding b, where per row r
//     and block b of `block` k: sx = absmax / 127 (1 where the block is all zero), xq = round(x / sx) to
//     nearest even, and dot_b the exact integer dot product over the block.
// vpdpbusd (AVX512-VNNI) multiplies unsigned by signed bytes, four per lane, into int32: the weights are
// the unsigned side (w + 128), and the 128 * sum(xq) it adds per block is taken off by starting the
// block's sums at -128 * sum(xq). Per block and output the float step is a product and one fused
// multiply-add, acc = fma(float(dot_b), sx[r, b] * scale[c, b'], acc), in block order: the integer sums are
// exact whatever the instructions, so every ISA's form and every tile shape gives the same bits, and a row's
// result does not depend on the batch. Without VNNI (AVX-512, AVX2) the same sums come from vpmaddwd on the
// bytes widened to 16 bits in registers; one lane multiplies bytes. Tiles of up to kQuadRows rows by one
// panel; two rows (a decode step) by one panel, each thread's panels in turn; one row by two panels.

#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_common.h"

namespace disagg_cpu {

// integer lanes beside vec's float lanes: one 32-bit lane per output column, four bytes of k each
#if defined(__AVX512F__) && defined(__AVX512BW__)
using ivec = __m512i;
inline ivec iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline ivec iset1(int32_t a) { return _mm512_set1_epi32(a); }
inline vec vfloat(ivec a) { return _mm512_cvtepi32_ps(a); }
// a + per lane the dot product of w's four unsigned bytes and x's four signed bytes
inline ivec dot4(ivec a, ivec w, ivec x) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(a, w, x);
#else
  const ivec even = _mm512_and_si512(w, _mm512_set1_epi16(0xff)), odd = _mm512_srli_epi16(w, 8);
  const ivec xe = _mm512_srai_epi16(_mm512_slli_epi16(x, 8), 8), xo = _mm512_srai_epi16(x, 8);
  return _mm512_add_epi32(a, _mm512_add_epi32(_mm512_madd_epi16(even, xe), _mm512_madd_epi16(odd, xo)));
#endif
}
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
using ivec = __m256i;
inline ivec iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ivec iset1(int32_t a) { return _mm256_set1_epi32(a); }
inline vec vfloat(ivec a) { return _mm256_cvtepi32_ps(a); }
inline ivec dot4(ivec a, ivec w, ivec x) {
  const ivec even = _mm256_and_si256(w, _mm256_set1_epi16(0xff)), odd = _mm256_srli_epi16(w, 8);
  const ivec xe = _mm256_srai_epi16(_mm256_slli_epi16(x, 8), 8), xo = _mm256_srai_epi16(x, 8);
  return _mm256_add_epi32(a, _mm256_add_epi32(_mm256_madd_epi16(even, xe), _mm256_madd_epi16(odd, xo)));
}
#else  // one lane, or AVX-512 without BW: kLanes lanes in an array
struct ivec {
  int32_t v[kLanes];
};
inline ivec iload(const uint8_t* p) {
  ivec a;
  std::memcpy(a.v, p, sizeof(a.v));
  return a;
}
inline ivec iset1(int32_t x) {
  ivec a;
  for (int64_t l = 0; l < kLanes; ++l) a.v[l] = x;
  return a;
}
inline vec vfloat(ivec a) {
  float f[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) f[l] = static_cast<float>(a.v[l]);
  return vload(f);
}
inline ivec dot4(ivec a, ivec w, ivec x) {
  for (int64_t l = 0; l < kLanes; ++l) {
    const auto* wb = reinterpret_cast<const uint8_t*>(&w.v[l]);
    const auto* xb = reinterpret_cast<const int8_t*>(&x.v[l]);
    for (int b = 0; b < 4; ++b) a.v[l] += static_cast<int32_t>(wb[b]) * xb[b];
  }
  return a;
}
#endif
// fma(a, b, c) with one rounding on every form (one lane: std::fma, not a * b + c), so all forms agree
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline vec fma_exact(vec a, vec b, vec c) { return vfma(a, b, c); }
#else
inline vec fma_exact(vec a, vec b, vec c) { return std::fma(a, b, c); }
#endif

// 2T int32 sums + 2T float sums + 2 weight vectors + the broadcast x within the registers: 32 on AVX-512
// (6 rows), AVX2's 16 (2 rows)
constexpr int kQuadRows = kLanes == 16 ? 6 : 2;
constexpr int64_t kQuadChunk = 16 * kQuadRows;  // x rows per pass over a thread's panels
// up to this many rows a thread's panels go by one at a time, read front to back: with the quads on 2 MiB
// pages (weight_arena.gather) a w8a8 decode step of SmolLM2 took 5.92 ms against 6.60 with 4 panels read
// side by side (2-core AMD Zen 4, interleaved, the one-panel form faster in 17 rounds of 20)
constexpr int kQuadFewRows = kStepRows;

// One block of x: s = its absmax / 127 (1 if all zero), qb = round(xb / s) within +-127 (to nearest even;
// not finite x: unspecified); returns the sum of qb. Plain loops the compiler vectorizes; blocks of 32 on
// AVX-512 by hand (the compiler's loops cost ~1 ns per element there, half of SmolLM2's linears' time at
// 64 rows on a 2-core AMD Zen 4)
inline int32_t quantize_block(const float* __restrict xb, int8_t* __restrict qb, int64_t block, float& s) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  if (block == 16 || block == 32) {  // one or two vectors (16: the second all zero, which changes nothing)
    const __m512 lo = _mm512_loadu_ps(xb), hi = block == 32 ? _mm512_loadu_ps(xb + 16) : _mm512_setzero_ps();
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    s = amax > 0.f ? amax / 127.f : 1.f;
    const __m512 sv = _mm512_set1_ps(s);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const auto q = [&](__m512 v) {
      const __m512i c = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v, sv), kNearest));
      return _mm512_max_epi32(_mm512_min_epi32(c, top), bottom);
    };
    const __m512i a = q(lo), b = q(hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtepi32_epi8(a));
    if (block == 32) _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtepi32_epi8(b));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
  }
#endif
  float amax = 0.f;
#pragma omp simd reduction(max : amax)
  for (int64_t i = 0; i < block; ++i) amax = std::max(amax, std::fabs(xb[i]));
  s = amax > 0.f ? amax / 127.f : 1.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < block; ++i) {  // vectorized without `omp simd` (with it: not)
    float v = std::nearbyint(xb[i] / s);
    v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
    const int32_t c = static_cast<int32_t>(v);
    qb[i] = static_cast<int8_t>(c);
    sum += c;
  }
  return sum;
}

void QuantizedRows::size(int64_t rows, int64_t k, int64_t block) {
  const int64_t groups = (rows + kQuadRows - 1) / kQuadRows;
  quads.resize(groups * (k / 4) * kQuadRows);
  scales.resize(groups * (k / block) * kQuadRows);
  starts.resize(groups * (k / block) * kQuadRows);
}

void quantize_into(const float* x, int64_t r0, int64_t r1, int64_t k, int64_t block, QuantizedRows& q) {
  const int64_t blocks = k / block, k4 = k / 4;
  thread_local std::vector<int32_t> words;  // one row's bytes, then spread to its group's k-major words
  words.resize(k4);
  int8_t* bytes = reinterpret_cast<int8_t*>(words.data());
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t g = row / kQuadRows, r = row % kQuadRows;
    const float* xr = x + row * k;
    for (int64_t b = 0; b < blocks; ++b) {
      float s;
      const int32_t sum = quantize_block(xr + b * block, bytes + b * block, block, s);
      q.scales[(g * blocks + b) * kQuadRows + r] = s;
      q.starts[(g * blocks + b) * kQuadRows + r] = -128 * sum;
    }
    for (int64_t i = 0; i < k4; ++i) q.quads[(g * k4 + i) * kQuadRows + r] = words[i];
  }
}

// x's rows quantized into the calling thread's QuantizedRows, the groups split over its team
const QuantizedRows& quantize_rows(const float* x, int64_t rows, int64_t k, int64_t block) {
  thread_local QuantizedRows mine;
  QuantizedRows& q = mine;  // the calling thread's, for its team (a thread_local named in the lambda is each thread's own)
  q.size(rows, k, block);
  // a quantized element (its block's largest, rounding, packing, the group's transposed words) weighs as ~16
  // elements touched: 64 rows then went on two threads, a w8a8 decode step of SmolLM2 4% shorter (65.3 against
  // 68.7 ms, faster in 32 of 37 interleaved steps), 16 rows 1.4% (26 of 37; 2-core AMD Zen 4)
  parallel_range(0, (rows + kQuadRows - 1) / kQuadRows, grain_for(16 * k * kQuadRows), [&](int64_t begin, int64_t end) {
    quantize_into(x, begin * kQuadRows, std::min(rows, end * kQuadRows), k, block, q);
  });
  return q;
}

// out[r, col0[p] + c] for r < T, p < S, c < min(P, n - col0[p]): T rows of a quantized group against S quad
// panels side by side and their [B, P] scales (`scale[p]`: each for `ratio` of x's blocks of `per_block`
// quads); `next`: the panel after (S = 1), fetched meanwhile. PB, R > 0: per_block and ratio known when
// compiled. Each panel's sums and their order do not depend on S, so neither do its bits.
template <int T, int S, int PB = 0, int R = 0>
inline void quad_tile(const int32_t* xq, const float* sx, const int32_t* starts, const uint8_t* const* panel,
                      const c10::BFloat16* const* scale, const int64_t* col0, const float* bias, const float* residual,
                      float* out, int64_t n, int64_t k4, int64_t per_block, int64_t ratio, const uint8_t* next) {
  if constexpr (PB > 0) per_block = PB;
  if constexpr (R > 0) ratio = R;
  constexpr int V = 2 * S;  // column vectors: panel p's are 2p and 2p + 1
  vec acc[T][V];
  for (int r = 0; r < T; ++r)
    for (int j = 0; j < V; ++j) acc[r][j] = vzero();
  for (int64_t i0 = 0, b = 0, wb = 0; i0 < k4; i0 += per_block * ratio, ++wb) {
    vec ws[V];  // weight block wb's scales, for its `ratio` x blocks
    for (int j = 0; j < V; ++j) ws[j] = vload(scale[j / 2] + wb * kPanel + (j % 2) * kLanes);
    for (int64_t i1 = i0; i1 < i0 + per_block * ratio; i1 += per_block, ++b) {
      ivec sums[T][V];
      for (int r = 0; r < T; ++r) {
        const ivec start = iset1(starts[b * kQuadRows + r]);
        for (int j = 0; j < V; ++j) sums[r][j] = start;
      }
      for (int64_t i = i1; i < i1 + per_block; ++i) {
        if (next != nullptr) __builtin_prefetch(next + i * 4 * kPanel), __builtin_prefetch(next + i * 4 * kPanel + 64);
        ivec w[V];
        for (int j = 0; j < V; ++j) w[j] = iload(panel[j / 2] + i * 4 * kPanel + (j % 2) * 4 * kLanes);
        for (int r = 0; r < T; ++r) {
          const ivec xv = iset1(xq[i * kQuadRows + r]);
          for (int j = 0; j < V; ++j) sums[r][j] = dot4(sums[r][j], w[j], xv);
        }
      }
      for (int r = 0; r < T; ++r) {
        const vec s = vset1(sx[b * kQuadRows + r]);
        for (int j = 0; j < V; ++j) acc[r][j] = fma_exact(vfloat(sums[r][j]), vmul(s, ws[j]), acc[r][j]);
      }
    }
  }
  for (int p = 0; p < S; ++p) {
    vec mine[T][2];
    for (int r = 0; r < T; ++r) mine[r][0] = acc[r][2 * p], mine[r][1] = acc[r][2 * p + 1];
    store_tile(mine, std::min<int64_t>(kPanel, n - col0[p]), nullptr, bias, residual, out, n, col0[p]);
  }
}

template <int T, int PB = 0, int R = 0>
inline void quad_tile_of(int64_t rows, const int32_t* xq, const float* sx, const int32_t* starts,
                         const uint8_t* panel, const c10::BFloat16* scale, const float* bias, const float* residual,
                         float* out, int64_t n, int64_t k4, int64_t per_block, int64_t ratio, int64_t col0,
                         const uint8_t* next) {
  if constexpr (T > 0) {
    if (rows == T)
      return quad_tile<T, 1, PB, R>(xq, sx, starts, &panel, &scale, &col0, bias, residual, out, n, k4, per_block,
                                    ratio, next);
    quad_tile_of<T - 1, PB, R>(rows, xq, sx, starts, panel, scale, bias, residual, out, n, k4, per_block, ratio, col0,
                               next);
  }
}

// w8a8's blocks (low_precision.py: inputs per 16 k, weights per 32), whose loops are unrolled when compiled:
// a w8a8 decode step of SmolLM2 at one row took 6.48 ms against 6.63 with the loops' lengths known only when
// run (2-core AMD Zen 4 at ~33 GB/s, one process, interleaved, faster in 202 of 300 steps)
constexpr int kDefaultPerBlock = 4, kDefaultRatio = 2;
inline bool default_blocks(int64_t per_block, int64_t ratio) {
  return per_block == kDefaultPerBlock && ratio == kDefaultRatio;
}

// Panels side by side at one row, 1 or 2 (int8_streams), which start-up picks by timing
// (cpu_fused.pick_int8_streams): hosts differ. A w8a8 decode step of SmolLM2 at one row took 4.13 ms with two
// against 4.25 with one while the host read ~61 GB/s (faster in 218 of 300 steps), the same within noise at
// ~33 GB/s (2-core AMD Zen 4, one process, interleaved); four were slower (6.09 against 5.67 ms).
int64_t g_int8_streams = 2;  // until start-up picks

int64_t int8_streams(int64_t streams) {
  TORCH_CHECK(streams == 0 || streams == 1 || streams == 2, "int8_streams: 1 or 2 (0: ask)");
  if (streams != 0) g_int8_streams = streams;
  return g_int8_streams;
}

// panels [begin, end) of a decode step's rows (rows <= kQuadFewRows), x quantized on the calling thread. Two
// rows: each panel in turn. One row with two streams: the two halves of the range side by side (the odd
// panel last); with one, each panel in turn.
void int8_part(const float* x, int64_t rows, const uint8_t* quads, const c10::BFloat16* scales, int64_t scale_blocks,
               const float* bias, const float* residual, float* out, int64_t n, int64_t k, int64_t block,
               Claims& panels) {
  int64_t begin, end;
  if (!panels.take(begin, end)) return;
  const QuantizedRows& q = quantize_rows(x, rows, k, block);
  const int64_t k4 = k / 4, per_block = block / 4, ratio = k / scale_blocks / block;
  const bool fixed = default_blocks(per_block, ratio);
  const auto run = [&](auto tile, const int64_t* ps, int count) {
    const uint8_t* panel[2];
    const c10::BFloat16* scale[2];
    int64_t col0[2];
    for (int i = 0; i < count; ++i) {
      panel[i] = quads + ps[i] * k * kPanel, scale[i] = scales + ps[i] * scale_blocks * kPanel;
      col0[i] = ps[i] * kPanel;
    }
    tile(q.quads.data(), q.scales.data(), q.starts.data(), panel, scale, col0, bias, residual, out, n, k4, per_block,
         ratio, nullptr);
  };
  const auto one = rows == 1 ? (fixed ? quad_tile<1, 1, kDefaultPerBlock, kDefaultRatio> : quad_tile<1, 1>)
                             : (fixed ? quad_tile<kQuadFewRows, 1, kDefaultPerBlock, kDefaultRatio>
                                      : quad_tile<kQuadFewRows, 1>);
  const auto two = fixed ? quad_tile<1, 2, kDefaultPerBlock, kDefaultRatio> : quad_tile<1, 2>;
  do {
    const int64_t half = rows == 1 && g_int8_streams == 2 ? (end - begin) / 2 : 0;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t ps[2] = {begin + i, begin + half + i};
      run(two, ps, 2);
    }
    for (int64_t p = begin + 2 * half; p < end; ++p) run(one, &p, 1);
  } while (panels.take(begin, end));
}

// The int8 matmul of quantized rows (more than kQuadFewRows): rows [r, r + t) (t <= kQuadRows, r a multiple of it)
// against panel p in one tile, the next panel fetched meanwhile where `fetch`
struct QuadRows {
  const QuantizedRows& q;
  const uint8_t* quads;
  const c10::BFloat16* scales;
  int64_t scale_blocks;
  const float *bias, *residual;
  float* out;
  int64_t n, k, block;
  void tile(int64_t r, int64_t t, int64_t p, bool fetch) const {
    const int64_t k4 = k / 4, blocks = k / block, per_block = block / 4, ratio = k / scale_blocks / block;
    const int64_t g = r / kQuadRows;
    const uint8_t* panel = quads + p * k * kPanel;
    (default_blocks(per_block, ratio) ? quad_tile_of<kQuadRows, kDefaultPerBlock, kDefaultRatio>
                                      : quad_tile_of<kQuadRows>)(
        t, q.quads.data() + g * k4 * kQuadRows, q.scales.data() + g * blocks * kQuadRows,
        q.starts.data() + g * blocks * kQuadRows, panel, scales + p * scale_blocks * kPanel, bias,
        residual == nullptr ? nullptr : residual + r * n, out + r * n, n, k4, per_block, ratio, p * kPanel,
        fetch ? panel + k * kPanel : nullptr);
  }
};

void int8_rows_part(const QuantizedRows& q, int64_t rows, const uint8_t* quads, const c10::BFloat16* scales,
                    int64_t scale_blocks, const float* bias, const float* residual, float* out, int64_t n, int64_t k,
                    int64_t block, Claims& panels) {
  const QuadRows m{q, quads, scales, scale_blocks, bias, residual, out, n, k, block};
  int64_t begin, end;
  while (panels.take(begin, end))  // each panel read once: every row's tiles while it is in cache (panel_walk's order)
    for (int64_t p = begin; p < end; ++p)
      for (int64_t r = 0; r < rows; r += kQuadRows) m.tile(r, std::min<int64_t>(kQuadRows, rows - r), p, r == 0 && p + 1 < end);
}

at::Tensor pack_int8_quads(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.device().is_cpu() && w.is_contiguous(),
              "pack_int8_quads: w: contiguous CPU int8 [N, K] expected");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(k % 4 == 0, "pack_int8_quads: K a multiple of 4 expected, got ", k);
  at::Tensor out = at::full({panels, k / 4, kPanel, 4}, 128, w.options().dtype(at::kByte));
  pack_groups<4>(w.data_ptr<int8_t>(), out.data_ptr<uint8_t>(), n, k,
                 [](int8_t v) { return static_cast<uint8_t>(v + 128); });
  return out;
}

at::Tensor pack_int8_scales(const at::Tensor& scale) {
  TORCH_CHECK(scale.dim() == 2 && scale.scalar_type() == at::kBFloat16 && scale.device().is_cpu() &&
                  scale.is_contiguous() && scale.size(0) > 0,
              "pack_int8_scales: scale: contiguous CPU bf16 [N, blocks] expected");
  const int64_t n = scale.size(0), blocks = scale.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor out = at::zeros({panels, blocks, kPanel}, scale.options());
  const c10::BFloat16* src = scale.data_ptr<c10::BFloat16>();
  c10::BFloat16* dst = out.data_ptr<c10::BFloat16>();
  for (int64_t c = 0; c < n; ++c)
    for (int64_t b = 0; b < blocks; ++b) dst[((c / kPanel) * blocks + b) * kPanel + c % kPanel] = src[c * blocks + b];
  return out;
}

at::Tensor gemm_int8(const at::Tensor& x, const at::Tensor& quads, const at::Tensor& scales, int64_t n, int64_t block,
                     const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual) {
  check_groups(x, quads, n, 4, at::kByte, "gemm_int8");
  const int64_t rows = x.size(0), k = x.size(1), k4 = k / 4, count = quads.size(0);
  TORCH_CHECK(block > 0 && block % 4 == 0 && k % block == 0, "gemm_int8: block a multiple of 4 dividing K, got ", block);
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kBFloat16 && scales.device().is_cpu() &&
                  scales.is_contiguous() && scales.size(0) == count && scales.size(1) > 0 &&
                  k % scales.size(1) == 0 && (k / scales.size(1)) % block == 0 && scales.size(2) == kPanel,
              "gemm_int8: scales: pack_int8_scales' contiguous bf16 [N / P, B, P] expected, K / B a multiple "
              "of the block");
  const int64_t scale_blocks = scales.size(1), ratio = k / scale_blocks / block;
  const Addends add = checked_addends(bias, residual, rows, n, "gemm_int8: bias / residual");
  at::Tensor out = at::empty({rows, n}, x.options());
  const float *px = x.data_ptr<float>(), *pb = add.bias_data(), *pr = add.residual_data();
  const c10::BFloat16* ps = scales.data_ptr<c10::BFloat16>();
  const uint8_t* pp = quads.data_ptr<uint8_t>();
  float* po = out.data_ptr<float>();
  if (rows <= kQuadFewRows) {  // a decode step of a request or two: each thread's panels one after another
    parallel_range(0, count, 1, [&](int64_t begin, int64_t end) {
      Claims panels = Claims::range(begin, end);
      int8_part(px, rows, pp, ps, scale_blocks, pb, pr, po, n, k, block, panels);
    });
    return out;
  }
  const QuadRows m{quantize_rows(px, rows, k, block), pp, ps, scale_blocks, pb, pr, po, n, k, block};
  panel_walk(rows, count, kQuadRows, kQuadChunk, [&](int64_t r, int64_t t, int64_t p, bool fetch) { m.tile(r, t, p, fetch); });
  return out;
}

}  // namespace disagg_cpu
