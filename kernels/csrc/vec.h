// Portable 16-float vectors (GCC vector extensions): one AVX-512 register with
// -march=native on such a CPU, narrower vectors or scalars elsewhere.
#pragma once

#include <cstdint>

namespace kvops {

constexpr int64_t kLanes = 16;

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof(v)); }

// x - 0 is x for every float (-0 included), so this compiles to a plain broadcast;
// x + 0 would not (-0 + 0 = +0).
inline v16 splat(float x) { return x - v16{}; }

// e^x to about 2 ulp: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial,
// 2^n through the exponent bits. 0 below -87 (including -inf), +inf above 88.
inline v16 exp16(v16 x) {
  const v16 lo = splat(-87.0f), hi = splat(88.0f);
  const v16 xc = x < lo ? lo : (x > hi ? hi : x);
  const v16 magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const v16 t = xc * 1.44269504088896341f + magic;
  const v16 n = t - magic;
  v16 r = xc - n * 0.693145751953125f;  // ln2 in two parts, so r is exact
  r = r - n * 1.428606765330187045e-06f;
  v16 p = splat(1.0f / 720) * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  v16i bits, ti;
  __builtin_memcpy(&bits, &p, sizeof(p));
  __builtin_memcpy(&ti, &t, sizeof(t));
  bits += (ti - 0x4B400000) << 23;  // the integer n sits in t's low mantissa bits
  v16 out;
  __builtin_memcpy(&out, &bits, sizeof(out));
  out = x > hi ? splat(__builtin_inff()) : out;
  return x < lo ? splat(0.f) : out;
}

}  // namespace kvops
