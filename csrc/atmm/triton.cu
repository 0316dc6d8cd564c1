// The Triton ATMM kernels (triton_lora.py): cubins compiled at build time by triton_aot.py, loaded
// here with the driver API (one module per device, on first use) and launched on the caller's stream
// with the FusedArgs contract of the hand-written kinds. Triton is not needed at run time. The expands
// run as the shrink's programmatic dependents when the call asks for PDL and its prep phase wrote the
// slot scales; a Triton shrink then runs as the slot-scale kernel's dependent too (it finds its row tile,
// then waits for that grid before it lets the expand start, so the expand reads the scales complete).
// Every config has two cubins: EVEN (no column masks) is launched when the call's widths are whole tiles
// of the config and its r_max is the config's rank, the other for every other shape.
// Built only when CMake found the triton package (ATMM_HAVE_TRITON); otherwise this file is empty and
// the tr_* lines of tile_configs.def name nothing.
#include "atmm/atmm.h"
#include "atmm/fused.cuh"

#if ATMM_HAVE_TRITON
#include <cuda.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>

namespace atmm {
namespace {

struct TritonCubin {
  const char* config;
  DType dtype;
  int cc;  // compute capability the cubin was built for (90: sm_90a)
  int even;  // 1: the variant without column masks (whole tiles, r_max == the config's rank)
  const char* entry;
  int shared;  // dynamic shared memory of one block, bytes
  int warps;
  const unsigned char* data;
};
#include "atmm_triton_cubins.inc"

constexpr int kMaxDevices = 64;

// One cubin's loaded function per device (a config has one per dtype and EVEN); filled on first use, read
// without a lock afterwards.
struct TritonFn {
  std::atomic<CUfunction> f[kMaxDevices];
  std::atomic<int> cubin[kMaxDevices];
};

cudaError_t from_driver(CUresult r) {
  switch (r) {
    case CUDA_SUCCESS: return cudaSuccess;
    case CUDA_ERROR_OUT_OF_MEMORY: return cudaErrorMemoryAllocation;
    case CUDA_ERROR_INVALID_VALUE: return cudaErrorInvalidValue;
    case CUDA_ERROR_NO_BINARY_FOR_GPU: return cudaErrorNoKernelImageForDevice;
    case CUDA_ERROR_INVALID_IMAGE: return cudaErrorInvalidKernelImage;
    case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: return cudaErrorLaunchOutOfResources;
    default: return cudaErrorLaunchFailure;
  }
}

// The config's function on the current device, loading its module the first time.
cudaError_t function_for(TritonFn& fn, const char* config, DType dtype, int even, CUfunction* out, int* cubin_index) {
  int dev = 0;
  cudaGetDevice(&dev);
  dev &= kMaxDevices - 1;
  CUfunction f = fn.f[dev].load(std::memory_order_acquire);
  if (f != nullptr) {
    *out = f;
    *cubin_index = fn.cubin[dev].load(std::memory_order_relaxed);
    return cudaSuccess;
  }
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  f = fn.f[dev].load(std::memory_order_acquire);
  if (f == nullptr) {
    const int cc = device_cc();
    int idx = -1;
    for (size_t i = 0; i < sizeof(kTritonCubins) / sizeof(kTritonCubins[0]); ++i)
      if (kTritonCubins[i].dtype == dtype && kTritonCubins[i].cc == cc && kTritonCubins[i].even == even &&
          std::strcmp(kTritonCubins[i].config, config) == 0)
        idx = int(i);
    if (idx < 0) return cudaErrorNoKernelImageForDevice;  // not built for this GPU's architecture
    // Loading a module is no stream operation; allow it while a graph is being captured (relaxed mode),
    // as the first call of a shape may come inside the engine's capture.
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    cudaThreadExchangeStreamCaptureMode(&mode);
    CUcontext ctx = nullptr;
    CUresult r = cuCtxGetCurrent(&ctx);
    if (r == CUDA_SUCCESS && ctx == nullptr) {  // the runtime has not made the primary context current yet
      cudaSetDevice(dev);
      r = cuCtxGetCurrent(&ctx);
    }
    CUmodule mod = nullptr;
    if (r == CUDA_SUCCESS) r = cuModuleLoadData(&mod, kTritonCubins[idx].data);
    if (r == CUDA_SUCCESS) r = cuModuleGetFunction(&f, mod, kTritonCubins[idx].entry);
    if (r == CUDA_SUCCESS && kTritonCubins[idx].shared > 48 * 1024)
      r = cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, kTritonCubins[idx].shared);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (r != CUDA_SUCCESS) return from_driver(r);
    fn.cubin[dev].store(idx, std::memory_order_relaxed);
    fn.f[dev].store(f, std::memory_order_release);
  }
  *out = f;
  *cubin_index = fn.cubin[dev].load(std::memory_order_relaxed);
  return cudaSuccess;
}

// fns: the config's loaded functions of one dtype, [even]. pdl: launch as a programmatic dependent of the
// kernel before it on the stream (the kernel waits with griddepcontrol.wait before it reads what that kernel writes).
cudaError_t launch(TritonFn* fns, const char* config, DType dtype, bool even, unsigned gx, unsigned gy, void** params,
                   cudaStream_t s, bool pdl = false) {
  CUfunction f = nullptr;
  int idx = 0;
  cudaError_t e = function_for(fns[even], config, dtype, int(even), &f, &idx);
  if (e != cudaSuccess) return e;
  if (gx == 0 || gy == 0) return cudaSuccess;
  const TritonCubin& c = kTritonCubins[idx];
  if (!pdl)
    return from_driver(cuLaunchKernel(f, gx, gy, 1, 32 * c.warps, 1, 1, c.shared, reinterpret_cast<CUstream>(s), params, nullptr));
  CUlaunchAttribute attr{};
  attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
  attr.value.programmaticStreamSerializationAllowed = 1;
  CUlaunchConfig cfg{};
  cfg.gridDimX = gx; cfg.gridDimY = gy; cfg.gridDimZ = 1;
  cfg.blockDimX = 32 * c.warps; cfg.blockDimY = 1; cfg.blockDimZ = 1;
  cfg.sharedMemBytes = c.shared;
  cfg.hStream = reinterpret_cast<CUstream>(s);
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return from_driver(cuLaunchKernelEx(&cfg, f, params, nullptr));
}

// The one kernel before a Triton shrink: with `out` set, the slot scales and padded ranks the expands read from
// the workspace (write_slot_scale, fused.cuh); it also zeroes n4 float4 of partial[0] (grid-stride), which a
// split Triton shrink adds into. A shrink launched as its programmatic dependent may start at once.
__global__ void triton_prep_kernel(SlotTable t, float* out, float4* partial, int64_t n4) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");  // the shrink waits for this grid before it needs it
#endif
  if (out != nullptr && blockIdx.x == 0)
    for (int s = threadIdx.x; s < kMaxSlots; s += blockDim.x) write_slot_scale(t, out, s);
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n4; i += int64_t(gridDim.x) * blockDim.x)
    partial[i] = make_float4(0.f, 0.f, 0.f, 0.f);
}

unsigned row_tiles(FusedArgs const& a, int bm) {
  return unsigned(std::min<int64_t>((a.num_tokens + bm - 1) / bm + a.num_segments, int64_t(1) << 30));
}

cudaError_t triton_shrink(TritonFn* fns, const char* config, DType dtype, int bm, int bk, int r, FusedArgs const& a,
                          cudaStream_t s) {
  const bool even = a.d_in % bk == 0 && a.k_chunk % bk == 0 && a.r_max == r;
  const void* x = a.x;
  const void* lora_a = a.lora_a;
  void* v = a.v;
  float* partial = a.partial;
  const int32_t* indptr = a.seg_indptr;
  const int32_t* slot = a.seg_slot;
  int32_t num_segments = a.num_segments, num_tokens = int32_t(a.num_tokens), d_in = a.d_in, r_max = a.r_max,
          k_chunk = a.k_chunk, splits = a.splits;
  void* scratch = nullptr;
  void* profile = nullptr;
  void* params[] = {&x, &lora_a, &v, &partial, &indptr, &slot, &num_segments, &num_tokens, &d_in, &r_max, &k_chunk, &splits,
                    &scratch, &profile};
  return launch(fns, config, dtype, even, row_tiles(a, bm), unsigned(a.splits), params, s, a.shrink_pdl != 0);
}

// Both expands: the slot scales first unless the prep phase wrote them before the shrink; only then may the
// expand start as the shrink's programmatic dependent (it reads the scales before it waits). even: d_out
// is whole column blocks of the config (checked by the caller) and r_max its rank.
cudaError_t triton_expand_launch(TritonFn* fns, const char* config, DType dtype, bool even, unsigned gx, unsigned gy,
                                 FusedArgs const& a, cudaStream_t s) {
  if (!a.slot_scale_ready) {
    cudaError_t e = launch_slot_scale(a, s);
    if (e != cudaSuccess) return e;
  }
  void* y = a.y;
  const void* v = a.v;
  const float* partial = a.partial;
  const void* lora_b = a.lora_b;
  const float* scale = a.slot_scale;
  const int32_t* rank = reinterpret_cast<const int32_t*>(a.slot_scale + kMaxSlots);
  const int32_t* indptr = a.seg_indptr;
  const int32_t* slot = a.seg_slot;
  // splits 0: v itself, written by the shrink; else the fp32 partials of that many d_in chunks (also one).
  int32_t num_segments = a.num_segments, num_tokens = int32_t(a.num_tokens), d_out = a.d_out, r_max = a.r_max,
          ld_y = int32_t(a.ld_y), splits = a.v_ready ? 0 : a.splits;
  void* scratch = nullptr;
  void* profile = nullptr;
  void* params[] = {&y, &v, &partial, &lora_b, &scale, &rank, &indptr, &slot, &num_segments, &num_tokens, &d_out, &r_max, &ld_y,
                    &splits, &scratch, &profile};
  return launch(fns, config, dtype, even, gx, gy, params, s, a.pdl && a.slot_scale_ready);
}

// lora_expand: (row tiles) x (column chunks of ch).
cudaError_t triton_expand(TritonFn* fns, const char* config, DType dtype, int bm, int ch, int r, FusedArgs const& a,
                          cudaStream_t s) {
  const bool even = a.d_out % ch == 0 && a.r_max == r;
  return triton_expand_launch(fns, config, dtype, even, row_tiles(a, bm), unsigned((a.d_out + ch - 1) / ch), a, s);
}

// lora_expand_cols: (column tiles of bn) x (runs of rows), about `waves` blocks per SM in all, and no more
// runs than row tiles.
cudaError_t triton_expand_cols(TritonFn* fns, const char* config, DType dtype, int bm, int bn, int r, int waves,
                               FusedArgs const& a, cudaStream_t s) {
  const int64_t cols = (a.d_out + bn - 1) / bn;
  const int64_t tiles = (a.num_tokens + bm - 1) / bm;
  const int64_t runs = std::max<int64_t>(1, std::min<int64_t>(tiles, (int64_t(waves) * sm_count() + cols / 2) / cols));
  return triton_expand_launch(fns, config, dtype, a.d_out % bn == 0 && a.r_max == r, unsigned(cols), unsigned(runs), a, s);
}

size_t triton_smem(const char* config) {
  size_t m = 0;
  for (const TritonCubin& c : kTritonCubins)
    if (std::strcmp(c.config, config) == 0) m = std::max(m, size_t(c.shared));
  return m;
}

}  // namespace

cudaError_t launch_slot_scale(FusedArgs const& a, cudaStream_t stream) {
  triton_prep_kernel<<<1, kMaxSlots, 0, stream>>>(a.slots, a.slot_scale, nullptr, 0);
  return cudaGetLastError();
}

cudaError_t launch_zero_partial(FusedArgs const& a, bool scales, cudaStream_t stream) {
  const int64_t n4 = a.num_tokens * a.r_max / 4;  // r_max is a multiple of 8
  const int threads = 256;
  const int blocks = int(std::max<int64_t>(1, std::min<int64_t>((n4 + 4 * threads - 1) / (4 * threads), 2 * sm_count())));
  triton_prep_kernel<<<blocks, threads, 0, stream>>>(a.slots, scales ? a.slot_scale : nullptr,
                                                      reinterpret_cast<float4*>(a.partial), n4);
  return cudaGetLastError();
}

// One loaded-function cache per (config, dtype, EVEN); the entry points atmm.cu's registry names, each
// LAUNCH(that dtype's functions, "NAME", dtype, the family's arguments..., a, s); the config's shared memory.
#define ATMM_TRITON_ENTRIES(NAME, LAUNCH, ...)                                                                 \
  static TritonFn triton_fn_##NAME[2][2];                                                                       \
  cudaError_t atmm_fused_##NAME##_f16(FusedArgs const& a, cudaStream_t s) {                                    \
    return LAUNCH(triton_fn_##NAME[0], #NAME, DType::kF16, __VA_ARGS__, a, s);                                  \
  }                                                                                                             \
  cudaError_t atmm_fused_##NAME##_bf16(FusedArgs const& a, cudaStream_t s) {                                   \
    return LAUNCH(triton_fn_##NAME[1], #NAME, DType::kBF16, __VA_ARGS__, a, s);                                 \
  }                                                                                                             \
  size_t atmm_fused_##NAME##_smem() { return triton_smem(#NAME); }
#define ATMM_TRITON_SHRINK(NAME, BM, BK, R, W, S) ATMM_TRITON_ENTRIES(NAME, triton_shrink, BM, BK, R)
#define ATMM_TRITON_EXPAND(NAME, BM, BN, R, CH, W, S) ATMM_TRITON_ENTRIES(NAME, triton_expand, BM, CH, R)
#define ATMM_TRITON_EXPAND_COLS(NAME, BM, BN, R, W, S, WAVES) \
  ATMM_TRITON_ENTRIES(NAME, triton_expand_cols, BM, BN, R, WAVES)
#include "atmm/tile_configs.def"
#include "atmm/tile_configs_undef.h"
#undef ATMM_TRITON_ENTRIES

}  // namespace atmm
#endif  // ATMM_HAVE_TRITON
