// The top-k rule the MoE routers use on both backends: the indices of the k largest of n values,
// best first; among equal values the lower index wins (seen first, and only a strictly larger
// value displaces it). Insertion into a sorted list of k: fine for routing's small k.
//
//   int32_t best[8];
//   TopK(scores, 384, 8, best);
#pragma once

#include <cstdint>

#include "treeverify/kernels/host_device.h"

namespace treeverify::kernels {

TV_HOST_DEVICE inline void TopK(const float* values, int32_t n, int32_t k, int32_t* best) {
  int32_t size = 0;
  for (int32_t i = 0; i < n; ++i) {
    const float value = values[i];
    if (size == k && !(value > values[best[k - 1]])) continue;
    int32_t pos = size < k ? size : k - 1;
    while (pos > 0 && value > values[best[pos - 1]]) {
      best[pos] = best[pos - 1];
      --pos;
    }
    best[pos] = i;
    if (size < k) ++size;
  }
}

}  // namespace treeverify::kernels
