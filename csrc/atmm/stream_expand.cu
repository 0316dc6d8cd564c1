// Instantiations of the stream expand (stream.cuh) named in tile_configs.def (ATMM_STREAM_EXPAND lines).
#include "atmm/stream.cuh"

#define ATMM_STREAM_EXPAND(NAME, BM, BN, WM, WN, KMAX, ST) ATMM_DEFINE_FUSED(NAME, detail::stream_expand, BM, BN, WM, WN, KMAX, ST)
#include "atmm/tile_configs.def"
