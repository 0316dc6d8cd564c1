// ATMM: shared declarations between the kernels (nvcc) and the bindings (host compiler).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime.h>

namespace atmm {

enum class Direction : int { kShrink = 0, kExpand = 1 };
enum class DType : int { kF16 = 0, kBF16 = 1 };

const char* direction_name(Direction d);
const char* dtype_name(DType t);

// Most adapter slots one call may address: ranks and scales travel by value in a kernel parameter.
constexpr int kMaxSlots = 256;

struct SlotTable {
  int rank_padded[kMaxSlots];  // rank rounded up to kAlignment (lora_a/lora_b are zero past the rank)
  float scale[kMaxSlots];
};
// Operand alignment in elements (16 bytes of fp16/bf16): widths, strides and padded ranks are multiples.
constexpr int kAlignment = 8;

// One grouped GEMM launch. The arrays live in device memory and are written by the prep kernel.
// problems points to cutlass::gemm::GemmCoord[count]; the element pointers are typed by the kernel.
struct GroupedLaunch {
  void* problems;
  int count;
  int threadblock_upper_bound;  // tiles that can exist: the kernel launches min(this, occupancy) CTAs
  void** ptr_a;
  void** ptr_b;
  void** ptr_c;  // also D: every kernel here updates in place or writes a fresh buffer
  int64_t* ld_a;
  int64_t* ld_b;
  int64_t* ld_c;
  float const* const* alpha_ptrs;  // per-group alpha (expand: the adapter's scale); null: alpha = 1
  float beta;                       // 0: overwrite (shrink partials); 1: accumulate into y (expand)
  void* scratch = nullptr;          // the Hopper (CUTLASS 3) kernels' own workspace: TMA descriptors
  size_t scratch_bytes = 0;
};

// A compiled grouped GEMM: returns a CUDA error, or cudaErrorNotSupported when CUTLASS refuses it.
using GroupedFn = cudaError_t (*)(GroupedLaunch const&, cudaStream_t);

struct FusedArgs;
// A hand-written or Triton kernel (fused.cu, stream_*.cu, triton.cu): gemv/stream/Triton shrink, fused/stream/Triton expand.
using FusedFn = cudaError_t (*)(FusedArgs const&, cudaStream_t);

enum class Kind : int { kCutlass = 0, kGemvShrink = 1, kFusedExpand = 2, kStreamShrink = 4, kStreamExpand = 5, kSm90 = 7,
                        kTritonShrink = 9, kTritonExpand = 10 };
// The workspace a Hopper (CUTLASS 3) kernel needs for `groups` problems, beyond the problem arrays.
using ScratchFn = size_t (*)(int groups);

struct KernelConfig {
  const char* name;
  int tb_m, tb_n, tb_k, warp_m, warp_n, warp_k, stages;
  bool shrink;  // built for the shrink direction
  GroupedFn shrink_f16, shrink_bf16, expand_f16, expand_bf16;
  Kind kind;
  FusedFn fused_f16, fused_bf16;
  int max_rank;  // largest padded rank this config serves; 0: any
  size_t smem;   // dynamic shared memory per block (hand-written kinds; CUTLASS: 0, see the tuner)
  ScratchFn scratch_f16 = nullptr, scratch_bf16 = nullptr;  // kSm90: its own workspace (TMA descriptors)
  GroupedFn fn(Direction d, DType t) const;
  // Whether this config can serve direction d for dtype t (either kind).
  bool serves(Direction d, DType t) const;
  bool serves_rank(int padded_rank) const { return max_rank == 0 || padded_rank <= max_rank; }
};

// Every compiled configuration, in the order of tile_configs.def.
const std::vector<KernelConfig>& kernel_configs();
// Index of a configuration by name, or -1.
int find_config(const std::string& name);

// Where one direction's grouped-GEMM problem arrays lie in the workspace (the prep kernel writes them):
// problem sizes, A/B/C pointers, the A and B leading dimension (one array for both) and C's.
struct ProblemArrays {
  size_t problems, ptr_a, ptr_b, ptr_c, ld_ab, ld_c;
};

// Workspace carved into the per-call metadata and intermediates (see forward()).
struct WorkspaceLayout {
  ProblemArrays shrink, expand;
  size_t alpha, alpha_ptrs, seg_rank, partial, v;
  size_t slot_scale;  // kMaxSlots floats, then kMaxSlots ints: each slot's scale and padded rank (Triton expand)
  size_t scratch, scratch_bytes;  // the Hopper kernels' own workspace (the largest any of them needs)
  size_t total;
};
WorkspaceLayout workspace_layout(int num_segments, int split_k, int64_t num_tokens, int r_max, DType dtype);

struct ForwardArgs {
  void* y; const void* x; const void* lora_a; const void* lora_b;
  const int32_t* seg_indptr; const int32_t* seg_slot;
  void* workspace; size_t workspace_bytes;
  int64_t num_tokens; int d_in; int d_out; int r_max; int64_t ld_x; int64_t ld_y;
  int num_segments;
  std::vector<int> ranks; std::vector<float> scales;
  DType dtype;
  int shrink_config; int split_k; int expand_config;
  bool pdl;  // may launch the expand as a programmatic dependent of the shrink (sm_90)
};

// Launches prep, shrink, split-K reduction and expand on `stream`. Returns "" or an error message.
std::string forward(ForwardArgs const& a, cudaStream_t stream);

// Launch helpers defined in atmm.cu. slots: the call's padded ranks and scales (forward builds them once);
// slot_scale non-null: prep also writes the Triton expand's slot scales there.
cudaError_t launch_prep(ForwardArgs const& a, WorkspaceLayout const& w, SlotTable const& slots, int k_chunk, int splits_used,
                        float* slot_scale, cudaStream_t stream);
cudaError_t launch_reduce(ForwardArgs const& a, WorkspaceLayout const& w, int splits_used, cudaStream_t stream);

int sm_count();
// Compute capability major of the current device (cached per device).
int device_cc_major();
// Compute capability of the current device as major * 10 + minor (90: H100/H200), cached per device.
int device_cc();

}  // namespace atmm
