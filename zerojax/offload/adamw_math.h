// The per-element arithmetic of the offloaded AdamW update, shared by the in-memory fused pass
// (fused_adamw.cc) and the NVMe tier's streamed pass (zerojax/offload/nvme_adamw.cc), so the
// two give the same numbers bitwise (both are built with fused.py's flags: no FMA contraction).
// The arithmetic is optax.adamw's (scale_by_adam, add_decayed_weights, the learning rate,
// apply_updates) in its order, in float32, with the step's gradient scale first.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace zerojax::adamw {

struct BF16 { uint16_t bits; };

inline float Load(float x) { return x; }
inline float Load(_Float16 x) { return static_cast<float>(x); }
inline float Load(BF16 x) {
  const uint32_t b = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

template <typename T> inline T Store(float f);
template <> inline float Store<float>(float f) { return f; }
template <> inline _Float16 Store<_Float16>(float f) { return static_cast<_Float16>(f); }
template <> inline BF16 Store<BF16>(float f) {  // round to nearest even; a NaN stays quiet
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint16_t quiet = uint16_t((b >> 16) | 0x40u);
  const uint16_t rounded = uint16_t((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
  return BF16{std::isnan(f) ? quiet : rounded};  // a select, not a branch: the loop vectorizes
}

// The step's scalars, in the order fused.py stacks them. a1 = 1 - b1 and a2 = 1 - b2 as optax
// rounds them (from float64); r1, r2: the reciprocals of the bias corrections 1 - b**t (as
// XLA's simplifier rewrites some programs' divide by a broadcast scalar, not every one's:
// docs/stages.md says how far the two roundings part); lr: the signed step (-lr); scale: the
// gradient's (1 / divisor, clipped); decay: whether this leaf gets weight decay (its mask).
struct Step { float a1, b1, a2, b2, eps, eps_root, r1, r2, wd, decay, lr, scale, ok; };
constexpr int64_t kScalars = 13;

// The update of elements [lo, hi); the weight decay (a leaf's mask) a template argument, so
// the loop has no branch and vectorizes.
template <bool kDecay, typename G, typename O>
void Elements(const Step& s, float* __restrict p, float* __restrict m, float* __restrict v,
              const G* g, O* c, int64_t lo, int64_t hi) {  // g and c may be one buffer
  for (int64_t i = lo; i < hi; ++i) {
    const float gi = Load(g[i]) * s.scale;
    const float mm = s.a1 * gi + s.b1 * m[i];
    const float vv = s.a2 * (gi * gi) + s.b2 * v[i];
    m[i] = mm;
    v[i] = vv;
    float u = (mm * s.r1) / (std::sqrt(vv * s.r2 + s.eps_root) + s.eps);
    if constexpr (kDecay) u = u + s.wd * p[i];
    const float pp = p[i] + s.lr * u;
    p[i] = pp;
    c[i] = Store<O>(pp);
  }
}

template <typename G, typename O>
void Block(const Step& s, float* __restrict p, float* __restrict m, float* __restrict v,
           const G* g, O* c, int64_t lo, int64_t hi) {  // g and c may be one buffer
  if (s.ok == 0.0f) {
    for (int64_t i = lo; i < hi; ++i) c[i] = Store<O>(p[i]);
  } else if (s.decay != 0.0f) {
    Elements<true>(s, p, m, v, g, c, lo, hi);
  } else {
    Elements<false>(s, p, m, v, g, c, lo, hi);
  }
}

}  // namespace zerojax::adamw
