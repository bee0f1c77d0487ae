// Softmax attention on float32 [pairs, seq, head_dim] (one (batch, head) pair per leading
// index), causal or not (the ``causal`` attribute), forward and backward, as XLA FFI handlers
// for the CPU backend (core/fusions/fused_attention.py builds and registers them).
//
// Flash attention's algorithm, one pair at a time so its working set (a [block, seq] score
// tile, K and V transposed) stays in cache: the forward keeps only the output and the row
// log-sum-exp, the backward recomputes P = exp(S - lse) per query block, and with ``causal`` query
// block i only meets key blocks 0..i (else every key block). The backward's D = rowsum(dO * O)
// and P come from the given O and lse, so with the O and lse of a larger attention (ring
// attention's global ones) it returns this key range's share of that attention's gradients. The matmuls use register-tiled micro-kernels (the accumulator tile
// lives in vector registers, one operand broadcast, the other streamed) instead of BLAS calls:
// the tiles are too small for a BLAS's packing to pay off. Pairs are spread over XLA's
// intra-op thread pool. Every pair is computed in a fixed order, so results are deterministic.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Shapes come in multiples of kUnit; vectors are one register of the target ISA, and the GEMM
// tiles are sized to its register file. AVX2's tiles on AVX-512's 32 registers would waste
// half of them; AVX-512's on AVX2's 16 registers spill every accumulator (measured on an AVX2
// EPYC: the whole GPT step 4.4 s instead of 1.9 s with XLA's attention).
constexpr int kUnit = 16;
#if defined(__AVX512F__)
constexpr int kLanes = 16;                 // one zmm register
constexpr int kWideRows = 6, kWideVecs = 4;  // 24 accumulators + 4 B vectors of 32 registers
#elif defined(__AVX__)
constexpr int kLanes = 8;                  // one ymm register
constexpr int kWideRows = 6, kWideVecs = 2;  // 12 accumulators + 2 B vectors of 16 registers
#else
constexpr int kLanes = 4;                  // one xmm register (SSE, NEON)
constexpr int kWideRows = 6, kWideVecs = 2;
#endif
static_assert(kUnit % kLanes == 0, "shapes must split into whole vectors");
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

inline float Sum(Vec v) {
  float total = 0.f;
  for (int j = 0; j < kLanes; ++j) total += v[j];
  return total;
}

// C[MR x kLanes*NV] = (accumulate ? C : 0) + alpha * A B, with A(r, k) = A[r * ars + k * aks] and
// B row-major [K, ldb]: MR x NV accumulators in registers, B's row streamed, A broadcast.
template <int MR, int NV>
inline void Tile(int64_t K, const float* A, int64_t ars, int64_t aks, const float* B, int64_t ldb, float alpha,
                 float* C, int64_t ldc, bool accumulate) {
  Vec acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[r][j] = Vec{};
  for (int64_t k = 0; k < K; ++k) {
    Vec b[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) b[j] = Load(B + k * ldb + j * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const float a = A[r * ars + k * aks];
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] += a * b[j];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      float* c = C + r * ldc + j * kLanes;
      Store(c, accumulate ? Load(c) + alpha * acc[r][j] : alpha * acc[r][j]);
    }
}

// All M rows of one kLanes*NV-column strip: full tiles of MR rows, then one narrower tile.
template <int MR, int NV>
void Strip(int64_t M, int64_t K, const float* A, int64_t ars, int64_t aks, const float* B, int64_t ldb, float alpha,
           float* C, int64_t ldc, bool accumulate) {
  int64_t r = 0;
  for (; r + MR <= M; r += MR) Tile<MR, NV>(K, A + r * ars, ars, aks, B, ldb, alpha, C + r * ldc, ldc, accumulate);
  A += r * ars;
  C += r * ldc;
  switch (M - r) {
#define MCJ_TAIL(n) \
  case n:           \
    if constexpr (n < MR) Tile<n, NV>(K, A, ars, aks, B, ldb, alpha, C, ldc, accumulate); \
    break;
    MCJ_TAIL(1) MCJ_TAIL(2) MCJ_TAIL(3) MCJ_TAIL(4) MCJ_TAIL(5) MCJ_TAIL(6) MCJ_TAIL(7)
#undef MCJ_TAIL
    default:
      break;
  }
}

// C[M, N] (+)= alpha * A B for N a multiple of kLanes: wide strips (kWideRows x kWideVecs
// accumulators), then one-vector strips (8 x 1).
void Gemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t ars, int64_t aks, const float* B, int64_t ldb,
          float alpha, float* C, int64_t ldc, bool accumulate) {
  constexpr int64_t wide = kWideVecs * kLanes;
  int64_t c = 0;
  for (; c + wide <= N; c += wide)
    Strip<kWideRows, kWideVecs>(M, K, A, ars, aks, B + c, ldb, alpha, C + c, ldc, accumulate);
  for (; c < N; c += kLanes) Strip<8, 1>(M, K, A, ars, aks, B + c, ldb, alpha, C + c, ldc, accumulate);
}

typedef int32_t IVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// exp(x) for x <= 0 (Cephes' expf: 2^n times a degree-5 polynomial on [-ln2/2, ln2/2], ~1 ulp),
// 0 below -87 where float32 underflows, NaN kept.
inline Vec Exp(Vec x) {
  const IVec nan = x != x, under = x < -87.f;
  const Vec in = x;
  x = under ? Vec{} - 87.f : x;
  const Vec fx = x * 1.44269504088896341f + 0.5f;
  Vec n = __builtin_convertvector(__builtin_convertvector(fx, IVec), Vec);  // truncates towards 0
  n = n + __builtin_convertvector(n > fx, Vec);                              // -1 where that rounded up: floor
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  Vec p = Vec{} + 1.9875691500e-4f;
  p = p * x + 1.3981999507e-3f;
  p = p * x + 8.3334519073e-3f;
  p = p * x + 4.1665795894e-2f;
  p = p * x + 1.6666665459e-1f;
  p = p * x + 5.0000001201e-1f;
  p = p * x * x + x + 1.f;
  const IVec bits = (__builtin_convertvector(n, IVec) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const Vec out = under ? Vec{} : p * scale;
  return nan ? in : out;
}

// out[cols, rows] = x[rows, cols]^T in kLanes x kLanes blocks, so the strided side stays in L1
// (both sizes are multiples of kUnit).
void Transpose(const float* x, int64_t rows, int64_t cols, float* out) {
  for (int64_t rb = 0; rb < rows; rb += kLanes)
    for (int64_t cb = 0; cb < cols; cb += kLanes)
      for (int64_t c = cb; c < cb + kLanes; ++c)
        for (int64_t r = rb; r < rb + kLanes; ++r) out[c * rows + r] = x[r * cols + c];
}

// Maximum of row[0, valid) (valid <= the row's length rounded up to kLanes).
float RowMax(const float* row, int64_t valid) {
  Vec best = Vec{} - INFINITY;
  int64_t c = 0;
  for (; c + kLanes <= valid; c += kLanes) {
    const Vec x = Load(row + c);
    best = best > x ? best : x;
  }
  float out = -INFINITY;
  for (int j = 0; j < kLanes; ++j) out = std::max(out, best[j]);
  for (; c < valid; ++c) out = std::max(out, row[c]);
  return out;
}

// Per-thread scratch, grown on demand (pairs run on XLA's pool threads).
struct Scratch {
  std::vector<float> kt, vt, s, dp, delta;
  void Size(int64_t seq, int64_t d, int64_t block) {
    kt.resize(seq * d), vt.resize(seq * d), s.resize(block * seq), dp.resize(block * seq), delta.resize(seq);
  }
};

Scratch& ThreadScratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Scores of query rows [i0, i0 + block) against keys [0, end), scaled: S[block, end].
void Scores(const float* q, const float* kt, int64_t seq, int64_t d, int64_t i0, int64_t block, int64_t end,
            float scale, float* s) {
  Gemm(block, end, d, q + i0 * d, d, 1, kt, seq, scale, s, end, false);
}

// Exponentiates row r of s (length end) as exp(s - shift[r]) over its causal prefix (with
// ``causal``, else the whole row), zero after.
template <typename Row>
void MaskedExp(float* s, int64_t i0, int64_t block, int64_t end, bool causal, Row shift) {
  for (int64_t r = 0; r < block; ++r) {
    float* row = s + r * end;
    const int64_t valid = causal ? i0 + r + 1 : end;
    const float m = shift(r, row, valid);
    int64_t c = 0;
    for (; c + kLanes <= valid; c += kLanes) Store(row + c, Exp(Load(row + c) - m));
    if (c < end) {
      Vec tail = Exp(Load(row + c) - m);
      for (int64_t j = 0; j < kLanes; ++j)
        if (c + j >= valid) tail[j] = 0.f;
      Store(row + c, tail);
      for (c += kLanes; c < end; c += kLanes) Store(row + c, Vec{});
    }
  }
}

void ForwardPair(const float* q, const float* k, const float* v, float* o, float* lse, int64_t seq, int64_t d,
                 int64_t block, bool causal) {
  Scratch& w = ThreadScratch();
  w.Size(seq, d, block);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  Transpose(k, seq, d, w.kt.data());
  for (int64_t i0 = 0; i0 < seq; i0 += block) {
    const int64_t end = causal ? i0 + block : seq;
    float* s = w.s.data();
    Scores(q, w.kt.data(), seq, d, i0, block, end, scale, s);
    float* max = w.delta.data();  // row maxima, reused below as the row sums' reciprocals
    MaskedExp(s, i0, block, end, causal, [&](int64_t r, const float* row, int64_t valid) {
      return max[r] = RowMax(row, valid);
    });
    for (int64_t r = 0; r < block; ++r) {
      const float* row = s + r * end;
      Vec sum{};
      for (int64_t c = 0; c < end; c += kLanes) sum += Load(row + c);
      const float total = Sum(sum);
      lse[i0 + r] = max[r] + std::log(total);
      max[r] = 1.f / total;
    }
    Gemm(block, d, end, s, end, 1, v, d, 1.f, o + i0 * d, d, false);
    for (int64_t r = 0; r < block; ++r)
      for (int64_t c = 0; c < d; ++c) o[(i0 + r) * d + c] *= max[r];
  }
}

void BackwardPair(const float* q, const float* k, const float* v, const float* o, const float* lse, const float* dout,
                  float* dq, float* dk, float* dv, int64_t seq, int64_t d, int64_t block, bool causal) {
  Scratch& w = ThreadScratch();
  w.Size(seq, d, block);
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  Transpose(k, seq, d, w.kt.data());
  Transpose(v, seq, d, w.vt.data());
  for (int64_t r = 0; r < seq; ++r) {  // rowsum(dO * O)
    Vec acc{};
    for (int64_t c = 0; c < d; c += kLanes) acc += Load(dout + r * d + c) * Load(o + r * d + c);
    w.delta[r] = Sum(acc);
  }
  // Last query block first: it meets every key (causal or not), so its dK/dV products
  // initialise all rows.
  for (int64_t i0 = seq - block; i0 >= 0; i0 -= block) {
    const bool first = i0 == seq - block;
    const int64_t end = causal ? i0 + block : seq;
    float *p = w.s.data(), *dp = w.dp.data();
    const float* dout_i = dout + i0 * d;
    Scores(q, w.kt.data(), seq, d, i0, block, end, scale, p);
    MaskedExp(p, i0, block, end, causal, [&](int64_t r, const float*, int64_t) { return lse[i0 + r]; });
    Gemm(end, d, block, p, 1, end, dout_i, d, 1.f, dv, d, !first);            // dV += P^T dO
    Gemm(block, end, d, dout_i, d, 1, w.vt.data(), seq, 1.f, dp, end, false);  // dP = dO V^T
    for (int64_t r = 0; r < block; ++r) {                                    // dS = P (dP - delta) scale
      const Vec delta = Vec{} + w.delta[i0 + r];
      for (int64_t c = 0; c < end; c += kLanes)
        Store(dp + r * end + c, Load(p + r * end + c) * (Load(dp + r * end + c) - delta) * scale);
    }
    Gemm(block, d, end, dp, end, 1, k, d, 1.f, dq + i0 * d, d, false);   // dQ = dS K
    Gemm(end, d, block, dp, 1, end, q + i0 * d, d, 1.f, dk, d, !first);  // dK += dS^T Q
  }
}

// Runs body(i) for i in [0, n) on the calling thread and up to pool.num_threads() - 1 pool
// tasks. The caller waits only for items already claimed, never for a task to start, so it
// cannot deadlock when every pool thread is itself inside a kernel.
template <typename Body>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const Body& body) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  if (helpers <= 0) {
    for (int64_t i = 0; i < n; ++i) body(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto run = [n, &body](State& st) {
    for (int64_t i; (i = st.next.fetch_add(1)) < n;) {
      body(i);
      if (st.done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(st.mu);
        st.cv.notify_all();
      }
    }
  };
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state, run] { run(*state); });
  run(*state);
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

struct Shape {
  int64_t pairs, seq, d;
};

ffi::Error Check(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v,
                 int64_t block, Shape& shape) {
  auto dims = q.dimensions();
  if (k.element_count() != q.element_count() || v.element_count() != q.element_count())
    return ffi::Error::InvalidArgument("attention: q, k and v must have the same shape");
  if (dims.size() < 2) return ffi::Error::InvalidArgument("attention: q must be [..., seq, head_dim]");
  const int64_t seq = dims[dims.size() - 2], d = dims.back();
  if (block <= 0 || block % kUnit || seq % block || d % kUnit)
    return ffi::Error::InvalidArgument("attention: block and head_dim must be multiples of 16, seq of block");
  shape = Shape{seq * d ? q.element_count() / (seq * d) : 0, seq, d};
  return ffi::Error::Success();
}

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                   ffi::ResultBuffer<ffi::F32> o, ffi::ResultBuffer<ffi::F32> lse, int64_t block, int64_t causal) {
  Shape shape;
  if (ffi::Error error = Check(q, k, v, block, shape); error.failure()) return error;
  const auto [pairs, seq, d] = shape;
  ParallelFor(pool, pairs, [&, seq = seq, d = d](int64_t i) {
    const int64_t off = i * seq * d;
    ForwardPair(q.typed_data() + off, k.typed_data() + off, v.typed_data() + off, o->typed_data() + off,
                lse->typed_data() + i * seq, seq, d, block, causal != 0);
  });
  return ffi::Error::Success();
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                    ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv,
                    int64_t block, int64_t causal) {
  Shape shape;
  if (ffi::Error error = Check(q, k, v, block, shape); error.failure()) return error;
  const auto [pairs, seq, d] = shape;
  ParallelFor(pool, pairs, [&, seq = seq, d = d](int64_t i) {
    const int64_t off = i * seq * d;
    BackwardPair(q.typed_data() + off, k.typed_data() + off, v.typed_data() + off, o.typed_data() + off,
                 lse.typed_data() + i * seq, dout.typed_data() + off, dq->typed_data() + off,
                 dk->typed_data() + off, dv->typed_data() + off, seq, d, block, causal != 0);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("causal"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(AttentionBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block")
                                  .Attr<int64_t>("causal"));
