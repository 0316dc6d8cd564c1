// fp16/bf16 <-> fp32 conversions for the hand-written ATMM kernels (atmm.cu, fused.cu): one definition,
// round-to-nearest-even, the same intrinsics for every kernel.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace atmm {
namespace detail {

// to_f: overloads (the type is deduced); from_f: a template (the caller names the type it returns).
__device__ inline float to_f(__half v) { return __half2float(v); }
__device__ inline float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ inline T from_f(float f);
template <>
__device__ inline __half from_f<__half>(float f) { return __float2half_rn(f); }
template <>
__device__ inline __nv_bfloat16 from_f<__nv_bfloat16>(float f) { return __float2bfloat16_rn(f); }

}  // namespace detail
}  // namespace atmm
