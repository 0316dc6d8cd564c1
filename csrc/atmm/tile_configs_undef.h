// Undefines the row macros a file defined before including tile_configs.def, so that it can include the
// list again with other definitions (atmm.cu expands it twice). No include guard: include it after each use.
#undef ATMM_CONFIG
#undef ATMM_GEMV_SHRINK
#undef ATMM_FUSED_EXPAND
#undef ATMM_STREAM_SHRINK
#undef ATMM_STREAM_EXPAND
#undef ATMM_SM90_EXPAND
#undef ATMM_TRITON_SHRINK
#undef ATMM_TRITON_EXPAND
#undef ATMM_TRITON_EXPAND_COLS
