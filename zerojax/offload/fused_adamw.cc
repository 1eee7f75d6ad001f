// The offloaded AdamW update of one leaf as one pass over its host state: an XLA:CPU custom
// call (typed FFI) that fused.py builds with the host's C++ compiler and the host update runs
// (programs.py). Master, moments and gradient are aliased to the results, so each element
// is read once and written once, in place; the compute-dtype shard is written into the
// gradient's buffer where their dtypes agree. The blocks run on the thread pool XLA hands the
// call. The arithmetic is optax.adamw's (scale_by_adam, add_decayed_weights, the learning
// rate, apply_updates) in its order, in float32, with the step's gradient scale first; the
// step's scalars come in computed by the program (fused.py), so a skipped step (`ok` 0) only
// writes the compute shard of the unchanged master.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "adamw_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace zerojax::adamw;  // Step, Block: adamw_math.h

// Runs body(lo, hi) over [0, n) in blocks, claimed one at a time by this thread and by tasks
// on the pool's threads; returns when every block is done. This thread claims blocks until
// none is left and then waits only for blocks other threads have started, so it never waits
// on a task the pool has not run (the call itself may hold one of the pool's threads). A task
// that starts after the last claim returns at once: it shares only `Blocks`, kept alive by it.
struct Blocks {
  std::atomic<int64_t> next{0}, done{0};
  std::mutex mu;
  std::condition_variable cv;
};

template <typename F>
void Parallel(ffi::ThreadPool& pool, int64_t n, F body) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t per = std::max<int64_t>(((n + 4 * threads - 1) / (4 * threads) + 15) / 16 * 16,
                                        int64_t{1} << 14);
  const int64_t count = (n + per - 1) / per;
  if (count <= 1) {
    body(0, n);
    return;
  }
  auto blocks = std::make_shared<Blocks>();
  auto claim = [blocks, count, per, n](auto& run) {
    for (int64_t i; (i = blocks->next.fetch_add(1)) < count;) {
      run(i * per, std::min(n, (i + 1) * per));
      if (blocks->done.fetch_add(1) + 1 == count) {
        std::lock_guard<std::mutex> l(blocks->mu);
        blocks->cv.notify_all();
      }
    }
  };
  for (int64_t t = 0; t < std::min(threads, count - 1); ++t)
    pool.Schedule([claim, body]() mutable { claim(body); });
  claim(body);
  std::unique_lock<std::mutex> l(blocks->mu);
  blocks->cv.wait(l, [&] { return blocks->done.load() == count; });
}

template <typename G, typename O>
void Run(ffi::ThreadPool& pool, const Step& s, float* p, float* m, float* v, const void* g,
         void* c, int64_t n) {
  Parallel(pool, n, [&](int64_t lo, int64_t hi) {
    Block<G, O>(s, p, m, v, static_cast<const G*>(g), static_cast<O*>(c), lo, hi);
  });
}

template <typename G>
ffi::Error ByOut(ffi::DataType out, ffi::ThreadPool& pool, const Step& s, float* p, float* m,
                 float* v, const void* g, void* c, int64_t n) {
  switch (out) {
    case ffi::DataType::F32: Run<G, float>(pool, s, p, m, v, g, c, n); break;
    case ffi::DataType::BF16: Run<G, BF16>(pool, s, p, m, v, g, c, n); break;
    case ffi::DataType::F16: Run<G, _Float16>(pool, s, p, m, v, g, c, n); break;
    default: return ffi::Error::InvalidArgument("compute shard: f32, bf16 or f16");
  }
  return ffi::Error::Success();
}

ffi::Error AdamW(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::F32>,
                 ffi::Buffer<ffi::F32>, ffi::Buffer<ffi::F32>, ffi::AnyBuffer grad,
                 ffi::ResultBuffer<ffi::F32> master, ffi::ResultBuffer<ffi::F32> mu,
                 ffi::ResultBuffer<ffi::F32> nu, ffi::Result<ffi::AnyBuffer> compute) {
  if (scalars.element_count() != kScalars) return ffi::Error::InvalidArgument("13 scalars");
  const int64_t n = master->element_count();
  if (mu->element_count() != n || nu->element_count() != n ||
      static_cast<int64_t>(grad.element_count()) != n ||
      static_cast<int64_t>(compute->element_count()) != n)
    return ffi::Error::InvalidArgument("master, moments, gradient and shard differ in size");
  Step s;
  std::memcpy(&s, scalars.typed_data(), sizeof(Step));
  // Master and moments are read and written through their results (aliased to the inputs);
  // the gradient through its input, which may be the compute shard's buffer.
  float* p = master->typed_data();
  float* m = mu->typed_data();
  float* v = nu->typed_data();
  const void* g = grad.untyped_data();
  void* c = compute->untyped_data();
  const ffi::DataType out = compute->element_type();
  switch (grad.element_type()) {
    case ffi::DataType::F32: return ByOut<float>(out, pool, s, p, m, v, g, c, n);
    case ffi::DataType::BF16: return ByOut<BF16>(out, pool, s, p, m, v, g, c, n);
    case ffi::DataType::F16: return ByOut<_Float16>(out, pool, s, p, m, v, g, c, n);
    default: return ffi::Error::InvalidArgument("gradient: f32, bf16 or f16");
  }
}

}  // namespace

static_assert(sizeof(Step) == kScalars * sizeof(float), "Step is the scalars' layout");

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZerojaxAdamW, AdamW,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // the step's scalars
                                  .Arg<ffi::Buffer<ffi::F32>>()   // master (aliased)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // mu (aliased)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // nu (aliased)
                                  .Arg<ffi::AnyBuffer>()          // gradient
                                  .Ret<ffi::Buffer<ffi::F32>>()   // master
                                  .Ret<ffi::Buffer<ffi::F32>>()   // mu
                                  .Ret<ffi::Buffer<ffi::F32>>()   // nu
                                  .Ret<ffi::AnyBuffer>());        // compute shard
