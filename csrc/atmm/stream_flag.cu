// The flag call (fl_*): a whole ATMM call, shrink and expand, in ONE launch and without clusters.
// Instantiations named in tile_configs.def (ATMM_FLAG_CALL lines).
//
// Why: a short call costs two kernel launches in a row (PDL hides only part of the second), and a
// long one pays the shrink's tail plus the expand's ramp. The fused call of stream_call.cu removed
// the second launch but bound a row tile to one cluster (8 SMs at most), which cannot pull the
// adapters' weights fast. Here the two phases are work items of one persistent grid and hand v over
// through global memory, row tile by row tile:
//   - items are numbered shrink first, (row tile, chunk of d_in), then expand, (row tile, range of
//     column chunks); block b takes items b, b + G, b + 2G, ... (G = the grid, at most what is resident);
//   - a shrink item runs the stream shrink's main loop (stream.cuh), writes v (d_in not split) or its
//     fp32 partial, and publishes it: a barrier, then one release-add on its row tile's counter;
//   - an expand item prefetches its first y and lora_B chunks (they do not depend on v), waits until
//     its row tile's counter reaches the number of d_in chunks (acquire), then runs the stream
//     expand's update loop (stream.cuh), summing the partials into v as it loads them.
// No deadlock: every block is resident at once, and a block meets its first expand item only after
// all of its shrink items, so a shrink item is never queued behind a waiting one. The last expand
// item of a row tile to have read v (a second counter) resets both counters, so the next call (or
// graph replay) starts from zero with no memset node and no grid-wide step. The counters live in a
// small per-device buffer of the extension (zeroed once), not in the caller's workspace: calls on one
// device must not run concurrently from two streams (the workspace already asks the same).
#include <mutex>

#include "atmm/stream.cuh"

namespace atmm {
namespace detail {

constexpr int kFlagMaxRowTiles = 1 << 20;  // row tiles one call may have: two int counters each (8 MB per device)

__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_gpu_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}

template <typename T, int BM, int KMAX, int SWM, int SWN, int SS, int BN, int EWM, int EWN, int ES>
struct FlagCfg {
  using Shrink = ShrinkTile<T, BM, 64, SWM, SWN, KMAX, SS>;
  using Update = UpdateOps<T, BM, BN, EWM, EWN, KMAX, ES, false>;
  static constexpr int kThreads = 32 * SWM * SWN;
  static_assert(kThreads == 32 * EWM * EWN, "the shrink and the expand items of a flag call run on the same block size");
  static constexpr size_t kSmem = Shrink::C::kSmem > Update::C::kSmem ? Shrink::C::kSmem : Update::C::kSmem;
  static_assert(kSmem <= 227 * 1024, "a flag call's block must fit an SM");
};

template <typename T, int BM, int KMAX, int SWM, int SWN, int SS, int BN, int EWM, int EWN, int ES>
__global__ void __launch_bounds__(32 * SWM * SWN) flag_call_kernel(FusedArgs a, int* state, int row_tiles, int col_splits) {
  using Cfg = FlagCfg<T, BM, KMAX, SWM, SWN, SS, BN, EWM, EWN, ES>;
  using Shrink = typename Cfg::Shrink;
  using Update = typename Cfg::Update;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  int* ready = state;                       // per row tile: d_in chunks published
  int* readers = state + kFlagMaxRowTiles;  // per row tile: expand items done reading v
  const int n_shrink = row_tiles * a.splits;
  const int items = row_tiles * (a.splits + col_splits);
  const int chunks = (a.d_out + BN - 1) / BN, per = (chunks + col_splits - 1) / col_splits;
  const int n_readers = (chunks + per - 1) / per;  // expand items of a row tile with columns to do

  for (int item = blockIdx.x; item < items; item += gridDim.x) {
    __syncthreads();  // the previous item is done with shared memory
    const bool is_shrink = item < n_shrink;
    const int rt = is_shrink ? item / a.splits : (item - n_shrink) / col_splits;
    int seg, tile;
    find_tile<BM, Cfg::kThreads>(a, rt, seg, tile);
    if (seg < 0) continue;  // an index past the call's row tiles: no item of it publishes or waits

    if (is_shrink) {
      shrink_unit<Shrink>(a, smem, seg, tile, item % a.splits);
      // Publish: the barrier orders every thread's stores before thread 0's release (cumulative at
      // gpu scope), as in CUTLASS's generic barrier; no separate fence.
      __syncthreads();
      if (threadIdx.x == 0) red_release_gpu_add(ready + rt, 1);
      continue;
    }
    const int cp = (item - n_shrink) % col_splits;
    const int c_begin = min(chunks, cp * per), c_end = min(chunks, c_begin + per);
    if (c_begin >= c_end) continue;  // not one of the n_readers
    const UpdateTile<T> t = expand_tile<T, BM>(a, seg, tile);  // v itself when a.v_ready (d_in not split)
    Update::prefetch(smem, t, c_begin, c_end);  // y and lora_B do not depend on v
    if (threadIdx.x == 0) {
      // Bounded wait: a row tile's shrink items take microseconds; a counter that never fills means a
      // broken invariant (a second stream using the same device state, say): after ~2^22 polls (seconds)
      // trap, which fails the call with a CUDA error, rather than hang the GPU.
      int spins = 0;
      while (ld_acquire_gpu(ready + rt) < a.splits) {
        __nanosleep(32);
        if (++spins > (1 << 22)) __trap();
      }
    }
    __syncthreads();
    Update::load_v(smem, t);  // L2 loads (ld.cg): v and the partials were written by other SMs
    __syncthreads();
    // Done reading v: count this reader; the answer is only needed after the update loop, so the
    // atomic's round trip overlaps it. The last reader resets the row tile's counters.
    int before = 0;
    if (threadIdx.x == 0) before = atomicAdd(readers + rt, 1);
    Update::mainloop(smem, t, c_begin, c_end);
    if (threadIdx.x == 0 && before == n_readers - 1) {
      readers[rt] = 0;
      ready[rt] = 0;
    }
  }
}

// The device's counter buffer, allocated and zeroed on first use (also inside a graph capture: the
// allocation and the zeroing run outside it, on a stream of their own, in relaxed capture mode).
inline int* flag_state(cudaError_t& err) {
  static std::mutex mu;
  static int* states[64] = {};
  int dev = 0;
  err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (states[dev & 63]) return states[dev & 63];
  const size_t bytes = size_t(2) * kFlagMaxRowTiles * sizeof(int);
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  cudaThreadExchangeStreamCaptureMode(&mode);
  int* p = nullptr;
  cudaStream_t s = nullptr;
  err = cudaMalloc(&p, bytes);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaMemsetAsync(p, 0, bytes, s);
  if (err == cudaSuccess) err = cudaStreamSynchronize(s);
  if (s) cudaStreamDestroy(s);
  cudaThreadExchangeStreamCaptureMode(&mode);
  if (err != cudaSuccess) {
    if (p) cudaFree(p);
    return nullptr;
  }
  states[dev & 63] = p;
  return p;
}

template <typename T, int BM, int KMAX, int SWM, int SWN, int SS, int BN, int EWM, int EWN, int ES>
cudaError_t flag_call(FusedArgs const& a, cudaStream_t stream) {
  using Cfg = FlagCfg<T, BM, KMAX, SWM, SWN, SS, BN, EWM, EWN, ES>;
  constexpr auto kernel = flag_call_kernel<T, BM, KMAX, SWM, SWN, SS, BN, EWM, EWN, ES>;
  if (a.splits < 1 || a.splits > 64) return cudaErrorInvalidValue;
  const int64_t row_tiles = a.num_tokens / BM + a.num_segments;  // >= the tiles of every segment together
  if (row_tiles > kFlagMaxRowTiles) return cudaErrorInvalidConfiguration;
  cudaError_t e = ensure_smem<kernel>(Cfg::kSmem);
  if (e != cudaSuccess) return e;
  int* state = flag_state(e);
  if (!state) return e;
  const int resident = sm_count() * blocks_per_sm<kernel>(Cfg::kThreads, Cfg::kSmem);
  const int cs = column_splits(row_tiles, a.d_out, BN, resident);
  const int64_t items = row_tiles * (int64_t(a.splits) + cs);
  if (items > (int64_t(1) << 31) - 1) return cudaErrorInvalidConfiguration;
  // Persistent: never more blocks than fit at once (the no-deadlock argument above needs every block resident).
  const int grid = int(std::min<int64_t>(items, resident));
  kernel<<<grid, Cfg::kThreads, Cfg::kSmem, stream>>>(a, state, int(row_tiles), cs);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace atmm

#define ATMM_FLAG_CALL(NAME, BM, KMAX, SWM, SWN, SS, BN, EWM, EWN, ES) \
  ATMM_ONE_LAUNCH_ENTRIES(NAME, flag_call, FlagCfg, BM, KMAX, SWM, SWN, SS, BN, EWM, EWN, ES)
#include "atmm/tile_configs.def"
