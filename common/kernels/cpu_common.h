// Shared by the fused CPU ops' sources (common/kernels/*.cpp, built together by
// common/models/cpu_fused.py): the parallel split, argument checks, the SIMD vector of -march=native,
// and the ops one source defines for another.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace disagg_cpu {

constexpr int64_t kParallelWork = 1 << 17;  // elements touched: below this a parallel region costs more

inline int64_t grain_for(int64_t work_per_item) {
  return std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, work_per_item));
}

// [begin, end) of `count` items as thread t's share of a team of `team` (parallel_range's chunks)
inline void share(int64_t count, int64_t t, int64_t team, int64_t& begin, int64_t& end) {
  const int64_t chunk = (count + team - 1) / team;
  begin = std::min(count, t * chunk);
  end = std::min(count, begin + chunk);
}

// Of a phase's items, the share each thread of a team takes as a static split would; the rest it claims
// (Claims::guided). A static split left one thread of two waiting 0.4-1.4 ms of a 5.5-7.4 ms w8a8 step of
// SmolLM2 at one request when the host slowed the other's core (2-core AMD Zen 4); through the pair, where
// the decode service's own threads take a core now and then, the claimed tenth made w8a8 at one / two
// requests 145 / 267 tok/s against 141 / 258
constexpr double kOwned = 0.9;

// The items a thread works on, taken as it goes: one fixed range [begin, end); or (`guided`) of [0, count) over a
// team, first the thread's own share of the leading kOwned of them (a stream of its own, as a static split
// reads), then the rest in ranges claimed from a counter the team shares (`next`): each half of
// what is left over the team, at least `least` items. A thread that runs slower (a core another process
// shares) claims fewer. Items must not depend on who computes them or in what pieces.
struct Claims {
  int64_t begin = 0, end = 0;            // what is still the thread's own
  std::atomic<int64_t>* next = nullptr;  // items claimed so far past `first` (guided)
  int64_t first = 0, count = 0, least = 1, team = 1;
  static Claims range(int64_t begin, int64_t end) { return Claims{begin, end}; }
  static Claims guided(std::atomic<int64_t>& next, int64_t count, int64_t least, int64_t t, int64_t team) {
    const int64_t each = static_cast<int64_t>(kOwned * static_cast<double>(count) / static_cast<double>(team)) / least * least;
    return Claims{t * each, (t + 1) * each, &next, team * each, count, least, team};
  }
  bool take(int64_t& b, int64_t& e) {
    if (begin < end) {
      b = begin, e = end, begin = end;
      return true;
    }
    if (next == nullptr) return false;
    int64_t done = next->load(std::memory_order_relaxed), size;
    do {
      const int64_t left = count - first - done;
      if (left <= 0) return false;
      size = std::min(left, std::max(least, left / (2 * team)));
    } while (!next->compare_exchange_weak(done, done + size, std::memory_order_relaxed));
    b = first + done, e = b + size;
    return true;
  }
};

// at::parallel_for's split (chunks of at least `grain` items over the calling thread's OpenMP team)
// without its lazy thread-count set-up: compiled into this library, that set-up keeps a per-thread
// flag of its own, so its first call on a thread re-read torch's process-wide count (the last
// torch.set_num_threads of any thread: 1 from the services' helper threads) and dropped the decode
// service's forward stream to one core. Here the team is the caller's own omp_get_max_threads().
template <typename F>
void parallel_range(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t team = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t threads = std::min<int64_t>(team, (n + grain - 1) / grain);
  if (threads <= 1) {
    f(begin, end);
    return;
  }
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    int64_t first, last;  // of what OpenMP gave, which may be fewer than asked
    share(n, omp_get_thread_num(), omp_get_num_threads(), first, last);
    if (first < last) f(begin + first, begin + last);
  }
}

// parallel_range for items [0, count) whose ranges threads claim as they go (Claims::guided, at least `least`
// items a claim): f(begin, end) for each range the calling thread takes
template <typename F>
void parallel_claims(int64_t count, int64_t least, const F& f) {
  if (count <= 0) return;
  const int64_t team = omp_in_parallel() ? 1 : omp_get_max_threads();
  const int64_t threads = std::min<int64_t>(team, (count + least - 1) / least);
  if (threads <= 1) {
    f(0, count);
    return;
  }
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    Claims claims = Claims::guided(next, count, least, omp_get_thread_num(), omp_get_num_threads());
    int64_t begin, end;
    while (claims.take(begin, end)) f(begin, end);
  }
}

inline void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name, ": CPU float32 expected");
  TORCH_CHECK(t.is_contiguous(), name, ": contiguous expected");
}

// A linear's optional bias [N] and residual [R, N] (the gemv's, the panel GEMM's), checked and made
// contiguous; kept here while their data is read.
struct Addends {
  at::Tensor bias, residual;
  const float* bias_data() const { return bias.defined() ? bias.data_ptr<float>() : nullptr; }
  const float* residual_data() const { return residual.defined() ? residual.data_ptr<float>() : nullptr; }
};

inline Addends checked_addends(const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual,
                               int64_t rows, int64_t n, const char* op) {
  Addends a;
  if (bias.has_value()) {
    a.bias = bias->contiguous();
    check_f32(a.bias, op);
    TORCH_CHECK(a.bias.numel() == n, op, ": bias [N] expected");
  }
  if (residual.has_value()) {
    a.residual = residual->contiguous();
    check_f32(a.residual, op);
    TORCH_CHECK(a.residual.numel() == rows * n, op, ": residual [R, N] expected");
  }
  return a;
}

// SIMD for the weight streams: -march=native picks AVX-512 or AVX2+FMA; elsewhere one lane (the
// compiler may still vectorize). Adjacent weight rows read side by side (four rows 2.3 KB apart) ran at
// 0.62-0.70x the bandwidth of one sequential stream on a 2-core AMD EPYC (AVX2): each stream below
// reads its rows front to back, one row after the other.
#if defined(__AVX512F__)
using vec = __m512;
constexpr int64_t kLanes = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload(const int8_t* p) {  // kLanes int8 weights, widened to float (the w8 gemv)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vec vload(const c10::BFloat16* p) {  // kLanes bf16 weights, widened to float exactly (the bf16 gemv)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
// the sum of the lanes: halves, quarters, then pairs (GCC's _mm512_reduce_add_ps, spelled out so that vsums4
// below is the same tree on any compiler)
inline float vsum(vec v) {
  const __m256 h = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), _mm512_castps512_ps256(v));
  __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  q = _mm_add_ps(q, _mm_shuffle_ps(q, q, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
// vsum's tree for kLanes vectors a[0 .. kLanes) at once, transposed as it goes, in two steps so that a caller
// can reduce each four vectors as it makes them: vsums4 takes a[4c .. 4c + 3] to their partial sums (block i
// of the result: a[4c + i]'s four), vsums_of the kLanes / 4 of those to one vector whose lane s is vsum(a[s])
inline vec vsums4(vec a0, vec a1, vec a2, vec a3) {
  const __m512 v0 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0xEE), _mm512_shuffle_f32x4(a0, a1, 0x44));
  const __m512 v1 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0xEE), _mm512_shuffle_f32x4(a2, a3, 0x44));
  return _mm512_add_ps(_mm512_shuffle_f32x4(v0, v1, 0xDD), _mm512_shuffle_f32x4(v0, v1, 0x88));  // i + 4 and i
}
inline vec vsums_of(const vec (&w)[kLanes / 4]) {
  __m512 x[2];
  for (int k = 0; k < 2; ++k)  // then i + 2 and i
    x[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(w[2 * k]), _mm512_castps_pd(w[2 * k + 1]))),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(w[2 * k]), _mm512_castps_pd(w[2 * k + 1]))));
  const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));  // lane 4i + m: a[i + 4m]'s
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), y);
}
inline vec vset1(float a) { return _mm512_set1_ps(a); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
using vec = __m256;
constexpr int64_t kLanes = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vec vload(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vset1(float a) { return _mm256_set1_ps(a); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// vsums4 and vsums_of as the AVX-512 ones: a[4c .. 4c + 3] to their pairs of partial sums, then those to the sums
inline vec vsums4(vec a0, vec a1, vec a2, vec a3) {
  const __m256 v0 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 v1 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  return _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(v0), _mm256_castps_pd(v1))),
                       _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(v0), _mm256_castps_pd(v1))));  // i + 2, i
}
inline vec vsums_of(const vec (&w)[kLanes / 4]) {
  const __m256 y = _mm256_add_ps(_mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));  // lane 4i + m: a[i + 2m]'s
  return _mm256_permutevar8x32_ps(y, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
#else
using vec = float;
constexpr int64_t kLanes = 1;
inline vec vzero() { return 0.f; }
inline vec vload(const float* p) { return *p; }
inline vec vload(const int8_t* p) { return static_cast<float>(*p); }
inline vec vload(const c10::BFloat16* p) { return static_cast<float>(*p); }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline vec vadd(vec a, vec b) { return a + b; }
inline vec vmul(vec a, vec b) { return a * b; }
inline float vsum(vec v) { return v; }
inline vec vset1(float a) { return a; }
inline void vstore(float* p, vec v) { *p = v; }
#endif

// The fused ops' row helpers (cpu_fused.cpp, cpu_step.cpp).

// a . b as kLanes partial sums, summed by vsum (a tree on the SIMD forms): the norms' sums of squares and
// the decode attention's scores. An `omp simd` reduction ended in a sequential sum of its lanes through
// memory, which was ~2/3 of the attention's time at one request (perf, 2-core AMD Zen 4)
template <typename B>  // float, or c10::BFloat16 (widened exactly)
inline float dot(const float* a, const B* b, int64_t n) {
  vec acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
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

// out[i] = silu(gate[i]) * up[i] for i < inter, where up = gate + inter (one row of silu_and_mul)
inline void silu_row(const float* gate, int64_t inter, float* out) {
  const float* up = gate + inter;
#pragma omp simd
  for (int64_t i = 0; i < inter; ++i) out[i] = gate[i] / (1.f + exp_approx(-gate[i])) * up[i];
}


// the panel GEMMs' panels (cpu_gemm.cpp, cpu_bf16.cpp, cpu_int8.cpp): two vectors of output columns
constexpr int64_t kPanel = 2 * kLanes;

// A panel GEMM tile's end: out[r, col0 + c] = fma(acc[r], scale, bias) + residual[r] for r < T, c < cols
// (each of scale [N], bias [N], residual [T rows of N] optional; acc[r]: V vectors of output columns)
template <int T, int V>
inline void store_tile(const vec (&acc)[T][V], int64_t cols, const float* scale, const float* bias,
                       const float* residual, float* out, int64_t n, int64_t col0) {
  for (int r = 0; r < T; ++r) {
    float sums[V * kLanes];
    for (int j = 0; j < V; ++j) vstore(sums + j * kLanes, acc[r][j]);
    for (int64_t c = 0; c < cols; ++c) {
      float v = sums[c];
      // the scale and bias in one explicit fused multiply-add: left as v * scale + bias, the compiler
      // fuses them where the ISA has FMA and not where it lacks it, and the forms' bits would differ
      if (scale != nullptr) v = std::fma(v, scale[col0 + c], bias != nullptr ? bias[col0 + c] : 0.f);
      else if (bias != nullptr) v += bias[col0 + c];
      if (residual != nullptr) v += residual[r * n + col0 + c];
      out[r * n + col0 + c] = v;
    }
  }
}

// The panel GEMMs' walk over [rows, count panels]: each thread owns a run of panels (and claims runs of what is
// left as it finishes: parallel_claims); rows go by in chunks of `chunk` that stay in L2 while the run's panels
// stream past, in tiles of up to `tile_rows`.
// tile(r, t, p, fetch) computes rows [r, r + t) against panel p; `fetch`: the first tile of a panel, which
// fetches the run's next panel into cache meanwhile (a panel read from memory only when its first tile
// needs it stalls that tile at few rows).
template <typename Tile>
void panel_walk(int64_t rows, int64_t count, int64_t tile_rows, int64_t chunk, const Tile& tile) {
  parallel_claims(count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t r1 = std::min(rows, r0 + chunk);
      for (int64_t p = begin; p < end; ++p) {
        bool fetch = p + 1 < end;
        for (int64_t r = r0; r < r1; r += tile_rows, fetch = false) tile(r, std::min(tile_rows, r1 - r), p, fetch);
      }
    }
  });
}

// The panels of groups of k (the bf16 matmul's pairs, the int8 matmul's quads): w [N, K] laid out as
// [ceil(N / P), K / G, P, G], w[c, i] at ((p (K / G) + i / G) P + c % P) G + i % G for c in panel p,
// converted by `f`; the last panel's missing columns keep what dst holds (the caller's zero weights)
template <int64_t G, typename S, typename D, typename F>
void pack_groups(const S* src, D* dst, int64_t n, int64_t k, const F& f) {
  parallel_range(0, (n + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < n; ++c)
        for (int64_t i = 0; i < k; ++i) dst[((p * (k / G) + i / G) * kPanel + c) * G + i % G] = f(src[(p * kPanel + c) * k + i]);
  });
}

// x [R, K] float32 against `packed`, pack_groups' layout of G = `group` (of this build's kPanel) in `dtype`
// for N = n outputs: the checks both matmuls make
inline void check_groups(const at::Tensor& x, const at::Tensor& packed, int64_t n, int64_t group, at::ScalarType dtype,
                         const char* op) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4, op, ": x [R, K] and packed weights [N / P, K / G, P, G] expected");
  check_f32(x, op);
  TORCH_CHECK(packed.scalar_type() == dtype && packed.device().is_cpu() && packed.is_contiguous(), op,
              ": packed weights: contiguous CPU ", c10::toString(dtype), " expected");
  const int64_t k = x.size(1);
  TORCH_CHECK(k % group == 0 && packed.size(1) == k / group && packed.size(2) == kPanel && packed.size(3) == group, op,
              ": packed weights of this build's packing, K = x's");
  TORCH_CHECK(n > 0 && (n + kPanel - 1) / kPanel == packed.size(0), op, ": N does not match the packed weights");
}

// cpu_fused.cpp: the attention of a batch's new tokens (decode_attention's arguments, checked) and its passes.
// Token t (a row of qkv, cos, sin, out_loc and out) attends over the first seq_lens[t] slots of row
// requests[t] of `slots` (requests null: row t, a decode's one token per request)
struct Attention {
  const float *qkv = nullptr, *cos = nullptr, *sin = nullptr, *q_norm = nullptr, *k_norm = nullptr;
  void *k_cache = nullptr, *v_cache = nullptr;  // float, or c10::BFloat16 where kv_bf16 (written rounded to nearest)
  bool kv_bf16 = false;
  const int64_t *out_loc = nullptr, *slots = nullptr, *seq_lens = nullptr, *requests = nullptr;
  int64_t tokens = 0, heads = 0, kv_heads = 0, d = 0, s_max = 0;
  float eps = 0.f, scale = 0.f;
  const int64_t* starts = nullptr;  // token b's tasks: [starts[b], starts[b + 1]) (task_starts)
  float* partial = nullptr;         // partial_floats per task: what attend leaves for merge
  bool write_own = false;  // attend's last part of each token writes its K and V first (a decode: no other reads them)
};
void write_kv(const Attention& a, int64_t begin, int64_t end);  // tasks: tokens * kv_heads
std::vector<int64_t> task_starts(const Attention& a);           // attend's tasks per token (parts), as offsets
int64_t partial_floats(const Attention& a);
void attend(const Attention& a, int64_t begin, int64_t end);            // tasks [begin, end) of task_starts
void merge(const Attention& a, int64_t begin, int64_t end, float* out);  // tokens [begin, end) -> out [T, heads d]
bool check_kv_caches(const at::Tensor& k_cache, const at::Tensor& v_cache, const char* op);  // bf16?
void check_slots(const at::Tensor& out_loc, const at::Tensor& slots, const at::Tensor& seq_lens,
                 const c10::optional<at::Tensor>& requests, int64_t tokens, int64_t num_slots);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
at::Tensor decode_attention(
    const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& q_norm,
    const c10::optional<at::Tensor>& k_norm, double eps, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& out_loc, const at::Tensor& slots, const at::Tensor& seq_lens, int64_t heads, int64_t kv_heads,
    double scale, const c10::optional<at::Tensor>& requests);

// A greedy decode step's inputs from the decode service's buffers (cpu_token_step.cpp): x [B, hidden], cos and
// sin [B, head_dim], out_loc [B], slots [B, S_max], seq_lens [B], as decode_logits takes them
struct StepInputs {
  at::Tensor x, cos, sin, out_loc, slots, seq_lens;
};
StepInputs step_inputs(const at::Tensor& token_ids, const at::Tensor& rows, const at::Tensor& req_to_token,
                       const at::Tensor& kv_lens, const at::Tensor& embed, const at::Tensor& cos_table,
                       const at::Tensor& sin_table, int64_t num_slots);
void stash_tokens(const at::Tensor& token_ids, const at::Tensor& rows, const at::Tensor& tokens);


// The linears' bodies on raw data, over [begin, end) of their outputs (the gemv: weight rows; the matmuls:
// panels, the ranges they take from Claims), called by their ops over parallel ranges and by decode_layers'
// one-region step per thread. The matmuls' `_part`s take x [rows <= kStepRows, K] as float32 and round or quantize
// it on the calling thread, once for all the ranges it takes (int8_rows_part: more rows, quantized by the team).
constexpr int64_t kStepRows = 2;
// the most rows decode_layers' one-region step takes (packed_linear.GEMV_ROWS)
constexpr int64_t kRegionRows = 64;

// cpu_gemv.cpp
template <typename W>  // float, c10::BFloat16, int8_t (with scale)
void gemv_part(const float* x, int64_t rows, const W* w, const float* scale, const float* bias, const float* residual,
               float* out, int64_t n, int64_t k, int64_t begin, int64_t end);
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                const c10::optional<at::Tensor>& residual);
at::Tensor gemv_w8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale,
                   const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual);
at::Tensor stream_sum(const at::Tensor& x, int64_t streams);
int64_t row_streams(int64_t streams);

// cpu_gemm.cpp. The panel GEMM's tiles take up to kTileRows rows; x's `rows` rows go in groups of
// panel_group(rows), as even as tiles of that many make them (16 rows: two of 8, not 12 and 4, whose 4-row tile
// loads two weight vectors per 8 FMAs), k-major ([groups, k, g]: packed_floats(rows, k) floats; a group's rows
// share cache lines, so threads packing side by side take whole groups). pack_rows: rows [r0, r1) of x [rows, k]
// into them; panels_part: the panel GEMM of `rows` packed rows over the panels `claims` gives (W: float,
// c10::BFloat16, or int8_t with `scale` [n])
constexpr int kTileRows = kLanes == 16 ? 12 : 6;  // 2T accumulators + 2 weight vectors + 1 broadcast <= registers
int64_t panel_group(int64_t rows);
int64_t packed_floats(int64_t rows, int64_t k);
void pack_rows(const float* x, int64_t rows, int64_t r0, int64_t r1, int64_t k, float* packed);
template <typename W>
void panels_part(const float* packed, int64_t rows, const W* panels, const float* scale, const float* bias,
                 const float* residual, float* out, int64_t n, int64_t k, Claims& claims);
at::Tensor pack_panels(const at::Tensor& w);
at::Tensor gemm_panels(const at::Tensor& x, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias,
                       const c10::optional<at::Tensor>& residual, const c10::optional<at::Tensor>& scale);

// cpu_bf16.cpp
void bf16_part(const float* x, int64_t rows, const uint16_t* pairs, const float* bias, const float* residual,
               float* out, int64_t n, int64_t k, Claims& panels);
at::Tensor pack_bf16_pairs(const at::Tensor& w);
at::Tensor gemm_bf16(const at::Tensor& x, const at::Tensor& pairs, int64_t n, const c10::optional<at::Tensor>& bias,
                     const c10::optional<at::Tensor>& residual);

// cpu_int8.cpp. QuantizedRows: x's rows quantized for the int8 matmul, in its groups of rows, k-major (per group
// quads [K / 4, G], scales and starts [K / block, G]; a short group's missing rows never read), sized by `size`
// for `rows` rows of up to k inputs; quantize_into: rows [r0, r1) of x [rows, k] into it (any thread its own
// rows); int8_rows_part: the int8 matmul of q's `rows` rows (more than kStepRows) over the panels `panels` gives
struct QuantizedRows {
  std::vector<int32_t> quads, starts;
  std::vector<float> scales;
  void size(int64_t rows, int64_t k, int64_t block);
};
void quantize_into(const float* x, int64_t r0, int64_t r1, int64_t k, int64_t block, QuantizedRows& q);
void int8_rows_part(const QuantizedRows& q, int64_t rows, const uint8_t* quads, const c10::BFloat16* scales,
                    int64_t scale_blocks, const float* bias, const float* residual, float* out, int64_t n, int64_t k,
                    int64_t block, Claims& panels);
void int8_part(const float* x, int64_t rows, const uint8_t* quads, const c10::BFloat16* scales, int64_t scale_blocks,
               const float* bias, const float* residual, float* out, int64_t n, int64_t k, int64_t block,
               Claims& panels);
int64_t int8_streams(int64_t streams);
at::Tensor pack_int8_quads(const at::Tensor& w);
at::Tensor pack_int8_scales(const at::Tensor& scale);
at::Tensor gemm_int8(const at::Tensor& x, const at::Tensor& quads, const at::Tensor& scales, int64_t n, int64_t block,
                     const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& residual);

// cpu_argmax.cpp: a part of a row's best, its value and the first index holding it (a NaN counts as the largest;
// index -1: an empty part)
struct Best {
  float value;
  int64_t index;
};
Best best_of(const float* x, int64_t n, int64_t first);  // x[0, n), n > 0, `first` the index of x[0]
Best better(const Best& b, const Best& c);               // b's part met before c's in the scan
at::Tensor argmax_rows(const at::Tensor& x);

// cpu_candidates.cpp: the greedy head's candidates in the one-region step. top_candidates: the k largest of x[0, n)
// (`first` the index of x[0]) into out[0, k) in any order (missing ones index -1); false where x has a value that
// is not finite. settle_candidates: of `count` candidates (the threads' tops), the argmax of the exact logits
// (`weight` [vocab, hidden] float32 rows by the gemv, written to `logits` at their ids) where `bound` proves it
// among the k best, else -1. candidates_bound: D of normed row h (greedy_head.py's bound, without the input's and
// the output's bf16 rounding)
bool top_candidates(const float* x, int64_t n, int64_t first, int64_t k, Best* out);
int64_t settle_candidates(Best* found, int64_t count, int64_t k, double bound, const float* h, int64_t hidden,
                          const float* weight, float* logits, int64_t vocab);
double candidates_bound(const float* h, int64_t hidden, double weight_err, double low_norm);

}  // namespace disagg_cpu
