// Small math helpers written so that loops calling them vectorise (libm's expf is a scalar
// call: in a softmax or an activation it dominates everything else).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace genserve {

// e^x for x in float32's normal range (clamped to [-87, 88]): 2^(x log2 e) split into an
// integer power, set through the exponent bits, and e^f for |f| <= ln2 / 2 from its Taylor
// polynomial to degree 7 (relative error < 1e-8, below float32's 6e-8 epsilon).
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.693147180559945309f;
  float p = 1.0f / 5040.0f;
  p = p * f + 1.0f / 720.0f;
  p = p * f + 1.0f / 120.0f;
  p = p * f + 1.0f / 24.0f;
  p = p * f + 1.0f / 6.0f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace genserve
