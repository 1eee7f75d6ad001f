// The NVMe tier's AdamW update: the fp32 master and moments of a device's shard live in a file
// (store.py lays it out), and the update of one leaf streams them through a ring of aligned
// buffers: a reader thread reads block i+1 (and on) while the calling thread updates block i
// with the fused pass's arithmetic (adamw_math.h: bitwise the host tier's numbers) and a
// writer thread writes block i-1 back. O_DIRECT where the file system takes it (the page cache
// neither holds the state nor is charged for it), else buffered I/O whose pages are written
// and dropped block by block. An XLA:CPU custom call (typed FFI, `zerojax_adamw_nvme`), with
// a C API (ctypes, nvme.py) to open the store, to read and write a leaf's arrays in blocks
// (init, restore, save) and to read the I/O counters.
//
// The file of a shard: per leaf three regions, master, mu and nu, each of the leaf's n float32
// and padded to 4 KiB; a block of B elements (B a multiple of 1024) is three reads and three
// writes of B * 4 bytes, the last block's rounded up into the padding.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "adamw_math.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace zerojax::adamw;  // Step, Block, Load, Store

constexpr int64_t kAlign = 4096;               // O_DIRECT's unit: offsets, lengths, buffers
constexpr int64_t kUnit = kAlign / 4;          // a block is a multiple of this many floats
int64_t Up(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }
double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Leaf { int64_t n, at[3]; };  // elements; the byte offsets of master, mu, nu

struct Counters {  // since the store was opened (or the counters last read with reset)
  std::atomic<int64_t> read{0}, written{0}, passes{0};
  std::atomic<int64_t> read_ns{0}, write_ns{0}, compute_ns{0}, stall_ns{0};
};

struct Buffer {  // one aligned allocation, freed with it
  float* data = nullptr;
  int64_t floats = 0;
  ~Buffer() { std::free(data); }
  bool Fit(int64_t n) {
    if (floats >= n) return true;
    std::free(data);
    data = nullptr;
    floats = 0;
    void* p = nullptr;
    if (posix_memalign(&p, kAlign, n * 4)) return false;
    data = static_cast<float*>(p);
    floats = n;
    return true;
  }
};

struct Shard {
  std::string path;
  int fd = -1;
  bool direct = false;
  std::vector<Leaf> leaves;
  std::mutex busy;              // one pass or bulk transfer of this file at a time
  std::vector<Buffer> ring;     // the pass's buffers, kept between passes
  ~Shard() { if (fd >= 0) close(fd); }
};

struct StoreObj {
  std::map<int64_t, std::unique_ptr<Shard>> shards;  // by the device's index in the mesh
  std::atomic<int64_t> block{1 << 20}, count{4};     // elements per block, buffers
  Counters counters;
};

std::mutex registry_mu;
std::map<int64_t, std::shared_ptr<StoreObj>> registry;
int64_t next_handle = 1;

std::shared_ptr<StoreObj> Find(int64_t handle) {
  std::lock_guard<std::mutex> l(registry_mu);
  auto it = registry.find(handle);
  return it == registry.end() ? nullptr : it->second;
}

std::string Describe(const Shard& sh, const char* what, int err) {
  std::string why = std::strerror(err);
  if (err == ENOSPC) why += " (ENOSPC): the disk under the store is full; free space there or "
                            "give nvme_path on a larger disk";
  else if (err == EROFS || err == EACCES || err == EPERM)
    why += ": the store's path is not writable; give nvme_path a writable directory";
  return "zerojax NVMe store " + sh.path + ": " + what + " failed: " + why;
}

// The whole of [at, at + len) at `buf`, resuming after a short transfer; 0 or an errno.
int Transfer(const Shard& sh, bool write, char* buf, int64_t len, int64_t at, Counters& c) {
  const double t0 = Now();
  int64_t done = 0;
  while (done < len) {
    const ssize_t k = write ? pwrite(sh.fd, buf + done, len - done, at + done)
                            : pread(sh.fd, buf + done, len - done, at + done);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errno;
    if (k == 0) return write ? ENOSPC : EIO;  // a read past the end: a truncated store
    done += k;
  }
  if (write && !sh.direct) {  // buffered: written now and its pages dropped, as O_DIRECT's
    if (sync_file_range(sh.fd, at, len, SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE |
                                            SYNC_FILE_RANGE_WAIT_AFTER))
      return errno;
  }
  if (!sh.direct) posix_fadvise(sh.fd, at, len, POSIX_FADV_DONTNEED);
  (write ? c.written : c.read) += len;
  (write ? c.write_ns : c.read_ns) += int64_t((Now() - t0) * 1e9);
  return 0;
}

// The pipeline of one pass: blocks claimed in order by the reader, the compute (the calling
// thread) and the writer; block b lives in buffer b % count, which the reader refills for
// block b + count once the writer is done with b.
struct Pipe {
  std::mutex mu;
  std::condition_variable cv;
  int64_t read = 0, computed = 0, written = 0;  // blocks done by each stage
  int err = 0;
  const char* where = "";
  void Fail(int e, const char* w) {
    std::lock_guard<std::mutex> l(mu);
    if (!err) err = e, where = w;
    cv.notify_all();
  }
  // Waits until `ready()` or a failure; false on failure.
  template <typename F> bool Wait(F ready) {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return err || ready(); });
    return !err;
  }
  void Done(int64_t& stage) {
    std::lock_guard<std::mutex> l(mu);
    ++stage;
    cv.notify_all();
  }
};

// One leaf's pass. `part` -1: the update, written back, out the compute shard `c`; 0, 1 or 2:
// a dry pass (nothing written) giving the updated master (in O), mu or nu (float32) in `c`:
// what the state would be, for a read of the state with a pending update applied.
template <typename G, typename O>
ffi::Error Pass(StoreObj& st, Shard& sh, const Leaf& leaf, const Step& s, const void* gv,
                void* cv, int64_t part) {
  std::lock_guard<std::mutex> hold(sh.busy);
  const int64_t B = st.block.load(), count = st.count.load(), n = leaf.n;
  const int64_t blocks = (n + B - 1) / B;
  const bool skip = s.ok == 0.0f, dry = part >= 0, writes = !dry && !skip;
  bool reads[3] = {true, true, true};  // a skipped step reads only what it gives out
  if (skip) reads[0] = reads[1] = reads[2] = false, reads[dry ? part : 0] = true;
  if (int64_t(sh.ring.size()) != count) sh.ring = std::vector<Buffer>(count);
  for (auto& b : sh.ring)
    if (!b.Fit(3 * B)) return ffi::Error::Internal("zerojax NVMe store: out of host memory "
                                                   "for the I/O buffers");
  std::vector<float> scratch(dry && part > 0 && !skip ? B : 0);  // the master's, not given out
  const G* g = static_cast<const G*>(gv);
  O* c = static_cast<O*>(cv);
  Counters& ctr = st.counters;
  Pipe pipe;
  auto len = [&](int64_t b) { return std::min(B, n - b * B); };
  auto io = [&](bool write) {
    int64_t& mine = write ? pipe.written : pipe.read;
    for (int64_t b = 0; b < blocks; ++b) {
      bool go = write ? pipe.Wait([&] { return pipe.computed > b; })
                      : pipe.Wait([&] { return pipe.written > b - count; });
      if (!go) return;
      char* buf = reinterpret_cast<char*>(sh.ring[b % count].data);
      const int64_t bytes = Up(len(b) * 4);
      for (int j = 0; j < 3; ++j) {
        if (!reads[j]) continue;
        const int e = Transfer(sh, write, buf + j * B * 4, bytes, leaf.at[j] + b * B * 4, ctr);
        if (e) return pipe.Fail(e, write ? "a write" : "a read");
      }
      pipe.Done(mine);
    }
  };
  std::thread reader(io, false);
  std::thread writer;
  if (writes) writer = std::thread(io, true);
  for (int64_t b = 0; b < blocks; ++b) {
    const double t0 = Now();
    if (!pipe.Wait([&] { return pipe.read > b; })) break;
    const double t1 = Now();
    float* p = sh.ring[b % count].data;
    const int64_t lo = b * B, k = len(b);
    if (part <= 0) {
      Block<G, O>(s, p, p + B, p + 2 * B, g + lo, c + lo, 0, k);
    } else if constexpr (std::is_same_v<O, float>) {  // the moment `part`, updated
      if (!skip) Block<G, float>(s, p, p + B, p + 2 * B, g + lo, scratch.data(), 0, k);
      std::memcpy(c + lo, p + part * B, k * 4);
    }
    if (writes && k % kUnit)  // the padding written with the last block: zeros, not stale data
      for (int j = 0; j < 3; ++j) std::fill(p + j * B + k, p + j * B + (k + kUnit - 1) / kUnit
                                                                       * kUnit, 0.0f);
    ctr.stall_ns += int64_t((t1 - t0) * 1e9);
    ctr.compute_ns += int64_t((Now() - t1) * 1e9);
    if (!writes) {
      std::lock_guard<std::mutex> l(pipe.mu);  // nothing to write: the buffer is free again
      ++pipe.computed, ++pipe.written;
      pipe.cv.notify_all();
    } else {
      pipe.Done(pipe.computed);
    }
  }
  reader.join();
  if (writer.joinable()) writer.join();
  ++ctr.passes;
  if (pipe.err) return ffi::Error::Internal(Describe(sh, pipe.where, pipe.err));
  return ffi::Error::Success();
}

template <typename G>
ffi::Error ByOut(ffi::DataType out, StoreObj& st, Shard& sh, const Leaf& leaf, const Step& s,
                 const void* g, void* c, int64_t part) {
  if (part > 0 && out != ffi::DataType::F32)
    return ffi::Error::InvalidArgument("a moment's dry pass gives float32");
  switch (out) {
    case ffi::DataType::F32: return Pass<G, float>(st, sh, leaf, s, g, c, part);
    case ffi::DataType::BF16: return Pass<G, BF16>(st, sh, leaf, s, g, c, part);
    case ffi::DataType::F16: return Pass<G, _Float16>(st, sh, leaf, s, g, c, part);
    default: return ffi::Error::InvalidArgument("compute shard: f32, bf16 or f16");
  }
}

ffi::Error NvmeAdamW(int64_t store, int64_t leaf, int64_t part,
                     ffi::Buffer<ffi::F32> scalars, ffi::Buffer<ffi::S32> shard,
                     ffi::AnyBuffer grad, ffi::Result<ffi::AnyBuffer> compute) {
  if (scalars.element_count() != kScalars) return ffi::Error::InvalidArgument("13 scalars");
  if (part < -1 || part > 2) return ffi::Error::InvalidArgument("part: -1, 0, 1 or 2");
  auto st = Find(store);
  if (!st) return ffi::Error::InvalidArgument(
      "zerojax NVMe store " + std::to_string(store) + " is not open in this process (closed, "
      "or a program compiled for another engine's store)");
  const int64_t index = shard.typed_data()[0];
  auto it = st->shards.find(index);
  if (it == st->shards.end())
    return ffi::Error::InvalidArgument("zerojax NVMe store has no shard " +
                                       std::to_string(index) + " in this process");
  Shard& sh = *it->second;
  if (leaf < 0 || leaf >= int64_t(sh.leaves.size()))
    return ffi::Error::InvalidArgument("zerojax NVMe store: no leaf " + std::to_string(leaf));
  const Leaf& lf = sh.leaves[leaf];
  if (int64_t(grad.element_count()) != lf.n || int64_t(compute->element_count()) != lf.n)
    return ffi::Error::InvalidArgument(
        "zerojax NVMe store " + sh.path + ": leaf " + std::to_string(leaf) + " holds " +
        std::to_string(lf.n) + " elements, the gradient " +
        std::to_string(grad.element_count()) + " and the shard " +
        std::to_string(compute->element_count()));
  Step s;
  std::memcpy(&s, scalars.typed_data(), sizeof(Step));
  const void* g = grad.untyped_data();
  void* c = compute->untyped_data();
  const ffi::DataType out = compute->element_type();
  switch (grad.element_type()) {
    case ffi::DataType::F32: return ByOut<float>(out, *st, sh, lf, s, g, c, part);
    case ffi::DataType::BF16: return ByOut<BF16>(out, *st, sh, lf, s, g, c, part);
    case ffi::DataType::F16: return ByOut<_Float16>(out, *st, sh, lf, s, g, c, part);
    default: return ffi::Error::InvalidArgument("gradient: f32, bf16 or f16");
  }
}

void Say(char* err, int64_t cap, const std::string& text) {
  if (err && cap > 0) std::snprintf(err, cap, "%s", text.c_str());
}

}  // namespace

static_assert(sizeof(Step) == kScalars * sizeof(float), "Step is the scalars' layout");

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZerojaxAdamWNvme, NvmeAdamW,
                              ffi::Ffi::Bind()
                                  .Attr<int64_t>("store")         // nvme.py's handle
                                  .Attr<int64_t>("leaf")          // the leaf's index
                                  .Attr<int64_t>("part")          // -1, or a dry pass's
                                  .Arg<ffi::Buffer<ffi::F32>>()   // the step's scalars
                                  .Arg<ffi::Buffer<ffi::S32>>()   // the device's shard index
                                  .Arg<ffi::AnyBuffer>()          // gradient
                                  .Ret<ffi::AnyBuffer>());        // compute shard

// The C API nvme.py calls through ctypes: 0 or an errno, with a message in `err`.
extern "C" {

int64_t zjn_open(int64_t block, int64_t count) {
  if (block <= 0 || block % kUnit || count < 2) return -EINVAL;
  auto st = std::make_shared<StoreObj>();
  st->block = block;
  st->count = count;
  std::lock_guard<std::mutex> l(registry_mu);
  registry[next_handle] = st;
  return next_handle++;
}

// Opens a shard's file (O_DIRECT unless the file system refuses it, or `direct` is 0) with
// `nleaves` leaves: `n` elements each, `at` their three regions' byte offsets (3 per leaf).
int zjn_add_shard(int64_t store, int64_t index, const char* path, int64_t nleaves,
                  const int64_t* n, const int64_t* at, int direct, int* got_direct,
                  char* err, int64_t cap) {
  auto st = Find(store);
  if (!st) return Say(err, cap, "no such store"), EINVAL;
  auto sh = std::make_unique<Shard>();
  sh->path = path;
  if (direct) sh->fd = open(path, O_RDWR | O_DIRECT | O_CLOEXEC);
  if (sh->fd >= 0) sh->direct = true;
  else if (!direct || errno == EINVAL) sh->fd = open(path, O_RDWR | O_CLOEXEC);
  if (sh->fd < 0) {
    const int e = errno;
    return Say(err, cap, Describe(*sh, "opening it", e)), e;
  }
  for (int64_t k = 0; k < nleaves; ++k) {
    Leaf leaf{n[k], {at[3 * k], at[3 * k + 1], at[3 * k + 2]}};
    for (int j = 0; j < 3; ++j)
      if (leaf.at[j] % kAlign) return Say(err, cap, "unaligned region"), EINVAL;
    sh->leaves.push_back(leaf);
  }
  *got_direct = sh->direct;
  std::lock_guard<std::mutex> l(registry_mu);
  st->shards[index] = std::move(sh);
  return 0;
}

int zjn_configure(int64_t store, int64_t block, int64_t count) {
  auto st = Find(store);
  if (!st || block <= 0 || block % kUnit || count < 2) return EINVAL;
  st->block = block;
  st->count = count;
  return 0;
}

// Reads (write 0) or writes `k` float32 of part `part` (0 master, 1 mu, 2 nu) of a leaf from
// element `lo` (a multiple of 1024; `k` too unless the transfer ends the leaf), in blocks
// through an aligned buffer of the shard's.
int zjn_transfer(int64_t store, int64_t index, int64_t leaf, int part, int64_t lo, int64_t k,
                 float* data, int write, char* err, int64_t cap) {
  auto st = Find(store);
  if (!st) return Say(err, cap, "no such store"), EINVAL;
  auto it = st->shards.find(index);
  if (it == st->shards.end()) return Say(err, cap, "no such shard"), EINVAL;
  Shard& sh = *it->second;
  if (leaf < 0 || leaf >= int64_t(sh.leaves.size()) || part < 0 || part > 2)
    return Say(err, cap, "no such leaf or part"), EINVAL;
  const Leaf& lf = sh.leaves[leaf];
  if (lo < 0 || k < 0 || lo + k > lf.n || lo % kUnit || (lo + k < lf.n && k % kUnit))
    return Say(err, cap, "a transfer of elements [" + std::to_string(lo) + ", " +
                             std::to_string(lo + k) + ") of a leaf of " +
                             std::to_string(lf.n) + ": not whole 1024-element units"), EINVAL;
  std::lock_guard<std::mutex> hold(sh.busy);
  if (sh.ring.empty()) sh.ring = std::vector<Buffer>(1);
  const int64_t B = 3 * st->block.load();
  if (!sh.ring[0].Fit(B)) return Say(err, cap, "out of host memory"), ENOMEM;
  float* buf = sh.ring[0].data;
  for (int64_t done = 0; done < k; done += B) {
    const int64_t m = std::min(B, k - done);
    const int64_t at = lf.at[part] + (lo + done) * 4;
    if (write) {
      std::memcpy(buf, data + done, m * 4);
      std::fill(buf + m, buf + (m + kUnit - 1) / kUnit * kUnit, 0.0f);
    }
    const int e = Transfer(sh, write, reinterpret_cast<char*>(buf), Up(m * 4), at,
                           st->counters);
    if (e) return Say(err, cap, Describe(sh, write ? "a write" : "a read", e)), e;
    if (!write) std::memcpy(data + done, buf, m * 4);
  }
  return 0;
}

// The shards' data on the disk (fdatasync), so a store marked clean after it is whole.
int zjn_sync(int64_t store, char* err, int64_t cap) {
  auto st = Find(store);
  if (!st) return Say(err, cap, "no such store"), EINVAL;
  for (auto& [_, sh] : st->shards) {
    std::lock_guard<std::mutex> hold(sh->busy);
    if (fdatasync(sh->fd)) {
      const int e = errno;
      return Say(err, cap, Describe(*sh, "fdatasync", e)), e;
    }
  }
  return 0;
}

// The counters: bytes read, bytes written, passes, and the seconds (as ns) spent reading,
// writing, computing and waiting for a block to arrive; zeroed after with `reset`.
int zjn_counters(int64_t store, int64_t* out, int reset) {
  auto st = Find(store);
  if (!st) return EINVAL;
  Counters& c = st->counters;
  std::atomic<int64_t>* all[] = {&c.read, &c.written, &c.passes, &c.read_ns, &c.write_ns,
                                 &c.compute_ns, &c.stall_ns};
  for (int i = 0; i < 7; ++i) out[i] = reset ? all[i]->exchange(0) : all[i]->load();
  return 0;
}

void zjn_close(int64_t store) {
  std::shared_ptr<StoreObj> st;
  {
    std::lock_guard<std::mutex> l(registry_mu);
    auto it = registry.find(store);
    if (it == registry.end()) return;
    st = it->second;
    registry.erase(it);
  }
  for (auto& [_, sh] : st->shards) {  // a pass or transfer under way ends first
    std::lock_guard<std::mutex> hold(sh->busy);
  }
}

}  // extern "C"
