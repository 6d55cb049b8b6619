// Fixed-order vector arithmetic for the CPU backend.
//
// Every reduction here has one order, whatever the caller's blocking, so kernels built on these
// helpers are batch invariant: lane j of an accumulator sums the elements k = j (mod 8) in
// increasing k, and the eight lanes are folded in one fixed tree. The tail of a row is loaded
// with zeros in the missing lanes, which adds exact zeros. The kernels library is compiled with
// -ffp-contract=off, so the only fused multiply-adds are the explicit ones below.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace treeverify::kernels::cpu::simd {

inline constexpr int kLanes = 8;

#if defined(__AVX2__) && defined(__FMA__)
using Vec = __m256;
inline Vec Zero() { return _mm256_setzero_ps(); }
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec acc) { return _mm256_fmadd_ps(a, b, acc); }
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#else
struct Vec {
  float lane[kLanes];
};
inline Vec Zero() { return Vec{}; }
inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(v.lane, p, sizeof(v.lane));
  return v;
}
inline Vec Broadcast(float value) {
  Vec v;
  for (float& lane : v.lane) lane = value;
  return v;
}
inline Vec Fma(Vec a, Vec b, Vec acc) {
  for (int i = 0; i < kLanes; ++i) acc.lane[i] = __builtin_fmaf(a.lane[i], b.lane[i], acc.lane[i]);
  return acc;
}
inline void Store(float* p, Vec v) { std::memcpy(p, v.lane, sizeof(v.lane)); }
#endif

// Loads count (< kLanes) floats, zero in the other lanes.
inline Vec LoadPartial(const float* p, int64_t count) {
  float buffer[kLanes] = {};
  std::memcpy(buffer, p, static_cast<size_t>(count) * sizeof(float));
  return Load(buffer);
}

// The one fixed folding order of the eight lanes.
inline float HorizontalSum(Vec v) {
  float lane[kLanes];
  Store(lane, v);
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

// sum_k a[k] * b[k] in the fixed order above.
inline float Dot(const float* a, const float* b, int64_t n) {
  Vec acc = Zero();
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) acc = Fma(Load(a + k), Load(b + k), acc);
  if (k < n) acc = Fma(LoadPartial(a + k, n - k), LoadPartial(b + k, n - k), acc);
  return HorizontalSum(acc);
}

// y[k] += alpha * x[k], element-wise (each element one fused multiply-add).
inline void Axpy(float alpha, const float* x, float* y, int64_t n) {
  const Vec a = Broadcast(alpha);
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) Store(y + k, Fma(a, Load(x + k), Load(y + k)));
  for (; k < n; ++k) y[k] = __builtin_fmaf(alpha, x[k], y[k]);
}

}  // namespace treeverify::kernels::cpu::simd
