// The merge operator: W[l] += alpha * B[l] @ A[l] for a stack of same-shaped layers, in place.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace atmm {

struct MergeArgs {
  void* w;              // [L, d_out, d_in] row-major, contiguous
  const void* lora_a;   // [L, r, d_in]
  const void* lora_b;   // [L, d_out, r]
  int layers, d_out, d_in, rank;
  float alpha;          // sign * scale
  bool bf16;
  int config;           // index into merge_config_names()
};

std::vector<std::string> merge_config_names();
// Largest rank each merge configuration serves (0: any), by index.
std::vector<int> merge_config_max_ranks();
// The hand-written WMMA merge (fused.cu); variant 0: 64x128 tiles, 1: 128x128.
cudaError_t merge_fused(MergeArgs const& a, int variant, cudaStream_t stream);
// Returns "" or an error naming the shape.
std::string merge(MergeArgs const& a, cudaStream_t stream);

}  // namespace atmm
