// Hopper path: CUTLASS 3.x pointer-array grouped GEMMs (TMA loads, wgmma, warp-specialized persistent
// kernels whose epilogue loads its source by TMA while the main loop runs), one instantiation per
// (config, dtype) from the ATMM_SM90_EXPAND lines of tile_configs.def (the shrinks, h9s_*, were deleted:
// no table picked them; csrc/atmm/NOTES.md).
//
//   expand: y[seg] = scale[slot] * v[seg] @ lora_B[slot]^T + y[seg]    (in place: C = D = y rows)
//
// They read the same problem arrays the prep kernel writes for the SM80 CUTLASS kernels (sizes,
// pointers, leading dimensions, per-group alpha pointers): a CUTLASS 3 row-major stride holds just its
// leading dimension, and a problem shape is three ints, as a GemmCoord is (checked below). The
// persistent grid is one block per SM whatever the segment lengths, so nothing is read back to the
// host and the launch can be captured in a CUDA graph. Its TMA descriptors (per SM, rewritten on
// the device per group) live in the caller's workspace (GroupedLaunch::scratch).
#pragma once

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/gemm.h"

#include "atmm/atmm.h"

namespace atmm {

struct Sm90Pingpong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};
struct Sm90Cooperative {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// D[g] = alpha[g] * A[g] @ B[g] (+ C[g] when kSource). Expand: Element in and out, C = D = y rows,
// alpha = the slot's scale. Shrink: fp32 partials out (ElementD = float), no source read, alpha 1.
// EpiM/EpiN: the epilogue's sub-tile (0: CUTLASS's choice). The epilogue keeps up to 4 sub-tiles of
// y in flight per block, so a larger sub-tile means more bytes of y in flight.
template <typename Element, typename ElementD, bool kSource, int TbM, int TbN, int TbK, int EpiM, int EpiN, int ClM,
          typename Schedule>
struct Sm90Grouped {
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using LayoutA = cutlass::layout::RowMajor;     // x or v rows [M, K], leading dimension d_in or r_max
  using LayoutB = cutlass::layout::ColumnMajor;  // a PEFT weight [N, K] row-major, read as [K, N] column-major
  using LayoutC = cutlass::layout::RowMajor;     // y rows or fp32 partials [M, N]
  using ElementC = std::conditional_t<kSource, ElementD, void>;
  static constexpr int kAlign = 8;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using TileShape = cute::Shape<cute::Int<TbM>, cute::Int<TbN>, cute::Int<TbK>>;
  // ClM = 2: two blocks on neighbouring row tiles of one segment share each lora tile (TMA multicast),
  // halving its reads from L2 (per row tile the weight is as large as, or larger than, the activations).
  using ClusterShape = cute::Shape<cute::Int<ClM>, cute::_1, cute::_1>;
  using EpiTile = std::conditional_t<EpiM == 0, cutlass::epilogue::collective::EpilogueTileAuto,
                                     cute::Shape<cute::Int<(EpiM > 0 ? EpiM : 1)>, cute::Int<(EpiN > 0 ? EpiN : 1)>>>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpiTile, float, float,
      ElementC, LayoutC*, kAlignD, ElementD, LayoutC*, kAlignD, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, LayoutA*, kAlign, Element, LayoutB*, kAlign,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  static_assert(sizeof(StrideA) == sizeof(int64_t) && sizeof(StrideB) == sizeof(int64_t) &&
                sizeof(StrideC) == sizeof(int64_t) && sizeof(StrideD) == sizeof(int64_t),
                "a row-major CUTLASS 3 stride must hold just its leading dimension (the prep kernel writes int64)");
  static_assert(sizeof(Shape3) == sizeof(cutlass::gemm::GemmCoord), "problem shapes are written as GemmCoord");

  static typename Gemm::Arguments arguments(GroupedLaunch const& L) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = 0;
    cudaGetDevice(&hw.device_id);
    hw.sm_count = sm_count();
    typename Gemm::Arguments args;
    decltype(args.epilogue.thread) fusion{};
    fusion.alpha = L.alpha_ptrs ? 0.0f : 1.0f;
    fusion.beta = L.beta;
    fusion.alpha_ptr = nullptr;
    fusion.beta_ptr = nullptr;
    fusion.alpha_ptr_array = L.alpha_ptrs;  // the expand: the adapter's scale, one per group
    fusion.beta_ptr_array = nullptr;
    fusion.dAlpha = {cute::_0{}, cute::_0{}, L.alpha_ptrs ? 1 : 0};
    fusion.dBeta = {cute::_0{}, cute::_0{}, 0};
    auto elem = [](void** p) { return (Element const**)(p); };  // the arrays hold pointers to Element
    args = typename Gemm::Arguments{
        cutlass::gemm::GemmUniversalMode::kGrouped,
        {L.count, reinterpret_cast<Shape3*>(L.problems), nullptr},  // no host copy: the device schedules
        {elem(L.ptr_a), reinterpret_cast<StrideA*>(L.ld_a), elem(L.ptr_b), reinterpret_cast<StrideB*>(L.ld_b)},
        {fusion, kSource ? (ElementC const**)(L.ptr_c) : nullptr, reinterpret_cast<StrideC*>(L.ld_c),
         reinterpret_cast<ElementD**>(L.ptr_c), reinterpret_cast<StrideD*>(L.ld_c)},
        hw};
    return args;
  }

  static size_t workspace_bytes(int groups) {
    GroupedLaunch L{};
    L.count = groups;
    return Gemm::get_workspace_size(arguments(L));
  }

  static cudaError_t run(GroupedLaunch const& L, cudaStream_t stream) {
    if (L.count == 0) return cudaSuccess;
    if (device_cc_major() != 9) return cudaErrorNotSupported;  // sm_90a code: Hopper only
    auto args = arguments(L);
    if (Gemm::get_workspace_size(args) > L.scratch_bytes) return cudaErrorInvalidValue;
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
    if (gemm.initialize(args, L.scratch, stream) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
    if (gemm.run(stream) != cutlass::Status::kSuccess) {
      cudaError_t e = cudaGetLastError();
      return e == cudaSuccess ? cudaErrorLaunchFailure : e;
    }
    return cudaGetLastError();
  }
};

}  // namespace atmm

#define ATMM_SM90_SCHEDULE_ATMM_PINGPONG atmm::Sm90Pingpong
#define ATMM_SM90_SCHEDULE_ATMM_COOPERATIVE atmm::Sm90Cooperative
// Defines atmm_run_<name>_<dtype>_<DIR> and atmm_sm90_ws_<name>_<dtype>.
#define ATMM_DEFINE_SM90_(NAME, DT, DIR, ELEMENT, ELEMENT_D, SOURCE, TBM, TBN, TBK, EM, EN, CM, SCHED)                   \
  namespace atmm {                                                                                                     \
  using Sm90_##NAME##_##DT = Sm90Grouped<ELEMENT, ELEMENT_D, SOURCE, TBM, TBN, TBK, EM, EN, CM, ATMM_SM90_SCHEDULE_##SCHED>; \
  cudaError_t atmm_run_##NAME##_##DT##_##DIR(GroupedLaunch const& L, cudaStream_t s) { return Sm90_##NAME##_##DT::run(L, s); } \
  size_t atmm_sm90_ws_##NAME##_##DT(int groups) { return Sm90_##NAME##_##DT::workspace_bytes(groups); }                \
  }
// The expand updates y in place (source read).
#define ATMM_DEFINE_SM90_EXPAND(NAME, DT, ELEMENT, TBM, TBN, TBK, EM, EN, CM, SCHED) \
  ATMM_DEFINE_SM90_(NAME, DT, expand, ELEMENT, ELEMENT, true, TBM, TBN, TBK, EM, EN, CM, SCHED)

