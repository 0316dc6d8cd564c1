// Instantiations of the stream shrink (stream.cuh) named in tile_configs.def (ATMM_STREAM_SHRINK lines).
#include "atmm/stream.cuh"

#define ATMM_STREAM_SHRINK(NAME, BM, BK, WM, WN, KMAX, ST) ATMM_DEFINE_FUSED(NAME, detail::stream_shrink, BM, BK, WM, WN, KMAX, ST)
#include "atmm/tile_configs.def"
