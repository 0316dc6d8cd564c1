// CUTLASS 2.x grouped GEMM with a per-group alpha, one instantiation per (config, dtype, direction).
//
// Both directions compute D[g] = alpha[g] * A[g] @ B[g] + beta * C[g] with A row-major [M, K],
// B column-major [K, N] (that is, a PEFT weight [N, K] row-major), C/D row-major [M, N].
//   shrink: A = x rows of segment g, B = lora_A[slot] (chunk of d_in for split-K), D = fp32 partials.
//   expand: A = v rows of segment g, B = lora_B[slot], C = D = y rows; alpha = the slot's scale.
#pragma once

#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_grouped.h"
#include "cutlass/gemm/gemm.h"
#include "cutlass/gemm/kernel/default_gemm_grouped_per_group_scale.h"
#include "cutlass/gemm/threadblock/threadblock_swizzle.h"

#include <atomic>

#include "atmm/atmm.h"

namespace atmm {

template <typename Element, typename ElementOut, int TbM, int TbN, int TbK, int WarpM, int WarpN, int WarpK, int Stages>
struct GroupedGemm {
  // Operand A: activations, row-major, 16-byte aligned accesses.
  using ElementA = Element;
  using LayoutA = cutlass::layout::RowMajor;
  // Operand B: a PEFT weight [N, K] row-major read as a column-major [K, N] matrix.
  using ElementB = Element;
  using LayoutB = cutlass::layout::ColumnMajor;
  // Output: fp32 partials (shrink) or the activation dtype (expand), row-major.
  using ElementC = ElementOut;
  using LayoutC = cutlass::layout::RowMajor;
  // fp32 accumulation and epilogue arithmetic.
  using ElementAccumulator = float;
  // Tile shapes: threadblock, warp, and the SM80 16x8x16 tensor-core instruction.
  using ThreadblockShape = cutlass::gemm::GemmShape<TbM, TbN, TbK>;
  using WarpShape = cutlass::gemm::GemmShape<WarpM, WarpN, WarpK>;
  using InstructionShape = cutlass::gemm::GemmShape<16, 8, 16>;
  // Epilogue: alpha per group (alpha_ptr_array), one beta for all.
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<
      ElementC, 128 / cutlass::sizeof_bits<ElementC>::value, ElementAccumulator, ElementAccumulator>;
  using Kernel = typename cutlass::gemm::kernel::DefaultGemmGroupedPerGroupScale<
      ElementA, LayoutA, cutlass::ComplexTransform::kNone, kAlignment,
      ElementB, LayoutB, cutlass::ComplexTransform::kNone, kAlignment,
      ElementC, LayoutC, ElementAccumulator,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      ThreadblockShape, WarpShape, InstructionShape, EpilogueOp,
      cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, Stages,
      // The schedule is computed on the device: the host never learns the segment lengths.
      cutlass::gemm::kernel::GroupScheduleMode::kDeviceOnly>::GemmKernel;
  using Gemm = cutlass::gemm::device::GemmGrouped<Kernel>;

  static int max_active_blocks() {
    static std::atomic<int> cached{0};
    int v = cached.load();
    if (v == 0) {
      v = Gemm::maximum_active_blocks();
      if (v > 0) cached.store(v);
    }
    return v;
  }

  static cudaError_t run(GroupedLaunch const& L, cudaStream_t stream) {
    if (L.count == 0) return cudaSuccess;
    int occ = max_active_blocks();
    if (occ <= 0) return cudaErrorNotSupported;
    int blocks = L.threadblock_upper_bound;
    int cap = occ * sm_count();
    if (blocks > cap) blocks = cap;
    if (blocks < 1) blocks = 1;
    typename EpilogueOp::Params epi;
    epi.alpha = 1.0f;
    epi.beta = L.beta;
    epi.alpha_ptr_array = L.alpha_ptrs;
    typename Gemm::Arguments args(
        static_cast<cutlass::gemm::GemmCoord*>(L.problems), L.count, blocks, epi,
        reinterpret_cast<ElementA**>(L.ptr_a), reinterpret_cast<ElementB**>(L.ptr_b),
        reinterpret_cast<ElementC**>(L.ptr_c), reinterpret_cast<ElementC**>(L.ptr_c),
        L.ld_a, L.ld_b, L.ld_c, L.ld_c);
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
    if (gemm.initialize(args, nullptr, stream) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
    if (gemm.run(stream) != cutlass::Status::kSuccess) {
      cudaError_t e = cudaGetLastError();
      return e == cudaSuccess ? cudaErrorLaunchFailure : e;
    }
    return cudaGetLastError();
  }
};

}  // namespace atmm

// Defines atmm_run_<name>_<dtype>_<direction>, the entry point registry.cu points at.
#define ATMM_DEFINE_RUN(NAME, DT, DIR, ELEMENT, ELEMENT_OUT, TBM, TBN, TBK, WM, WN, WK, ST)             \
  namespace atmm {                                                                                  \
  cudaError_t atmm_run_##NAME##_##DT##_##DIR(GroupedLaunch const& L, cudaStream_t s) {                \
    return GroupedGemm<ELEMENT, ELEMENT_OUT, TBM, TBN, TBK, WM, WN, WK, ST>::run(L, s);               \
  }                                                                                                 \
  }
