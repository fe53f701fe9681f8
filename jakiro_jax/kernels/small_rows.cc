// y[M, N] = x[M, K] . w[N, K]^T for few rows M on x86-64 CPUs with AVX2 and FMA, as an XLA
// FFI custom call (jakiro_jax/kernels/small_rows.py builds and registers it).
//
// Why: XLA's CPU dot reads the weight once at M = 1 (its own matrix-vector kernel) but
// calls a library GEMM for M >= 2 that repacks the weight on every call and whose register
// tiles assume many rows, so a speculative verify over 4-12 tokens cost 2-3 decode steps.
// Here the weight stays as the model stores it, [out, in] row-major (each output's weights
// contiguous), and is read from memory once per call: a block of 4 outputs (4 x K floats,
// L1-resident) is swept by every group of 3 rows, 12 vector accumulators in registers.
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
// `prefetch` (or null): the next outputs' weights, C rows of K, of which the rows in
// `pf_mask` are fetched while this tile computes, so that the memory stream overlaps the
// arithmetic of the block before it.
template <int R, int C>
inline void Tile(const float* x, int64_t k_total, const float* w, float* y, int64_t ldy,
                 const float* prefetch = nullptr, unsigned pf_mask = ~0u) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t k_vec = k_total - k_total % 8;
  for (int64_t k = 0; k < k_vec; k += 8) {
    if (prefetch != nullptr && k % 16 == 0) {
      for (int c = 0; c < C; ++c)
        if (pf_mask & (1u << c))
          _mm_prefetch(reinterpret_cast<const char*>(prefetch + c * k_total + k), _MM_HINT_T0);
    }
    __m256 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm256_loadu_ps(x + r * k_total + k);
    for (int c = 0; c < C; ++c) {
      const __m256 wv = _mm256_loadu_ps(w + c * k_total + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float s = HorizontalSum(acc[r][c]);
      for (int64_t k = k_vec; k < k_total; ++k)
        s = std::fma(x[r * k_total + k], w[c * k_total + k], s);
      y[r * ldy + c] = s;
    }
  }
}

template <int C>
inline void Columns(const float* x, int64_t rows, int64_t k_total, const float* w, float* y,
                    int64_t ldy, const float* next) {
  // Row group g brings in rows c = g mod groups of the next block, so the memory stream
  // runs through the whole block's arithmetic instead of the first group's alone (at 12
  // rows this took a sweep of SmolLM2's projections from 43 to 34 ms on 2 cores).
  const int64_t groups = std::min<int64_t>((rows + 2) / 3, C);
  int64_t r = 0, g = 0;
  auto mask = [groups](int64_t group) {
    unsigned m = 0;
    for (int c = 0; c < C; ++c)
      if (group < groups && c % groups == group) m |= 1u << c;
    return m;
  };
  for (; r + 3 <= rows; r += 3, ++g) {
    const unsigned m = mask(g);
    Tile<3, C>(x + r * k_total, k_total, w, y + r * ldy, ldy, m ? next : nullptr, m);
  }
  const unsigned m = mask(g);
  if (rows - r == 2) Tile<2, C>(x + r * k_total, k_total, w, y + r * ldy, ldy, m ? next : nullptr, m);
  if (rows - r == 1) Tile<1, C>(x + r * k_total, k_total, w, y + r * ldy, ldy, m ? next : nullptr, m);
}

// Outputs [n_begin, n_end) of every row.
void Range(const float* x, int64_t rows, int64_t k_total, const float* w, float* y,
           int64_t n_total, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  if (rows == 1) {  // one row: wider tiles, the weight is the whole traffic
    for (; n + 8 <= n_end; n += 8)
      Tile<1, 8>(x, k_total, w + n * k_total, y + n, n_total,
                 n + 8 < n_end ? w + (n + 8) * k_total : nullptr);
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
