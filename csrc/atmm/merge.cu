// The merge: W read and written once by the streaming update of stream.cuh (mg_*: row tiles of W whose
// lora_B rows stay in registers while column chunks of W and lora_A stream through). One config per
// ATMM_MERGE_STREAM line of tile_configs.def. A and B are read where they are (strided slots of the LoRA
// slot buffers), and a swap's second term (the old adapter, negated) shares the pass over W.
//   V = lora_B[l] [d_out, r] rows, Bop = lora_A[l] [r, d_in] row-major, Y = W[l] [d_out, d_in] row-major.
// The batched CUTLASS GEMM and the WMMA merge measured here before were deleted (csrc/atmm/NOTES.md).
#include <sstream>

#include "atmm/merge.h"
#include "atmm/stream.cuh"

namespace atmm {

std::vector<std::string> merge_config_names() {
  std::vector<std::string> names;
#define ATMM_MERGE_STREAM(NAME, BM, BN, WM, WN, KMAX, ST) names.push_back(#NAME);
#include "atmm/tile_configs.def"
#undef ATMM_MERGE_STREAM
  return names;
}

std::vector<int> merge_config_max_ranks() {
  std::vector<int> r;
#define ATMM_MERGE_STREAM(NAME, BM, BN, WM, WN, KMAX, ST) r.push_back(KMAX);
#include "atmm/tile_configs.def"
#undef ATMM_MERGE_STREAM
  return r;
}

std::string merge(MergeArgs const& a, cudaStream_t stream) {
  std::ostringstream shape;
  shape << "layers=" << a.layers << " d_out=" << a.d_out << " d_in=" << a.d_in << " rank=" << a.rank
        << (a.lora_a2 ? " (two terms)" : "") << " dtype=" << (a.bf16 ? "bf16" : "fp16") << " stride_a=" << a.stride_a
        << " stride_b=" << a.stride_b << " ld_b=" << a.ld_b << " stride_w=" << a.stride_w;
  if (a.layers <= 0 || a.d_out <= 0 || a.d_in <= 0 || a.rank <= 0) return "merge: empty shape: " + shape.str();
  if (a.d_in % 8 || a.rank % 8) return "merge: d_in and rank must be multiples of 8: " + shape.str();
  if (a.ld_b < a.rank || a.stride_a < int64_t(a.rank) * a.d_in || a.stride_b < int64_t(a.d_out) * a.ld_b ||
      a.stride_w < int64_t(a.d_out) * a.d_in)
    return "merge: strides smaller than a matrix: " + shape.str();
  if (a.ld_b % 8 || a.stride_a % 8 || a.stride_b % 8 || a.stride_w % 8)
    return "merge: strides must be multiples of 8 elements (16 bytes): " + shape.str();
  if ((a.lora_b2 != nullptr) != (a.lora_a2 != nullptr)) return "merge: a second term needs both A and B: " + shape.str();
  cudaError_t e = cudaErrorInvalidValue;
  int i = 0;
  bool found = false;
#define ATMM_MERGE_STREAM(NAME, BM, BN, WM, WN, KMAX, ST)                                                \
  if (!found && a.config == i) {                                                                         \
    found = true;                                                                                        \
    if (a.total_rank() > KMAX) return "merge: config " #NAME " serves ranks up to " #KMAX ": " + shape.str(); \
    e = a.bf16 ? detail::stream_merge<__nv_bfloat16, BM, BN, WM, WN, KMAX, ST>(a, stream)                \
               : detail::stream_merge<__half, BM, BN, WM, WN, KMAX, ST>(a, stream);                      \
  }                                                                                                      \
  ++i;
#include "atmm/tile_configs.def"
#undef ATMM_MERGE_STREAM
  if (!found) return "merge: unknown config index: " + shape.str();
  if (e != cudaSuccess) return std::string("merge: ") + cudaGetErrorString(e) + ": " + shape.str();
  return "";
}

}  // namespace atmm
