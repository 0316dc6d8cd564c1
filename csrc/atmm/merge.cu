// Merge kernels, W read and written once: the streaming update of stream.cuh (mg_*: row tiles of W
// whose lora_B rows stay in registers while column chunks of W and lora_A stream through), one
// batched CUTLASS GEMM with beta = 1 (m*), or the hand-written WMMA kernel (fused_m*).
//   A operand = lora_B[l] [d_out, r] row-major, B operand = lora_A[l] [r, d_in] row-major,
//   C = D = W[l] [d_out, d_in] row-major.
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/device/gemm_universal.h"
#include "cutlass/gemm/gemm.h"

#include <sstream>

#include "atmm/merge.h"
#include "atmm/stream.cuh"

namespace atmm {
namespace {

template <typename Element, int TbM, int TbN, int TbK, int WarpM, int WarpN, int WarpK, int Stages>
struct MergeGemm {
  using Layout = cutlass::layout::RowMajor;
  using EpilogueOp = cutlass::epilogue::thread::LinearCombination<Element, 8, float, float>;
  using Gemm = cutlass::gemm::device::GemmUniversal<
      Element, Layout, Element, Layout, Element, Layout, float,
      cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80,
      cutlass::gemm::GemmShape<TbM, TbN, TbK>, cutlass::gemm::GemmShape<WarpM, WarpN, WarpK>,
      cutlass::gemm::GemmShape<16, 8, 16>, EpilogueOp,
      cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<8>, Stages, 8, 8>;

  static cudaError_t run(MergeArgs const& a, cudaStream_t stream) {
    using E = Element;
    int64_t sw = int64_t(a.d_out) * a.d_in, sa = int64_t(a.rank) * a.d_in, sb = int64_t(a.d_out) * a.rank;
    typename Gemm::Arguments args(
        cutlass::gemm::GemmUniversalMode::kBatched, {a.d_out, a.d_in, a.rank}, a.layers,
        typename EpilogueOp::Params(a.alpha, 1.0f),
        static_cast<E const*>(a.lora_b), static_cast<E const*>(a.lora_a), static_cast<E const*>(a.w), static_cast<E*>(a.w),
        sb, sa, sw, sw, a.rank, a.d_in, a.d_in, a.d_in);
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

// The merge configurations (shapes from cutlass_library's SM80 16816 list).
using MergeBig16 = MergeGemm<cutlass::half_t, 128, 256, 64, 64, 64, 64, 3>;
using MergeBigBF = MergeGemm<cutlass::bfloat16_t, 128, 256, 64, 64, 64, 64, 3>;
using MergeMid16 = MergeGemm<cutlass::half_t, 128, 128, 64, 64, 64, 64, 3>;
using MergeMidBF = MergeGemm<cutlass::bfloat16_t, 128, 128, 64, 64, 64, 64, 3>;

}  // namespace

// Streaming merge configurations: (name, tb_m, tb_n, warps_m, warps_n, max_rank, stages).
#define ATMM_MERGE_STREAM_CONFIGS(X)        \
  X(mg_m128n128_r64, 128, 128, 4, 2, 64, 3)  \
  X(mg_m128n128_r128, 128, 128, 4, 2, 128, 2) \
  X(mg_m64n128_r64, 64, 128, 4, 2, 64, 4)    \
  X(mg_m64n128_r128, 64, 128, 4, 2, 128, 3)

std::vector<std::string> merge_config_names() {
  std::vector<std::string> names = {"m128x256_k64_s3", "m128x128_k64_s3", "fused_m64n128", "fused_m128n128"};
#define ATMM_MERGE_NAME(NAME, BM, BN, WM, WN, KMAX, ST) names.push_back(#NAME);
  ATMM_MERGE_STREAM_CONFIGS(ATMM_MERGE_NAME)
#undef ATMM_MERGE_NAME
  return names;
}

std::vector<int> merge_config_max_ranks() {
  std::vector<int> r = {0, 0, 128, 128};
#define ATMM_MERGE_RANK(NAME, BM, BN, WM, WN, KMAX, ST) r.push_back(KMAX);
  ATMM_MERGE_STREAM_CONFIGS(ATMM_MERGE_RANK)
#undef ATMM_MERGE_RANK
  return r;
}

std::string merge(MergeArgs const& a, cudaStream_t stream) {
  std::ostringstream shape;
  shape << "layers=" << a.layers << " d_out=" << a.d_out << " d_in=" << a.d_in << " rank=" << a.rank
        << " dtype=" << (a.bf16 ? "bf16" : "fp16");
  if (a.layers <= 0 || a.d_out <= 0 || a.d_in <= 0 || a.rank <= 0) return "merge: empty shape: " + shape.str();
  if (a.d_in % 8 || a.rank % 8) return "merge: d_in and rank must be multiples of 8: " + shape.str();
  cudaError_t e;
  switch (a.config) {
    case 0: e = a.bf16 ? MergeBigBF::run(a, stream) : MergeBig16::run(a, stream); break;
    case 1: e = a.bf16 ? MergeMidBF::run(a, stream) : MergeMid16::run(a, stream); break;
    case 2: e = merge_fused(a, 0, stream); break;
    case 3: e = merge_fused(a, 1, stream); break;
    default: {
      int i = 4;
      e = cudaErrorInvalidValue;
      bool found = false;
#define ATMM_MERGE_RUN(NAME, BM, BN, WM, WN, KMAX, ST)                                                      \
  if (!found && a.config == i) {                                                                            \
    found = true;                                                                                           \
    if (a.rank > KMAX) return "merge: config " #NAME " serves ranks up to " #KMAX ": " + shape.str();       \
    e = a.bf16 ? detail::stream_merge<__nv_bfloat16, BM, BN, WM, WN, KMAX, ST>(a, stream)                   \
               : detail::stream_merge<__half, BM, BN, WM, WN, KMAX, ST>(a, stream);                         \
  }                                                                                                         \
  ++i;
      ATMM_MERGE_STREAM_CONFIGS(ATMM_MERGE_RUN)
#undef ATMM_MERGE_RUN
      if (!found) return "merge: unknown config index: " + shape.str();
    }
  }
  if (e != cudaSuccess) return std::string("merge: ") + cudaGetErrorString(e) + ": " + shape.str();
  return "";
}

}  // namespace atmm
