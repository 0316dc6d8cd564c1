// ATMM host driver and the small kernels around the grouped GEMMs:
//   prep   : segment table -> grouped-GEMM problem arrays (sizes, pointers, strides, alphas), on device
//   reduce : sums the shrink's split-K fp32 partials into v (activation dtype)
// and the registry of compiled configurations.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <tuple>
#include <sstream>

#include "cutlass/gemm_coord.h"

#include "atmm/atmm.h"
#include "atmm/convert.cuh"
#include "atmm/driver.h"
#include "atmm/fused.cuh"
#include "atmm/stream.cuh"

namespace atmm {

// ---------------------------------------------------------------------------------------------
// Registry
// ---------------------------------------------------------------------------------------------
#define ATMM_BOTH true
#define ATMM_EXPAND_ONLY false

// Pass 1: declare every compiled entry point.
#define ATMM_DECLARE_ATMM_BOTH(NAME)                                               \
  cudaError_t atmm_run_##NAME##_f16_shrink(GroupedLaunch const&, cudaStream_t);  \
  cudaError_t atmm_run_##NAME##_bf16_shrink(GroupedLaunch const&, cudaStream_t); \
  cudaError_t atmm_run_##NAME##_f16_expand(GroupedLaunch const&, cudaStream_t);  \
  cudaError_t atmm_run_##NAME##_bf16_expand(GroupedLaunch const&, cudaStream_t);
#define ATMM_DECLARE_ATMM_EXPAND_ONLY(NAME)                                      \
  cudaError_t atmm_run_##NAME##_f16_expand(GroupedLaunch const&, cudaStream_t); \
  cudaError_t atmm_run_##NAME##_bf16_expand(GroupedLaunch const&, cudaStream_t);
#define ATMM_DECLARE_FUSED(NAME)                                             \
  cudaError_t atmm_fused_##NAME##_f16(FusedArgs const&, cudaStream_t);  \
  cudaError_t atmm_fused_##NAME##_bf16(FusedArgs const&, cudaStream_t);
#define ATMM_CONFIG(NAME, TBM, TBN, TBK, WM, WN, WK, ST, DIRS) ATMM_DECLARE_##DIRS(NAME)
#define ATMM_GEMV_SHRINK(NAME) ATMM_DECLARE_FUSED(NAME)
#define ATMM_FUSED_EXPAND(NAME, BM, BN, WM, WN, MINB) ATMM_DECLARE_FUSED(NAME)
#define ATMM_STREAM_SHRINK(NAME, BM, BK, WM, WN, KMAX, ST) ATMM_DECLARE_FUSED(NAME)
#define ATMM_STREAM_EXPAND(NAME, BM, BN, WM, WN, KMAX, ST) ATMM_DECLARE_FUSED(NAME)
#if ATMM_HAVE_SM90
#define ATMM_DECLARE_SM90_WS(NAME)       \
  size_t atmm_sm90_ws_##NAME##_f16(int); \
  size_t atmm_sm90_ws_##NAME##_bf16(int);
#define ATMM_SM90_EXPAND(NAME, TBM, TBN, TBK, EM, EN, CM, SCHED) ATMM_DECLARE_ATMM_EXPAND_ONLY(NAME) ATMM_DECLARE_SM90_WS(NAME)
#else
#define ATMM_SM90_EXPAND(...)  // built only for sm_90a (ATMM_CUDA_ARCHS)
#endif
#if ATMM_HAVE_TRITON
#define ATMM_TRITON_SHRINK(NAME, ...) ATMM_DECLARE_FUSED(NAME) size_t atmm_fused_##NAME##_smem();
#define ATMM_TRITON_EXPAND(NAME, ...) ATMM_DECLARE_FUSED(NAME) size_t atmm_fused_##NAME##_smem();
#define ATMM_TRITON_EXPAND_COLS(NAME, ...) ATMM_DECLARE_FUSED(NAME) size_t atmm_fused_##NAME##_smem();
#endif
#include "atmm/tile_configs.def"
#include "atmm/tile_configs_undef.h"

#define ATMM_FNS_ATMM_BOTH(NAME) \
  atmm_run_##NAME##_f16_shrink, atmm_run_##NAME##_bf16_shrink, atmm_run_##NAME##_f16_expand, atmm_run_##NAME##_bf16_expand
#define ATMM_FNS_ATMM_EXPAND_ONLY(NAME) nullptr, nullptr, atmm_run_##NAME##_f16_expand, atmm_run_##NAME##_bf16_expand

const std::vector<KernelConfig>& kernel_configs() {
  // Pass 2: one entry per line of tile_configs.def, in its order.
  static const std::vector<KernelConfig> configs = {
#define ATMM_CONFIG(NAME, TBM, TBN, TBK, WM, WN, WK, ST, DIRS) \
  KernelConfig{#NAME, TBM, TBN, TBK, WM, WN, WK, ST, DIRS, ATMM_FNS_##DIRS(NAME), Kind::kCutlass, nullptr, nullptr, 0, 0},
#define ATMM_GEMV_SHRINK(NAME)                                                                   \
  KernelConfig{#NAME, 4, 128, 8, 4, 128, 8, 1, true, nullptr, nullptr, nullptr, nullptr, Kind::kGemvShrink, \
               atmm_fused_##NAME##_f16, atmm_fused_##NAME##_bf16, 0, 0},
#define ATMM_FUSED_EXPAND(NAME, BM, BN, WM, WN, MINB)                                                \
  KernelConfig{#NAME, BM, BN, 16, BM / WM, BN / WN, 16, 1, false, nullptr, nullptr, nullptr, nullptr, \
               Kind::kFusedExpand, atmm_fused_##NAME##_f16, atmm_fused_##NAME##_bf16, 128, 0},
#define ATMM_STREAM_SHRINK(NAME, BM, BK, WM, WN, KMAX, ST)                                                \
  KernelConfig{#NAME, BM, KMAX, BK, BM / WM, KMAX / WN, 16, ST, true, nullptr, nullptr, nullptr, nullptr, \
               Kind::kStreamShrink, atmm_fused_##NAME##_f16, atmm_fused_##NAME##_bf16, KMAX,              \
               detail::ShrinkCfg<__nv_bfloat16, BM, BK, WM, WN, KMAX, ST>::kSmem},
#define ATMM_STREAM_EXPAND(NAME, BM, BN, WM, WN, KMAX, ST)                                                   \
  KernelConfig{#NAME, BM, BN, KMAX, BM / WM, BN / WN, 16, ST, false, nullptr, nullptr, nullptr, nullptr,      \
               Kind::kStreamExpand, atmm_fused_##NAME##_f16, atmm_fused_##NAME##_bf16, KMAX,                  \
               detail::UpdateCfg<__nv_bfloat16, BM, BN, WM, WN, KMAX, ST, false>::kSmem},
#if ATMM_HAVE_SM90
#define ATMM_SM90_EXPAND(NAME, TBM, TBN, TBK, EM, EN, CM, SCHED)                                                \
  KernelConfig{#NAME, TBM, TBN, TBK, 64, TBN, 16, 0, false, ATMM_FNS_ATMM_EXPAND_ONLY(NAME), Kind::kSm90, \
               nullptr, nullptr, 0, 0, atmm_sm90_ws_##NAME##_f16, atmm_sm90_ws_##NAME##_bf16},
#else
#define ATMM_SM90_EXPAND(...)
#endif
#if ATMM_HAVE_TRITON
#define ATMM_TRITON_SHRINK(NAME, BM, BK, R, W, S)                                                                \
  KernelConfig{#NAME, BM, R, BK, BM, R, 16, S, true, nullptr, nullptr, nullptr, nullptr, Kind::kTritonShrink,    \
               atmm_fused_##NAME##_f16, atmm_fused_##NAME##_bf16, R, atmm_fused_##NAME##_smem()},
#define ATMM_TRITON_EXPAND(NAME, BM, BN, R, CH, W, S)                                                            \
  KernelConfig{#NAME, BM, BN, R, BM, BN, 16, S, false, nullptr, nullptr, nullptr, nullptr, Kind::kTritonExpand,  \
               atmm_fused_##NAME##_f16, atmm_fused_##NAME##_bf16, R, atmm_fused_##NAME##_smem()},
#define ATMM_TRITON_EXPAND_COLS(NAME, BM, BN, R, W, S, WAVES)                                                   \
  KernelConfig{#NAME, BM, BN, R, BM, BN, 16, S, false, nullptr, nullptr, nullptr, nullptr, Kind::kTritonExpand,  \
               atmm_fused_##NAME##_f16, atmm_fused_##NAME##_bf16, R, atmm_fused_##NAME##_smem()},
#endif
#include "atmm/tile_configs.def"
#include "atmm/tile_configs_undef.h"
  };
  return configs;
}

GroupedFn KernelConfig::fn(Direction d, DType t) const {
  if (d == Direction::kShrink) return t == DType::kF16 ? shrink_f16 : shrink_bf16;
  return t == DType::kF16 ? expand_f16 : expand_bf16;
}

bool KernelConfig::serves(Direction d, DType t) const {
  switch (kind) {
    case Kind::kCutlass: return fn(d, t) != nullptr;
    case Kind::kGemvShrink:
    case Kind::kStreamShrink:
    case Kind::kTritonShrink: return d == Direction::kShrink;
    case Kind::kFusedExpand:
    case Kind::kStreamExpand:
    case Kind::kTritonExpand: return d == Direction::kExpand;
    case Kind::kSm90: return fn(d, t) != nullptr;
  }
  return false;
}

int find_config(const std::string& name) {
  const auto& c = kernel_configs();
  for (size_t i = 0; i < c.size(); ++i)
    if (name == c[i].name) return int(i);
  return -1;
}

const char* direction_name(Direction d) { return d == Direction::kShrink ? "shrink" : "expand"; }
const char* dtype_name(DType t) { return t == DType::kF16 ? "fp16" : "bf16"; }

namespace {
// A positive value of the current device, read once per device (multi-GPU servers: per device); 0 marks
// "not read yet", so a value that is not positive is cached as 1.
template <int (*Read)(int dev)>
int cached_per_device() {
  static std::atomic<int> cached[64];
  int dev = 0;
  cudaGetDevice(&dev);
  int v = cached[dev & 63].load(std::memory_order_relaxed);
  if (v == 0) {
    v = std::max(Read(dev), 1);
    cached[dev & 63].store(v, std::memory_order_relaxed);
  }
  return v;
}

template <cudaDeviceAttr Attr>
int read_attribute(int dev) {
  int v = 0;
  return cudaDeviceGetAttribute(&v, Attr, dev) == cudaSuccess ? v : 0;
}

// major * 10 + minor: positive even where the minor version is 0 (an attribute of its own would not be).
int read_cc(int dev) {
  return read_attribute<cudaDevAttrComputeCapabilityMajor>(dev) * 10 + read_attribute<cudaDevAttrComputeCapabilityMinor>(dev);
}

template <cudaDeviceAttr Attr>
int cached_attribute() { return cached_per_device<read_attribute<Attr>>(); }
}  // namespace

int device_cc_major() { return cached_attribute<cudaDevAttrComputeCapabilityMajor>(); }
int device_cc() { return cached_per_device<read_cc>(); }
int sm_count() { return cached_attribute<cudaDevAttrMultiProcessorCount>(); }

// ---------------------------------------------------------------------------------------------
// Workspace
// ---------------------------------------------------------------------------------------------
namespace {
size_t carve(size_t& cursor, size_t bytes) {
  size_t at = (cursor + 255) & ~size_t(255);
  cursor = at + bytes;
  return at;
}

// The problem arrays of n grouped-GEMM problems.
ProblemArrays carve_problems(size_t& cursor, size_t n) {
  ProblemArrays o;
  o.problems = carve(cursor, n * sizeof(cutlass::gemm::GemmCoord));
  o.ptr_a = carve(cursor, n * sizeof(void*));
  o.ptr_b = carve(cursor, n * sizeof(void*));
  o.ptr_c = carve(cursor, n * sizeof(void*));
  o.ld_ab = carve(cursor, n * sizeof(int64_t));
  o.ld_c = carve(cursor, n * sizeof(int64_t));
  return o;
}
}  // namespace

// The largest workspace any Hopper kernel needs for this call (shrink and expand run one after the
// other: they share it). Asked on every forward(): cached per (dtype, segments, split_k).
static size_t sm90_scratch_bytes(int num_segments, int split_k, DType dtype) {
  static std::mutex mu;
  static std::map<std::tuple<int, int, int>, size_t> cache;
  const auto key = std::make_tuple(int(dtype), num_segments, split_k);
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  size_t scratch = 0;
  for (KernelConfig const& k : kernel_configs())
    if (k.kind == Kind::kSm90) {
      auto fn = dtype == DType::kF16 ? k.scratch_f16 : k.scratch_bf16;
      scratch = std::max(scratch, fn(num_segments));  // the Hopper kernels are expands: one problem per segment
    }
  if (cache.size() > 4096) cache.clear();
  cache.emplace(key, scratch);
  return scratch;
}

WorkspaceLayout workspace_layout(int num_segments, int split_k, int64_t num_tokens, int r_max, DType dtype) {
  WorkspaceLayout w{};
  size_t c = 0;
  size_t p1 = size_t(num_segments) * size_t(split_k), p2 = size_t(num_segments);
  w.shrink = carve_problems(c, p1);
  w.expand = carve_problems(c, p2);
  w.alpha = carve(c, p2 * sizeof(float));
  w.alpha_ptrs = carve(c, p2 * sizeof(float*));
  w.seg_rank = carve(c, p2 * sizeof(int));
  w.partial = carve(c, size_t(split_k) * size_t(num_tokens) * size_t(r_max) * sizeof(float));
  w.v = carve(c, size_t(num_tokens) * size_t(r_max) * 2);
  w.slot_scale = carve(c, kMaxSlots * (sizeof(float) + sizeof(int)));
  w.scratch_bytes = sm90_scratch_bytes(num_segments, split_k, dtype);
  w.scratch = carve(c, w.scratch_bytes);
  w.total = (c + 255) & ~size_t(255);
  return w;
}

// ---------------------------------------------------------------------------------------------
// Prep: one thread per segment writes its split_k shrink problems and its expand problem.
// ---------------------------------------------------------------------------------------------

struct PrepParams {
  const int32_t* seg_indptr;
  const int32_t* seg_slot;
  int num_segments, n_slots, split_k, k_chunk, d_in, d_out, r_max, elem_bytes;
  int64_t ld_x, ld_y, num_tokens;
  const char* x; const char* lora_a; const char* lora_b; char* y;
  char* ws;
  float* slot_scale;  // non-null: also write the Triton expand's slot scales and padded ranks (as launch_slot_scale)
  WorkspaceLayout w;
};

namespace {
// One direction's problem arrays (ProblemArrays), typed, in the workspace.
struct Problems {
  cutlass::gemm::GemmCoord* size;
  const char** a;
  const char** b;
  char** c;
  int64_t* ld_ab;
  int64_t* ld_c;
};

__device__ inline Problems problems_at(char* ws, ProblemArrays const& o) {
  return Problems{reinterpret_cast<cutlass::gemm::GemmCoord*>(ws + o.problems), reinterpret_cast<const char**>(ws + o.ptr_a),
                  reinterpret_cast<const char**>(ws + o.ptr_b), reinterpret_cast<char**>(ws + o.ptr_c),
                  reinterpret_cast<int64_t*>(ws + o.ld_ab), reinterpret_cast<int64_t*>(ws + o.ld_c)};
}
}  // namespace

__global__ void prep_kernel(PrepParams p, SlotTable slots) {
  using cutlass::gemm::GemmCoord;
  const Problems sh = problems_at(p.ws, p.w.shrink), ex = problems_at(p.ws, p.w.expand);
  auto* alpha = reinterpret_cast<float*>(p.ws + p.w.alpha);
  auto** alpha_ptrs = reinterpret_cast<const float**>(p.ws + p.w.alpha_ptrs);
  auto* seg_rank = reinterpret_cast<int*>(p.ws + p.w.seg_rank);
  auto* partial = reinterpret_cast<char*>(p.ws + p.w.partial);
  auto* v = reinterpret_cast<char*>(p.ws + p.w.v);
  const int64_t eb_ = p.elem_bytes;
  if (p.slot_scale != nullptr && blockIdx.x == 0)
    for (int s = threadIdx.x; s < kMaxSlots; s += blockDim.x) write_slot_scale(slots, p.slot_scale, s);

  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.num_segments; i += gridDim.x * blockDim.x) {
    int lo = p.seg_indptr[i], hi = p.seg_indptr[i + 1];
    int slot = p.seg_slot[i];
    int rp = (slot >= 0 && slot < p.n_slots) ? slots.rank_padded[slot] : 0;
    int m = (rp > 0 && hi > lo) ? hi - lo : 0;
    if (m == 0) rp = 0;
    int s_safe = rp > 0 ? slot : 0;
    seg_rank[i] = rp;
    for (int k = 0; k < p.split_k; ++k) {
      int j = i * p.split_k + k;
      int k0 = k * p.k_chunk;
      int kk = min(p.k_chunk, p.d_in - k0);
      sh.size[j] = GemmCoord(m, rp, kk > 0 ? kk : 0);
      if (kk <= 0) sh.size[j] = GemmCoord(0, 0, 0);
      sh.a[j] = p.x + (int64_t(lo) * p.ld_x + k0) * eb_;
      sh.b[j] = p.lora_a + (int64_t(s_safe) * p.r_max * p.d_in + k0) * eb_;
      sh.c[j] = partial + (int64_t(k) * p.num_tokens + lo) * p.r_max * int64_t(sizeof(float));
      sh.ld_ab[j] = p.d_in;
      sh.ld_c[j] = p.r_max;
    }
    ex.size[i] = GemmCoord(m, m > 0 ? p.d_out : 0, rp);
    ex.a[i] = v + int64_t(lo) * p.r_max * eb_;
    ex.b[i] = p.lora_b + int64_t(s_safe) * p.d_out * p.r_max * eb_;
    ex.c[i] = p.y + int64_t(lo) * p.ld_y * eb_;
    ex.ld_ab[i] = p.r_max;
    ex.ld_c[i] = p.ld_y;
    alpha[i] = rp > 0 ? slots.scale[slot] : 0.0f;
    alpha_ptrs[i] = alpha + i;
  }
}

// Note on the shrink's B stride: lora_a[slot] is [r_max, d_in] row-major, read as column-major
// [K=d_in, N=r] with leading dimension d_in; A (x) has leading dimension ld_x. sld_ab carries d_in
// for B, so x must have ld_x == d_in for the shared stride array; forward() checks it.

cudaError_t launch_prep(ForwardArgs const& a, WorkspaceLayout const& w, SlotTable const& slots, int k_chunk, int splits_used,
                        float* slot_scale, cudaStream_t stream) {
  PrepParams p{};
  p.slot_scale = slot_scale;
  p.seg_indptr = a.seg_indptr;
  p.seg_slot = a.seg_slot;
  p.num_segments = a.num_segments;
  p.n_slots = int(a.ranks.size());
  p.split_k = splits_used;
  p.k_chunk = k_chunk;
  p.d_in = a.d_in;
  p.d_out = a.d_out;
  p.r_max = a.r_max;
  p.elem_bytes = 2;
  p.ld_x = a.ld_x;
  p.ld_y = a.ld_y;
  p.num_tokens = a.num_tokens;
  p.x = static_cast<const char*>(a.x);
  p.lora_a = static_cast<const char*>(a.lora_a);
  p.lora_b = static_cast<const char*>(a.lora_b);
  p.y = static_cast<char*>(a.y);
  p.ws = static_cast<char*>(a.workspace);
  p.w = w;
  int threads = 128;
  int blocks = std::max(1, std::min(64, (a.num_segments + threads - 1) / threads));
  prep_kernel<<<blocks, threads, 0, stream>>>(p, slots);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// Reduce: v[t, c] = sum_k partial[k, t, c] for c < the padded rank of t's segment.
// ---------------------------------------------------------------------------------------------
using detail::from_f;  // atmm/convert.cuh

template <typename T>
__global__ void reduce_kernel(const int32_t* __restrict__ seg_indptr, const int* __restrict__ seg_rank,
                              int num_segments, const float* __restrict__ partial, T* __restrict__ v,
                              int64_t num_tokens, int r_max, int split_k) {
  const int groups = r_max / 8;
  const int64_t total = num_tokens * groups;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += int64_t(gridDim.x) * blockDim.x) {
    int64_t t = idx / groups;
    int c = int(idx - t * groups) * 8;
    // Segment of row t: the last i with seg_indptr[i] <= t (empty segments are skipped over).
    int lo = 0, hi = num_segments;  // answer in [lo, hi)
    while (hi - lo > 1) {
      int mid = (lo + hi) >> 1;
      if (seg_indptr[mid] <= t) lo = mid; else hi = mid;
    }
    if (c >= seg_rank[lo]) continue;
    float acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int k = 0; k < split_k; ++k) {
      const float4* src = reinterpret_cast<const float4*>(partial + (int64_t(k) * num_tokens + t) * r_max + c);
      float4 u = src[0], w = src[1];
      acc[0] += u.x; acc[1] += u.y; acc[2] += u.z; acc[3] += u.w;
      acc[4] += w.x; acc[5] += w.y; acc[6] += w.z; acc[7] += w.w;
    }
    alignas(16) T out[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] = from_f<T>(acc[e]);
    *reinterpret_cast<uint4*>(v + t * r_max + c) = *reinterpret_cast<uint4*>(out);
  }
}

cudaError_t launch_reduce(ForwardArgs const& a, WorkspaceLayout const& w, int splits_used, cudaStream_t stream) {
  char* ws = static_cast<char*>(a.workspace);
  int64_t total = a.num_tokens * (a.r_max / 8);
  if (total == 0) return cudaSuccess;
  int threads = 256;
  int64_t want = (total + threads - 1) / threads;
  int blocks = int(std::min<int64_t>(want, int64_t(sm_count()) * 8));
  const auto* indptr = a.seg_indptr;
  const auto* seg_rank = reinterpret_cast<const int*>(ws + w.seg_rank);
  const auto* partial = reinterpret_cast<const float*>(ws + w.partial);
  if (a.dtype == DType::kF16)
    reduce_kernel<__half><<<blocks, threads, 0, stream>>>(indptr, seg_rank, a.num_segments, partial,
                                                          reinterpret_cast<__half*>(ws + w.v), a.num_tokens, a.r_max, splits_used);
  else
    reduce_kernel<__nv_bfloat16><<<blocks, threads, 0, stream>>>(indptr, seg_rank, a.num_segments, partial,
                                                                 reinterpret_cast<__nv_bfloat16*>(ws + w.v), a.num_tokens, a.r_max, splits_used);
  return cudaGetLastError();
}

// ---------------------------------------------------------------------------------------------
// forward
// ---------------------------------------------------------------------------------------------
namespace {
std::string shape_of(ForwardArgs const& a) {
  std::ostringstream s;
  s << "dtype=" << dtype_name(a.dtype) << " T=" << a.num_tokens << " d_in=" << a.d_in << " d_out=" << a.d_out
    << " r_max=" << a.r_max << " segments=" << a.num_segments;
  return s.str();
}
}  // namespace

std::string forward(ForwardArgs const& a, cudaStream_t stream) { return forward_phases(a, kPhaseAll, stream); }

std::string forward_phases(ForwardArgs const& a, int phases, cudaStream_t stream) {
  const auto& cfgs = kernel_configs();
  if (a.num_segments <= 0 || a.num_tokens <= 0) return "";
  if (a.d_in % kAlignment || a.d_out % kAlignment || a.r_max % kAlignment || a.ld_y % kAlignment || a.ld_x != a.d_in)
    return "atmm: unsupported layout (widths, r_max and ld_y must be multiples of 8; x contiguous): " + shape_of(a);
  if (int(a.ranks.size()) > kMaxSlots || a.ranks.size() != a.scales.size())
    return "atmm: ranks and scales must have equal length <= 256: " + shape_of(a);
  for (int r : a.ranks)
    if (r < 0 || r > a.r_max) return "atmm: a rank is outside [0, r_max]: " + shape_of(a);
  if (a.shrink_config < 0 || a.shrink_config >= int(cfgs.size()) || a.expand_config < 0 || a.expand_config >= int(cfgs.size()))
    return "atmm: config index out of range: " + shape_of(a);
  const KernelConfig& cs = cfgs[a.shrink_config];
  const KernelConfig& ce = cfgs[a.expand_config];
  if (!cs.serves(Direction::kShrink, a.dtype)) return std::string("atmm: config ") + cs.name + " is not built for shrink: " + shape_of(a);
  if (!ce.serves(Direction::kExpand, a.dtype)) return std::string("atmm: config ") + ce.name + " is not built for expand: " + shape_of(a);
  if (a.split_k < 1) return "atmm: split_k must be >= 1: " + shape_of(a);
  int r_pad_max = 0;
  for (int r : a.ranks) r_pad_max = std::max(r_pad_max, (r + kAlignment - 1) / kAlignment * kAlignment);
  if (!ce.serves_rank(r_pad_max))
    return std::string("atmm: config ") + ce.name + " serves ranks up to " + std::to_string(ce.max_rank) + ": " + shape_of(a);
  if (!cs.serves_rank(r_pad_max))
    return std::string("atmm: config ") + cs.name + " serves ranks up to " + std::to_string(cs.max_rank) + ": " + shape_of(a);

  // Split d_in into chunks that are multiples of 64, so every chunk stays aligned for any tile K.
  int k_chunk = (a.d_in + a.split_k - 1) / a.split_k;
  k_chunk = (k_chunk + 63) / 64 * 64;
  int splits_used = (a.d_in + k_chunk - 1) / k_chunk;
  WorkspaceLayout w = workspace_layout(a.num_segments, a.split_k, a.num_tokens, a.r_max, a.dtype);
  if (a.workspace_bytes < w.total) return "atmm: workspace too small: " + shape_of(a);
  // The CUTLASS kernels, 2.x and 3.x, read the prep kernel's problem arrays.
  const bool cutlass_shrink = cs.kind == Kind::kCutlass || cs.kind == Kind::kSm90;
  const bool cutlass_expand = ce.kind == Kind::kCutlass || ce.kind == Kind::kSm90;
  // The stream and Triton shrinks write v themselves when d_in is not split; every other shrink writes partials.
  const bool v_ready = (cs.kind == Kind::kStreamShrink || cs.kind == Kind::kTritonShrink) && splits_used == 1;
  // A Triton shrink that splits d_in adds its chunks into one fp32 partial (zeroed first in the shrink phase):
  // the expand then reads one partial, not splits_used of them (csrc/atmm/NOTES.md, split shrink adding in place).
  const bool sum_in_place = cs.kind == Kind::kTritonShrink && splits_used > 1;
  char* ws = static_cast<char*>(a.workspace);

  FusedArgs fa{};
  fa.seg_indptr = a.seg_indptr;
  fa.seg_slot = a.seg_slot;
  fa.num_segments = a.num_segments;
  for (size_t s = 0; s < a.ranks.size(); ++s) {
    fa.slots.rank_padded[s] = (a.ranks[s] + kAlignment - 1) / kAlignment * kAlignment;
    fa.slots.scale[s] = a.scales[s];
  }
  fa.x = a.x; fa.lora_a = a.lora_a; fa.lora_b = a.lora_b; fa.y = a.y;
  fa.partial = reinterpret_cast<float*>(ws + w.partial);
  fa.v = ws + w.v;
  fa.slot_scale = reinterpret_cast<float*>(ws + w.slot_scale);
  fa.v_ready = v_ready ? 1 : 0;
  // The expand may start while the shrink of this same call runs (it waits before reading v):
  // programmatic dependent launch, Hopper and later.
  fa.pdl = (a.pdl && (phases & kPhaseShrink) && device_cc_major() >= 9) ? 1 : 0;
  fa.splits = splits_used; fa.k_chunk = k_chunk;
  fa.num_tokens = a.num_tokens; fa.d_in = a.d_in; fa.d_out = a.d_out; fa.r_max = a.r_max;
  fa.ld_x = a.ld_x; fa.ld_y = a.ld_y;

  cudaError_t e = cudaSuccess;
  // prep: the problem arrays of whichever direction runs on CUTLASS (and the reduce's ranks).
  const bool prep_launched = (phases & kPhasePrep) && (cutlass_shrink || cutlass_expand);
  // A Triton expand's slot scales come from the same kernel when it runs.
  float* prep_slot_scale = ce.kind == Kind::kTritonExpand ? fa.slot_scale : nullptr;
  if (prep_launched) e = launch_prep(a, w, fa.slots, k_chunk, splits_used, prep_slot_scale, stream);
  if (e != cudaSuccess) return std::string("atmm: prep kernel: ") + cudaGetErrorString(e) + ": " + shape_of(a);
#if ATMM_HAVE_TRITON
  // The Triton expands read slot scales and ranks from the workspace. Written here, before the shrink, an
  // expand launched as the shrink's programmatic dependent may read them before it waits. A Triton shrink
  // right after this kernel starts as its programmatic dependent: it finds its row tile meanwhile and
  // waits for this kernel before it lets the expand start (triton_lora.py), which hides most of this launch.
  if ((phases & kPhasePrep) && ce.kind == Kind::kTritonExpand) {
    if (prep_launched) {
      fa.slot_scale_ready = 1;  // written by the prep kernel itself
    } else if (sum_in_place && (phases & kPhaseShrink)) {
      // written by the kernel that zeroes the partial, just before the shrink (below)
    } else {
      e = launch_slot_scale(fa, stream);
      if (e != cudaSuccess) return std::string("atmm: slot-scale kernel: ") + cudaGetErrorString(e) + ": " + shape_of(a);
      fa.slot_scale_ready = 1;
      fa.shrink_pdl = (fa.pdl && cs.kind == Kind::kTritonShrink) ? 1 : 0;
    }
  }
#endif

  auto tiles = [&](int tb_m, int tb_n, int n, int groups) -> int {
    int64_t t = (a.num_tokens / tb_m + a.num_segments) * int64_t((n + tb_n - 1) / tb_n) * groups;
    return int(std::min<int64_t>(t, 1 << 30));
  };
  // One direction's CUTLASS grouped GEMM over the prep kernel's problem arrays (A and B share one stride array).
  auto grouped = [&](ProblemArrays const& o, int count, int tile_bound, float const* const* alpha_ptrs, float beta) {
    return GroupedLaunch{ws + o.problems, count, tile_bound, reinterpret_cast<void**>(ws + o.ptr_a),
                         reinterpret_cast<void**>(ws + o.ptr_b), reinterpret_cast<void**>(ws + o.ptr_c),
                         reinterpret_cast<int64_t*>(ws + o.ld_ab), reinterpret_cast<int64_t*>(ws + o.ld_ab),
                         reinterpret_cast<int64_t*>(ws + o.ld_c), alpha_ptrs, beta, ws + w.scratch, w.scratch_bytes};
  };
  if (phases & kPhaseShrink) {
#if ATMM_HAVE_TRITON
    if (sum_in_place) {  // zero the partial the shrink adds into; the shrink starts as this kernel's dependent
      const bool scales = (phases & kPhasePrep) && ce.kind == Kind::kTritonExpand && !prep_launched;
      e = launch_zero_partial(fa, scales, stream);
      if (e != cudaSuccess) return std::string("atmm: zeroing the partial: ") + cudaGetErrorString(e) + ": " + shape_of(a);
      if (scales) fa.slot_scale_ready = 1;
      fa.shrink_pdl = fa.pdl;
    }
#endif
    if (cutlass_shrink) {
      e = cs.fn(Direction::kShrink, a.dtype)(
          grouped(w.shrink, a.num_segments * splits_used, tiles(cs.tb_m, cs.tb_n, r_pad_max, splits_used), nullptr, 0.0f),
          stream);
    } else {
      e = (a.dtype == DType::kF16 ? cs.fused_f16 : cs.fused_bf16)(fa, stream);
    }
    if (e != cudaSuccess) return std::string("atmm: shrink ") + cs.name + ": " + cudaGetErrorString(e) + ": " + shape_of(a);
  }
  if (phases & kPhaseExpand) {
    if (sum_in_place) fa.splits = 1;  // the expand reads the one partial the shrink added into
    if (cutlass_expand) {
      if (!v_ready) e = launch_reduce(a, w, fa.splits, stream);
      if (e != cudaSuccess) return std::string("atmm: reduce: ") + cudaGetErrorString(e) + ": " + shape_of(a);
      e = ce.fn(Direction::kExpand, a.dtype)(
          grouped(w.expand, a.num_segments, tiles(ce.tb_m, ce.tb_n, a.d_out, 1),
                  reinterpret_cast<float const* const*>(ws + w.alpha_ptrs), 1.0f),
          stream);
    } else {
      e = (a.dtype == DType::kF16 ? ce.fused_f16 : ce.fused_bf16)(fa, stream);
    }
    if (e != cudaSuccess) return std::string("atmm: expand ") + ce.name + ": " + cudaGetErrorString(e) + ": " + shape_of(a);
  }
  return "";
}

}  // namespace atmm
