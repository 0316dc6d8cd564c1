// Instantiations of the stream shrink (stream.cuh) named in tile_configs.def (ATMM_STREAM_SHRINK lines).
#include "atmm/stream.cuh"

#define ATMM_STREAM_SHRINK(NAME, BM, BK, WM, WN, KMAX, ST)                                                 \
  namespace atmm {                                                                                     \
  cudaError_t atmm_fused_##NAME##_f16(FusedArgs const& a, cudaStream_t s) {                            \
    return detail::stream_shrink<__half, BM, BK, WM, WN, KMAX, ST>(a, s);                                  \
  }                                                                                                    \
  cudaError_t atmm_fused_##NAME##_bf16(FusedArgs const& a, cudaStream_t s) {                           \
    return detail::stream_shrink<__nv_bfloat16, BM, BK, WM, WN, KMAX, ST>(a, s);                           \
  }                                                                                                    \
  }
#include "atmm/tile_configs.def"
