// Instantiations of the stream expand (stream.cuh) named in tile_configs.def (ATMM_STREAM_EXPAND lines).
#include "atmm/stream.cuh"

#define ATMM_STREAM_EXPAND(NAME, BM, BN, WM, WN, KMAX, ST)                                             \
  namespace atmm {                                                                                     \
  cudaError_t atmm_fused_##NAME##_f16(FusedArgs const& a, cudaStream_t s) {                            \
    return detail::stream_expand<__half, BM, BN, WM, WN, KMAX, ST>(a, s);                              \
  }                                                                                                    \
  cudaError_t atmm_fused_##NAME##_bf16(FusedArgs const& a, cudaStream_t s) {                           \
    return detail::stream_expand<__nv_bfloat16, BM, BN, WM, WN, KMAX, ST>(a, s);                       \
  }                                                                                                    \
  }
#include "atmm/tile_configs.def"
