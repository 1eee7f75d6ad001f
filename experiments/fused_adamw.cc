// AdamW as one pass over the host state, as an XLA:CPU custom call (typed FFI): what the
// engine's host update would be if fused (docs/performance.md, "A one-pass update"). The
// master, moments and gradient are aliased to the results, so the pass reads and writes them
// in place; the blocks run on the thread pool XLA hands the call. fused_adamw.py builds it with
// the host's C++ compiler and update_bench.py times it. optax.adamw's arithmetic in its order
// (see fused_adamw.py's loop), bf16 gradient in, bf16 compute shard out.
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static inline float f32_of_bf16(uint16_t h) { uint32_t b = uint32_t(h) << 16; float f; std::memcpy(&f, &b, 4); return f; }
static inline uint16_t bf16_of_f32(float f) { uint32_t b; std::memcpy(&b, &f, 4); return uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16); }

// a1 = 1 - b1 and a2 = 1 - b2 as optax rounds them; r1, r2: the bias corrections' reciprocals
struct Step { float a1, b1, a2, b2, eps, r1, r2, wd, lr; };

// c holds the bf16 gradient on entry and the bf16 compute shard on return (aliased)
static void Block(const Step& s, float* __restrict p, float* __restrict m, float* __restrict v,
                  uint16_t* __restrict c, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    const float gi = f32_of_bf16(c[i]);
    const float mm = s.a1 * gi + s.b1 * m[i];
    const float vv = s.a2 * (gi * gi) + s.b2 * v[i];
    m[i] = mm; v[i] = vv;
    const float u = (mm * s.r1) / (std::sqrt(vv * s.r2) + s.eps);
    const float pp = p[i] + (-s.lr) * (u + s.wd * p[i]);
    p[i] = pp; c[i] = bf16_of_f32(pp);
  }
}

static ffi::Error AdamW(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::F32>,
                        ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::BF16>,
                        ffi::ResultBuffer<ffi::F32> master, ffi::ResultBuffer<ffi::F32> mu,
                        ffi::ResultBuffer<ffi::F32> nu, ffi::ResultBuffer<ffi::BF16> compute) {
  const float* x = scalars.typed_data();
  const Step s{x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7], x[8]};
  // master, mu, nu and the gradient are aliased to the results (the gradient to the compute
  // shard): each is read and written through its result, in place. A fresh result buffer
  // would be paged in on every call (50 M params: 57 ms against 31 ms).
  const int64_t n = master->element_count();
  float* p = master->typed_data(); float* m = mu->typed_data(); float* v = nu->typed_data();
  auto* c = reinterpret_cast<uint16_t*>(compute->typed_data());
  const int64_t tasks = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = ((n + tasks - 1) / tasks + 15) / 16 * 16;
  std::mutex mu_; std::condition_variable cv; int64_t left = 0;
  for (int64_t lo = per; lo < n; lo += per) ++left;
  for (int64_t lo = per; lo < n; lo += per) {
    const int64_t hi = std::min(n, lo + per);
    pool.Schedule([&, lo, hi] {
      Block(s, p, m, v, c, lo, hi);
      std::lock_guard<std::mutex> l(mu_);
      if (--left == 0) cv.notify_one();
    });
  }
  Block(s, p, m, v, c, 0, std::min(n, per));
  std::unique_lock<std::mutex> l(mu_);
  cv.wait(l, [&] { return left == 0; });
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZjAdamW, AdamW,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>()
        .Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::BF16>>()
        .Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::BF16>>());
