// The merge operator: W[l] += alpha * (B[l] @ A[l] [- B2[l] @ A2[l]]) for a stack of same-shaped matrices, in place.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace atmm {

struct MergeArgs {
  void* w;              // matrix l: w + l * stride_w, [d_out, d_in] row-major (rows d_in apart)
  const void* lora_a;   // matrix l: lora_a + l * stride_a, [rank, d_in] row-major (rows d_in apart)
  const void* lora_b;   // matrix l: lora_b + l * stride_b, [d_out, rank] (rows ld_b apart)
  int layers, d_out, d_in, rank;
  float alpha;          // sign * scale
  bool bf16;
  int config;           // index into merge_config_names()
  // Strides in elements, so that A and B can be strided views (a slot of the LoRA slot buffers) read in place.
  int64_t stride_a = 0, stride_b = 0, ld_b = 0, stride_w = 0;
  // Optional second term of the same rank and strides (a swap: the new adapter in, the old one out), in the
  // same pass over W: W[l] += alpha * (B[l] @ A[l] + s * B2[l] @ A2[l]), s = -1 when negate2, else +1.
  const void* lora_a2 = nullptr;
  const void* lora_b2 = nullptr;
  bool negate2 = false;
  int total_rank() const { return lora_a2 ? 2 * rank : rank; }
};

// The merge configurations (ATMM_MERGE_STREAM lines of tile_configs.def), by index.
std::vector<std::string> merge_config_names();
// Largest rank (of all terms together) each merge configuration serves, by index.
std::vector<int> merge_config_max_ranks();
// Returns "" or an error naming the shape.
std::string merge(MergeArgs const& a, cudaStream_t stream);

}  // namespace atmm
