// y[M, N] = x[M, K] . w[N, K]^T for few rows M on x86-64 CPUs with AVX2 and FMA, as an XLA
// FFI custom call (jakiro_jax/kernels/small_rows.py builds and registers it).
//
// Why: XLA's CPU dot reads the weight once at M = 1 (its own matrix-vector kernel) but
// calls a library GEMM for M >= 2 that repacks the weight on every call and whose register
// tiles assume many rows, so a speculative verify over 4-12 tokens cost 2-3 decode steps.
// Here the weight stays as the model stores it, [out, in] row-major (each output's weights
// contiguous), and is read from memory once per call: a block of 4 outputs (4 x K floats,
// L1-resident) is swept by every group of 2 or 3 rows, up to 12 vector accumulators in
// registers.
//
// Determinism: every y element is the same sequence of fp32 operations whatever M and
// whichever tile computes it (8 lanes each accumulate k = lane mod 8 in increasing k by
// FMA, a fixed horizontal sum, then the K mod 8 tail by FMA), so a verify forward over
// several tokens gives bit-for-bit the logits the one-token decode step gives.
//
// Threads: the output columns are split over XLA's intra-op thread pool.

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float HorizontalSum(__m256 v) {
  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): fixed for every element.
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  __m128 shuf = _mm_movehl_ps(s, s);
  s = _mm_add_ps(s, shuf);
  shuf = _mm_shuffle_ps(s, s, 0x55);
  s = _mm_add_ss(s, shuf);
  return _mm_cvtss_f32(s);
}

// R rows x C outputs: y[r, c] for rows x[0..R) and outputs w[0..C).
// While it computes, the tile prefetches P cache lines per 16 k, from `prefetch` on, so
// that the memory stream of the next block overlaps this block's arithmetic (prefetches
// never fault: a caller without a next block passes its own weights). From two rows on
// the k loop is unrolled twice, which leaves the front end room for the FMAs (at 12 rows
// a sweep of SmolLM2's projections went from 31-39 to 25-28 ms on 2 cores).
template <int R, int C, int P>
inline void Tile(const float* x, int64_t k_total, const float* w, float* y, int64_t ldy,
                 const float* prefetch) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* xr[R];
  const float* wc[C];
  for (int r = 0; r < R; ++r) xr[r] = x + r * k_total;
  for (int c = 0; c < C; ++c) wc[c] = w + c * k_total;
  auto step = [&](int64_t k) {
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(xr[r] + k);
    for (int c = 0; c < C; ++c) {
      const __m256 wv = _mm256_loadu_ps(wc[c] + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  };
  const int64_t k_vec = k_total - k_total % 8;
  int64_t k = 0;
  if constexpr (R == 1) {  // bound by its loads: as the decode step always ran
    for (; k < k_vec; k += 8) {
      if (k % 16 == 0) {
        for (int p = 0; p < P; ++p)
          _mm_prefetch(reinterpret_cast<const char*>(prefetch + 16 * p), _MM_HINT_T0);
        prefetch += 16 * P;
      }
      step(k);
    }
  } else {
    for (; k + 16 <= k_vec; k += 16) {
      for (int p = 0; p < P; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + 16 * p), _MM_HINT_T0);
      prefetch += 16 * P;
      step(k);
      step(k + 8);
    }
    if (k < k_vec) step(k);
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = HorizontalSum(acc[r][c]);
      for (int64_t kk = k_vec; kk < k_total; ++kk)
        s = std::fma(x[r * k_total + kk], w[c * k_total + kk], s);
      y[r * ldy + c] = s;
    }
  }
}

// Every row against a block of C outputs, in groups of 2 or 3 rows (a 1-row tile is
// bound by its loads; 4 rows as 2 + 2 ran a sweep of SmolLM2's projections 13% faster
// than 3 + 1). Group g prefetches the g-th share of the next block (C x K contiguous
// floats), so the memory stream runs through the whole block's arithmetic.
template <int C, int P>
inline void Groups(const float* x, int64_t rows, int64_t k_total, const float* w, float* y,
                   int64_t ldy, const float* next, int64_t groups, int64_t share) {
  const int64_t base = rows / groups, longer = rows % groups;
  for (int64_t g = 0, r = 0; g < groups; ++g, next += share) {
    const int64_t n = base + (g < longer);
    const float* xg = x + r * k_total;
    float* yg = y + r * ldy;
    if (n == 3) Tile<3, C, P>(xg, k_total, w, yg, ldy, next);
    else if (n == 2) Tile<2, C, P>(xg, k_total, w, yg, ldy, next);
    else Tile<1, C, P>(xg, k_total, w, yg, ldy, next);
    r += n;
  }
}

template <int C>
inline void Columns(const float* x, int64_t rows, int64_t k_total, const float* w, float* y,
                    int64_t ldy, const float* next) {
  const int64_t groups = (rows + 2) / 3;
  const int64_t lines = (C + groups - 1) / groups;  // per 16 k of each group
  const int64_t share = lines * 16 * (k_total / 16);
  if (next == nullptr) next = w;
  if (lines >= 4) Groups<C, 4>(x, rows, k_total, w, y, ldy, next, groups, share);
  else if (lines >= 2) Groups<C, 2>(x, rows, k_total, w, y, ldy, next, groups, share);
  else Groups<C, 1>(x, rows, k_total, w, y, ldy, next, groups, share);
}

// Outputs [n_begin, n_end) of every row.
void Range(const float* x, int64_t rows, int64_t k_total, const float* w, float* y,
           int64_t n_total, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (rows == 1) {  // one row: wider tiles, the weight is the whole traffic
    for (; n + 8 <= n_end; n += 8)
      Tile<1, 8, 8>(x, k_total, w + n * k_total, y + n, n_total,
                    w + (n + 8 < n_end ? n + 8 : n) * k_total);
  }
  for (; n + 4 <= n_end; n += 4)
    Columns<4>(x, rows, k_total, w + n * k_total, y + n, n_total,
               n + 4 < n_end ? w + (n + 4) * k_total : nullptr);
  for (; n < n_end; ++n) Columns<1>(x, rows, k_total, w + n * k_total, y + n, n_total, nullptr);
}

ffi::Error SmallRowMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("small_row_matmul: want x [M, K] and w [N, K]");
  const int64_t rows = xd[0], k_total = xd[1], n_total = wd[0];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // Chunks of whole 8-output blocks, about 128 KiB of weights or more each. The caller
  // and pool tasks claim chunks from a shared counter; a task that finds none left returns
  // at once, so the caller only ever waits for chunks being computed (never for a task
  // queued behind another call's, which could deadlock when XLA runs calls concurrently).
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t min_cols = std::max<int64_t>(8, (32768 / std::max<int64_t>(k_total, 1)) & ~7);
  const int64_t chunks = std::min<int64_t>(8 * threads, std::max<int64_t>(1, n_total / min_cols));
  if (chunks <= 1) {
    Range(xp, rows, k_total, wp, yp, n_total, 0, n_total);
    return ffi::Error::Success();
  }
  const int64_t per = ((n_total + chunks - 1) / chunks + 7) & ~int64_t{7};
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto work = [=] {
    for (int64_t c; (c = shared->next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t begin = std::min(n_total, c * per), end = std::min(n_total, (c + 1) * per);
      if (begin < end) Range(xp, rows, k_total, wp, yp, n_total, begin, end);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min(threads, chunks); ++t) pool.Schedule([work] { work(); });
  work();
  for (int spins = 0; shared->done.load(std::memory_order_acquire) < chunks; ++spins) {
    if (spins < 4096) _mm_pause(); else std::this_thread::yield();
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallRowMatmul, SmallRowMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
