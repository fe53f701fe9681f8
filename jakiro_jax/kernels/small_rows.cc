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

// Calls work(i) for i in [0, count) on up to `tasks` threads: the caller and pool tasks
// claim indices from a shared counter; a task that finds none left returns at once, so
// the caller only ever waits for work being done (never for a task queued behind
// another call's, which could deadlock when XLA runs calls concurrently). `make_work()`
// gives each thread its own callable (and so its own buffers).
template <typename MakeWork>
void ParallelFor(ffi::ThreadPool& pool, int64_t count, int64_t tasks, MakeWork make_work) {
  if (tasks <= 1 || count <= 1) {
    auto work = make_work();
    for (int64_t i = 0; i < count; ++i) work(i);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto task = [=] {
    auto work = make_work();
    for (int64_t i; (i = shared->next.fetch_add(1, std::memory_order_relaxed)) < count;) {
      work(i);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < std::min(tasks, count); ++t) pool.Schedule([task] { task(); });
  task();
  for (int spins = 0; shared->done.load(std::memory_order_acquire) < count; ++spins) {
    if (spins < 4096) _mm_pause(); else std::this_thread::yield();
  }
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
  // Chunks of whole 8-output blocks, about 128 KiB of weights or more each.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t min_cols = std::max<int64_t>(8, (32768 / std::max<int64_t>(k_total, 1)) & ~7);
  const int64_t chunks = std::min<int64_t>(8 * threads, std::max<int64_t>(1, n_total / min_cols));
  const int64_t per = ((n_total + chunks - 1) / chunks + 7) & ~int64_t{7};
  ParallelFor(pool, chunks, threads, [=] {
    return [=](int64_t c) {
      const int64_t begin = std::min(n_total, c * per), end = std::min(n_total, (c + 1) * per);
      if (begin < end) Range(xp, rows, k_total, wp, yp, n_total, begin, end);
    };
  });
  return ffi::Error::Success();
}


// Attention of few query rows over a stacked KV cache, reading only the slots the mask
// shows (up to the last one of each row) and each layer's K and V in place.
//
// q [B, T, K, G, H], caches [L, B, K, S, H] (layer `layer`), mask [B, T, S'] (S' <= S:
// the first S' slots) -> out [B, T, K, G, H]; all fp32. The G x T query rows of a (batch
// row, kv head) go in a few chunks, each a task with one pass over the slots (two threads
// share out 3 kv heads evenly; the rows of a chunk share each 8-slot block of keys). A row's result is the same sequence of
// fp32 operations whatever T, S, S' or the other rows (a score: 8 lanes of FMA over the
// head dim, a fixed horizontal sum, the tail by FMA; the softmax's sum and the weighted
// values in increasing slot order), so a verify's attention gives the decode step's bit
// for bit. A row that sees no slot gets zeros.

inline float Dot(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = HorizontalSum(acc);
  for (; i < n; ++i) sum = std::fma(a[i], b[i], sum);
  return sum;
}

inline void Axpy(float p, const float* v, float* out, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
  for (; i < n; ++i) out[i] = std::fma(p, v[i], out[i]);
}

struct AttentionShape {
  int64_t batch, tokens, kv, groups, head, slots, seen;
  float scale;
};

// e^x for x <= 0, 8 lanes (Cephes' expf: 2^n times a degree-6 polynomial of the
// remainder; within 2 ulp); under -87 it is 0.
inline __m256 ExpNonPositive(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                             _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i power = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(power)));
}

// q . k for the 8 slots k[0..8) (rows of H floats, H a multiple of 8): 8 independent
// accumulators over the head dim, then one fixed transposing sum.
inline __m256 Dots8(const float* q, const float* k, int64_t H) {
  __m256 a[8];
  for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
  for (int64_t i = 0; i < H; i += 8) {
    const __m256 qv = _mm256_loadu_ps(q + i);
    for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + j * H + i), a[j]);
  }
  __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// Rows [r0, r1) of the G x T query rows (row r: token r / G, group r % G) of batch row b,
// kv head h. Scores: slots in groups of 8 from slot 0, each by `Dots8` (a group that would
// pass the cache's end is read from a zero-padded copy); the weighted values: each output
// element summed by FMA in increasing slot order from 0, in registers. A row's result is
// the same bits in every call, whichever rows share its call or task.
void AttendRows(const AttentionShape& d, const float* q, const float* keys, const float* values,
                const bool* mask, float* out, int64_t b, int64_t h, int64_t r0, int64_t r1,
                float* scores, float* visible, int64_t* filled, float* padded) {
  const int64_t H = d.head, G = d.groups, T = d.tokens;
  const int64_t width = (d.seen + 7) / 8 * 8;  // a row's stride in scores / visible
  const float* k_head = keys + (b * d.kv + h) * d.slots * H;
  const float* v_head = values + (b * d.kv + h) * d.slots * H;
  const bool vectors = H % 8 == 0;
  const int64_t t0 = r0 / G, t1 = (r1 + G - 1) / G;
  int64_t longest = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const bool* m = mask + (b * T + t) * d.seen;
    int64_t f = d.seen;
    while (f > 0 && !m[f - 1]) --f;
    filled[t] = f;
    longest = std::max(longest, f);
    float* vis = visible + t * width;
    for (int64_t s = 0; s < (f + 7) / 8 * 8; ++s) vis[s] = s < f && m[s] ? 1.0f : 0.0f;
  }
  auto q_row = [&](int64_t r) { return q + (((b * T + r / G) * d.kv + h) * G + r % G) * H; };
  auto out_row = [&](int64_t r) { return out + (((b * T + r / G) * d.kv + h) * G + r % G) * H; };
  const __m256 scale = _mm256_set1_ps(d.scale);
  for (int64_t s0 = 0; s0 < longest; s0 += 8) {
    const float* k = k_head + s0 * H;
    if (vectors && s0 + 8 > d.slots) {
      std::fill(padded, padded + 8 * H, 0.0f);
      std::copy(k, k + (d.slots - s0) * H, padded);
      k = padded;
    }
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = r / G;
      if (s0 >= filled[t]) continue;
      float* sc = scores + r * width + s0;
      if (vectors) {
        _mm256_storeu_ps(sc, _mm256_mul_ps(Dots8(q_row(r), k, H), scale));
      } else {
        for (int64_t j = 0; j < 8; ++j)
          sc[j] = s0 + j < filled[t] ? Dot(q_row(r), k_head + (s0 + j) * H, H) * d.scale : 0.0f;
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t t = r / G, f = filled[t], groups = (f + 7) / 8;
    const float* vis = visible + t * width;
    float* sc = scores + r * width;
    float* o = out_row(r);
    std::fill(o, o + H, 0.0f);
    if (f == 0) continue;
    // Weights: e^(score - top) where visible, else exactly 0, summed by slot mod 8, divided.
    // (The top is a max: the same whatever order it is taken in.)
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    for (int64_t c = 0; c < groups; ++c) {
      const __m256 seen_here = _mm256_cmp_ps(_mm256_loadu_ps(vis + c * 8),
                                             _mm256_setzero_ps(), _CMP_NEQ_OQ);
      top8 = _mm256_max_ps(top8, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY),
                                                  _mm256_loadu_ps(sc + c * 8), seen_here));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top8);
    float top = -INFINITY;
    for (int j = 0; j < 8; ++j) top = std::max(top, lanes[j]);
    __m256 sum = _mm256_setzero_ps();
    const __m256 top_v = _mm256_set1_ps(top);
    for (int64_t c = 0; c < groups; ++c) {
      const __m256 seen_here = _mm256_cmp_ps(_mm256_loadu_ps(vis + c * 8),
                                             _mm256_setzero_ps(), _CMP_NEQ_OQ);
      const __m256 x = _mm256_min_ps(_mm256_sub_ps(_mm256_loadu_ps(sc + c * 8), top_v),
                                     _mm256_setzero_ps());
      const __m256 e = _mm256_and_ps(seen_here, ExpNonPositive(x));
      _mm256_storeu_ps(sc + c * 8, e);
      sum = _mm256_add_ps(sum, e);
    }
    const __m256 total = _mm256_set1_ps(HorizontalSum(sum));
    for (int64_t c = 0; c < groups; ++c)
      _mm256_storeu_ps(sc + c * 8, _mm256_div_ps(_mm256_loadu_ps(sc + c * 8), total));
    // out = sum over visible slots in order of weight x value: 64 columns at a time in
    // registers (the same FMAs, in the same order, as adding into memory slot by slot).
    int64_t col = 0;
    if (vectors) {
      for (; col + 64 <= H; col += 64) {
        __m256 acc[8];
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t s = 0; s < f; ++s) {
          if (vis[s] == 0.0f) continue;
          const __m256 p = _mm256_set1_ps(sc[s]);
          const float* v = v_head + s * H + col;
          for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + col + 8 * i, acc[i]);
      }
    }
    if (col < H) {
      for (int64_t s = 0; s < f; ++s)
        if (vis[s] != 0.0f) Axpy(sc[s], v_head + s * H + col, o + col, H - col);
    }
  }
}

// Per-thread buffers: a row's scores and visibility (whole groups of 8 slots) and one
// zero-padded group of keys.
struct Scratch {
  explicit Scratch(const AttentionShape& d)
      : scores(new float[d.tokens * d.groups * ((d.seen + 7) / 8 * 8) + 8]),
        visible(new float[d.tokens * ((d.seen + 7) / 8 * 8) + 8]),
        filled(new int64_t[d.tokens]),
        padded(new float[8 * d.head]) {}
  std::unique_ptr<float[]> scores, visible;
  std::unique_ptr<int64_t[]> filled;
  std::unique_ptr<float[]> padded;
};

ffi::Error CacheAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k_cache, ffi::Buffer<ffi::F32> v_cache,
                              ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                              int64_t layer) {
  auto qd = q.dimensions();
  auto kd = k_cache.dimensions();
  auto md = mask.dimensions();
  auto vd = v_cache.dimensions();
  bool same = vd.size() == kd.size();
  for (size_t i = 0; same && i < kd.size(); ++i) same = vd[i] == kd[i];
  if (qd.size() != 5 || kd.size() != 5 || md.size() != 3 || !same ||
      kd[1] != qd[0] || kd[2] != qd[2] || kd[4] != qd[4] || md[0] != qd[0] ||
      md[1] != qd[1] || md[2] > kd[3] || layer < 0 || layer >= kd[0])
    return ffi::Error::InvalidArgument(
        "cache_attention: want q [B, T, K, G, H], caches [L, B, K, S, H], mask [B, T, S' <= S]");
  AttentionShape d{qd[0], qd[1], qd[2], qd[3], qd[4], kd[3], md[2],
                   1.0f / std::sqrt(static_cast<float>(qd[4]))};
  const int64_t layer_size = d.batch * d.kv * d.slots * d.head;
  const float* keys = k_cache.typed_data() + layer * layer_size;
  const float* values = v_cache.typed_data() + layer * layer_size;
  const float* qp = q.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  const int64_t units = d.batch * d.kv, rows = d.tokens * d.groups;
  // Past about 10^5 multiply-adds a (batch row, kv head) pair is worth a thread; its rows
  // split into chunks so that two threads share out few kv heads evenly (a row's result
  // does not depend on which rows share its task).
  const int64_t work = units * rows * d.seen * d.head;
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t tasks = work < (int64_t{1} << 17) ? 1 : threads;
  const int64_t chunks = tasks == 1 ? 1 : std::min<int64_t>(rows, (2 * tasks + units - 1) / units);
  const int64_t per = (rows + chunks - 1) / chunks;
  ParallelFor(pool, units * chunks, tasks, [=] {
    return [=, scratch = std::make_shared<Scratch>(d)](int64_t i) {
      const int64_t u = i / chunks, c = i % chunks;
      const int64_t r0 = c * per, r1 = std::min(rows, r0 + per);
      if (r0 >= r1) return;
      AttendRows(d, qp, keys, values, mp, op, u / d.kv, u % d.kv, r0, r1,
                 scratch->scores.get(), scratch->visible.get(), scratch->filled.get(),
                 scratch->padded.get());
    };
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(SmallRowMatmul, SmallRowMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(CacheAttention, CacheAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("layer"));
