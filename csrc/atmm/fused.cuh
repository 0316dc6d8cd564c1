// Hand-written ATMM kernels beside the CUTLASS ones (see fused.cu):
//   gemv shrink   : few-token segments, d_in split in chunks, fp32 partials (no prep, no tensor cores)
//   fused expand  : sums the split-K partials, rounds v to the activation dtype, multiplies by
//                   lora_B on the tensor cores (WMMA), and updates y in place with the slot's scale.
// Both find each block's segment on the device from seg_indptr/seg_slot and the slot table passed
// by value, so neither needs the prep kernel.
#pragma once

#include "atmm/atmm.h"

namespace atmm {

struct FusedArgs {
  const int32_t* seg_indptr;
  const int32_t* seg_slot;
  int num_segments;
  SlotTable slots;
  const void* x;
  const void* lora_a;
  const void* lora_b;
  void* y;
  float* partial;  // [splits, T, r_max] fp32
  void* v;         // [T, r_max] in the activation dtype
  float* slot_scale;  // workspace the Triton expand fills: kMaxSlots scales (0: rank 0), then kMaxSlots padded ranks
  int slot_scale_ready;  // slot_scale was written before the shrink (launch_slot_scale in the prep phase)
  int v_ready;     // the shrink wrote v itself (stream shrink, d_in not split): expands read v, not partials
  int pdl;         // launch the expand as a programmatic dependent of the shrink (sm_90)
  int shrink_pdl;  // launch the (Triton) shrink as a programmatic dependent of the slot-scale kernel just before it
  int splits;      // chunks of d_in: the shrink's, and the fp32 partials the expand sums. forward() sets it to 1
                   // for the expand after a Triton shrink split d_in: that one adds its chunks into partial[0].
  int k_chunk;     // elements of d_in per chunk
  int64_t num_tokens;
  int d_in, d_out, r_max;
  int64_t ld_x, ld_y;
};

// Slot s of the workspace the Triton expands read (FusedArgs::slot_scale): its scale (0 for a slot of rank 0: its
// rows stay as they are), and kMaxSlots further on its padded rank. Written by the slot-scale kernel or by prep.
__device__ inline void write_slot_scale(SlotTable const& t, float* out, int s) {
  out[s] = t.rank_padded[s] > 0 ? t.scale[s] : 0.0f;
  reinterpret_cast<int*>(out + kMaxSlots)[s] = t.rank_padded[s];
}

#if ATMM_HAVE_TRITON
// Writes slot scales (0 for rank 0) and padded ranks into a.slot_scale for the Triton expands (triton.cu).
// The kernel lets its programmatic dependent start at once (griddepcontrol.launch_dependents).
cudaError_t launch_slot_scale(FusedArgs const& a, cudaStream_t stream);
// Zeroes partial[0] ([T, r_max] fp32), which a split Triton shrink adds its d_in chunks into; with
// `scales`, also writes the slot scales as launch_slot_scale does. Lets its dependent start at once too.
cudaError_t launch_zero_partial(FusedArgs const& a, bool scales, cudaStream_t stream);
#endif

// Defines config NAME's entry points that atmm.cu's registry names, atmm_fused_NAME_f16 and atmm_fused_NAME_bf16:
// KERNEL<__half, ...>(a, s) and KERNEL<__nv_bfloat16, ...>(a, s), the rest of the arguments being KERNEL's
// template arguments after the element type (KERNEL is looked up in namespace atmm). Expand it at file scope.
#define ATMM_DEFINE_FUSED(NAME, KERNEL, ...)                                 \
  namespace atmm {                                                           \
  cudaError_t atmm_fused_##NAME##_f16(FusedArgs const& a, cudaStream_t s) {  \
    return KERNEL<__half, __VA_ARGS__>(a, s);                                \
  }                                                                          \
  cudaError_t atmm_fused_##NAME##_bf16(FusedArgs const& a, cudaStream_t s) { \
    return KERNEL<__nv_bfloat16, __VA_ARGS__>(a, s);                         \
  }                                                                          \
  }

template <typename T>
cudaError_t gemv_shrink(FusedArgs const& a, cudaStream_t stream);
template <typename T, int BM, int BN, int WARPS_M, int WARPS_N>
cudaError_t fused_expand(FusedArgs const& a, cudaStream_t stream);

}  // namespace atmm
