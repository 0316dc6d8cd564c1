// Hand-written ATMM kernels: gemv shrink and fused (reduce + expand) WMMA kernel. See fused.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <cub/block/block_scan.cuh>

#include "atmm/convert.cuh"
#include "atmm/fused.cuh"
#include "atmm/stream.cuh"

namespace atmm {
namespace {
using detail::find_tile;
using detail::seg_rank;

using detail::from_f;  // atmm/convert.cuh
using detail::to_f;

// ------------------------------------------------------------------------------------------------
// gemv shrink: block (segment i, chunk c). partial[c, t, j] = sum_{k in chunk c} x[t, k] * A[slot, j, k]
// for every row t of the segment (in groups of kRows) and j < padded rank.
// ------------------------------------------------------------------------------------------------
constexpr int kGemvThreads = 256;
constexpr int kRows = 4;
constexpr int kJ = 8;  // rank rows per warp pass

template <typename T>
__global__ void __launch_bounds__(kGemvThreads) gemv_shrink_kernel(FusedArgs a) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sx = reinterpret_cast<T*>(smem_raw);  // [kRows][k_chunk]
  detail::pdl_launch_dependents();
  const int i = blockIdx.x, c = blockIdx.y;
  const int rp = seg_rank(a, i);
  const int lo = a.seg_indptr[i], hi = a.seg_indptr[i + 1];
  if (rp == 0 || hi <= lo) return;
  const int slot = a.seg_slot[i];
  const int k0 = c * a.k_chunk;
  const int kc = min(a.k_chunk, a.d_in - k0);
  if (kc <= 0) return;
  const T* A = static_cast<const T*>(a.lora_a) + (int64_t(slot) * a.r_max) * a.d_in + k0;
  const T* X = static_cast<const T*>(a.x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nvec = kc / 8;  // 16-byte vectors per row of the chunk
  for (int r0 = lo; r0 < hi; r0 += kRows) {
    const int nr = min(kRows, hi - r0);
    __syncthreads();
    for (int v = threadIdx.x; v < kRows * nvec; v += blockDim.x) {
      int r = v / nvec, kv = v % nvec;
      uint4 val = make_uint4(0, 0, 0, 0);
      if (r < nr) val = *reinterpret_cast<const uint4*>(X + (r0 + r) * a.ld_x + k0 + kv * 8);
      *reinterpret_cast<uint4*>(sx + r * a.k_chunk + kv * 8) = val;
    }
    __syncthreads();
    // Each warp takes kJ rank rows at a time and issues all their loads before any arithmetic, so a
    // block waits for about one memory round trip per kJ rows rather than one per row.
    for (int j0 = warp * kJ; j0 < rp; j0 += (kGemvThreads / 32) * kJ) {
      float acc[kJ][kRows];
#pragma unroll
      for (int jj = 0; jj < kJ; ++jj)
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[jj][r] = 0.f;
      for (int kv = lane; kv < nvec; kv += 32) {
        uint4 av[kJ];
#pragma unroll
        for (int jj = 0; jj < kJ; ++jj)
          av[jj] = (j0 + jj < rp) ? *reinterpret_cast<const uint4*>(A + int64_t(j0 + jj) * a.d_in + kv * 8) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          uint4 xv = *reinterpret_cast<const uint4*>(sx + r * a.k_chunk + kv * 8);
          const T* xe = reinterpret_cast<const T*>(&xv);
#pragma unroll
          for (int jj = 0; jj < kJ; ++jj) {
            const T* ae = reinterpret_cast<const T*>(&av[jj]);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[jj][r] += to_f(ae[e]) * to_f(xe[e]);
          }
        }
      }
#pragma unroll
      for (int jj = 0; jj < kJ; ++jj)
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int off = 16; off > 0; off >>= 1) acc[jj][r] += __shfl_xor_sync(0xffffffffu, acc[jj][r], off);
      if (lane == 0) {
#pragma unroll
        for (int jj = 0; jj < kJ; ++jj)
          if (j0 + jj < rp)
            for (int r = 0; r < nr; ++r) a.partial[(int64_t(c) * a.num_tokens + r0 + r) * a.r_max + j0 + jj] = acc[jj][r];
      }
    }
  }
}

constexpr int kMaxK = 128;
constexpr int kKP = kMaxK + 8;  // padded smem row (elements): 16-byte skew against bank conflicts

// ------------------------------------------------------------------------------------------------
// fused expand: block (column tile, row tile over all segments' tiles).
//   v = dtype(sum_c partial[c, rows, :K]);  y[rows, cols] += scale * v @ B[slot, cols, :K]^T
// ------------------------------------------------------------------------------------------------

template <typename T, int BM, int BN, int WARPS_M, int WARPS_N>
struct FusedExpand {
  static constexpr int kThreads = 32 * WARPS_M * WARPS_N;
  static constexpr int kWarpM = BM / WARPS_M, kWarpN = BN / WARPS_N;
  static constexpr int kFragM = kWarpM / 16, kFragN = kWarpN / 16;
  static constexpr int kCP = BN + 4;  // fp32 accumulator tile row stride
  static constexpr size_t kSmemOperands = size_t(BM + BN) * kKP * sizeof(T);
  static constexpr size_t kSmemAcc = size_t(BM) * kCP * sizeof(float);
  static constexpr size_t kSmem = kSmemOperands > kSmemAcc ? kSmemOperands : kSmemAcc;
  static constexpr int kYVec = BM * BN / 8 / kThreads;  // 16-byte vectors of y per thread
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tile must be a multiple of 16");
  static_assert((BM * BN / 8) % kThreads == 0, "y tile must split evenly over threads");
};

template <typename T, int BM, int BN, int WARPS_M, int WARPS_N, int MINB>
__global__ void __launch_bounds__(32 * WARPS_M * WARPS_N, MINB) fused_expand_kernel(FusedArgs a) {
  using F = FusedExpand<T, BM, BN, WARPS_M, WARPS_N>;
  using namespace nvcuda;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sv = reinterpret_cast<T*>(smem_raw);  // [BM][kKP]
  T* sb = sv + BM * kKP;                   // [BN][kKP]
  float* sc = reinterpret_cast<float*>(smem_raw);  // [BM][kCP], after the MMA
  int seg, s_tile;
  find_tile<BM, F::kThreads>(a, blockIdx.y, seg, s_tile);
  if (seg < 0) return;
  const int slot = a.seg_slot[seg];
  const int K = a.slots.rank_padded[slot];
  const int K16 = (K + 15) / 16 * 16;
  const float alpha = a.slots.scale[slot];
  const int row0 = a.seg_indptr[seg] + s_tile * BM;
  const int rows = min(BM, a.seg_indptr[seg + 1] - row0);
  const int col0 = blockIdx.x * BN;
  T* Y = static_cast<T*>(a.y);

  // Prefetch this thread's part of the y tile: in flight while v and B are staged and multiplied.
  uint4 yv[F::kYVec];
#pragma unroll
  for (int q = 0; q < F::kYVec; ++q) {
    int v = threadIdx.x + q * F::kThreads;
    int r = v / (BN / 8), cv = v % (BN / 8);
    int col = col0 + cv * 8;
    yv[q] = make_uint4(0, 0, 0, 0);
    if (r < rows && col < a.d_out) yv[q] = *reinterpret_cast<const uint4*>(Y + (row0 + r) * a.ld_y + col);
  }

  // v tile: v itself, or the sum of the split-K partials rounded to T; zero past the rows and the
  // padded rank. Both come from the shrink: wait for it (a no-op unless launched as its dependent).
  detail::pdl_wait();
  const int kv4 = K16 / 4;
  for (int v = threadIdx.x; v < BM * kv4; v += F::kThreads) {
    int r = v / kv4, k = (v % kv4) * 4;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    if (r < rows && k < K && a.v_ready) {
      const T* vp = static_cast<const T*>(a.v) + int64_t(row0 + r) * a.r_max + k;
      s = make_float4(to_f(vp[0]), to_f(vp[1]), to_f(vp[2]), to_f(vp[3]));
    } else if (r < rows && k < K) {
      const float* p = a.partial + int64_t(row0 + r) * a.r_max + k;
#pragma unroll 8
      for (int c = 0; c < a.splits; ++c) {
        float4 u = *reinterpret_cast<const float4*>(p + int64_t(c) * a.num_tokens * a.r_max);
        s.x += u.x; s.y += u.y; s.z += u.z; s.w += u.w;
      }
    }
    T* d = sv + r * kKP + k;
    d[0] = from_f<T>(s.x); d[1] = from_f<T>(s.y); d[2] = from_f<T>(s.z); d[3] = from_f<T>(s.w);
  }
  // B tile: rows col0.. of lora_b[slot] ([d_out, r_max]), columns < K16 (zero past K).
  const T* B = static_cast<const T*>(a.lora_b) + int64_t(slot) * a.d_out * a.r_max;
  const int kv8 = K16 / 8;
#pragma unroll 4
  for (int v = threadIdx.x; v < BN * kv8; v += F::kThreads) {
    int n = v / kv8, k = (v % kv8) * 8;
    uint4 val = make_uint4(0, 0, 0, 0);
    if (col0 + n < a.d_out && k < K) val = *reinterpret_cast<const uint4*>(B + int64_t(col0 + n) * a.r_max + k);
    *reinterpret_cast<uint4*>(sb + n * kKP + k) = val;
  }
  __syncthreads();

  const int warp = threadIdx.x / 32;
  const int wm = warp / WARPS_N, wn = warp % WARPS_N;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[F::kFragM][F::kFragN];
#pragma unroll
  for (int i = 0; i < F::kFragM; ++i)
#pragma unroll
    for (int j = 0; j < F::kFragN; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  for (int k = 0; k < K16; k += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa[F::kFragM];
    wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb[F::kFragN];
#pragma unroll
    for (int i = 0; i < F::kFragM; ++i) wmma::load_matrix_sync(fa[i], sv + (wm * F::kWarpM + i * 16) * kKP + k, kKP);
#pragma unroll
    for (int j = 0; j < F::kFragN; ++j) wmma::load_matrix_sync(fb[j], sb + (wn * F::kWarpN + j * 16) * kKP + k, kKP);
#pragma unroll
    for (int i = 0; i < F::kFragM; ++i)
#pragma unroll
      for (int j = 0; j < F::kFragN; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
  }
  __syncthreads();  // sv/sb are reused as the accumulator tile
#pragma unroll
  for (int i = 0; i < F::kFragM; ++i)
#pragma unroll
    for (int j = 0; j < F::kFragN; ++j)
      wmma::store_matrix_sync(sc + (wm * F::kWarpM + i * 16) * F::kCP + wn * F::kWarpN + j * 16, acc[i][j], F::kCP,
                              wmma::mem_row_major);
  __syncthreads();

#pragma unroll
  for (int q = 0; q < F::kYVec; ++q) {
    int v = threadIdx.x + q * F::kThreads;
    int r = v / (BN / 8), cv = v % (BN / 8);
    int col = col0 + cv * 8;
    if (r < rows && col < a.d_out) {
      const T* ye = reinterpret_cast<const T*>(&yv[q]);
      alignas(16) T out[8];
      const float* cp = sc + r * F::kCP + cv * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) out[e] = from_f<T>(to_f(ye[e]) + alpha * cp[e]);
      *reinterpret_cast<uint4*>(Y + (row0 + r) * a.ld_y + col) = *reinterpret_cast<uint4*>(out);
    }
  }
}

}  // namespace

template <typename T>
cudaError_t gemv_shrink(FusedArgs const& a, cudaStream_t stream) {
  if (a.k_chunk % 8 || a.k_chunk <= 0) return cudaErrorInvalidValue;
  size_t smem = size_t(kRows) * a.k_chunk * sizeof(T);
  if (smem > 200 * 1024) return cudaErrorInvalidValue;
  cudaError_t e = detail::ensure_smem<gemv_shrink_kernel<T>>(200 * 1024);
  if (e != cudaSuccess) return e;
  dim3 grid(a.num_segments, a.splits);
  gemv_shrink_kernel<T><<<grid, kGemvThreads, smem, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int BM, int BN, int WARPS_M, int WARPS_N, int MINB>
cudaError_t fused_expand(FusedArgs const& a, cudaStream_t stream) {
  using F = FusedExpand<T, BM, BN, WARPS_M, WARPS_N>;
  constexpr auto kernel = fused_expand_kernel<T, BM, BN, WARPS_M, WARPS_N, MINB>;
  cudaError_t e = detail::ensure_smem<kernel>(F::kSmem);
  if (e != cudaSuccess) return e;
  int64_t row_tiles = a.num_tokens / BM + a.num_segments;  // >= the tiles of every segment together
  if (row_tiles > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid((a.d_out + BN - 1) / BN, unsigned(row_tiles));
  return detail::launch_ex(kernel, grid, dim3(F::kThreads), F::kSmem, stream, a.pdl != 0, a);
}

}  // namespace atmm

// Instantiations named in tile_configs.def (ATMM_GEMV_SHRINK / ATMM_FUSED_EXPAND lines).
#define ATMM_GEMV_SHRINK(NAME)                                                                          \
  namespace atmm {                                                                                      \
  cudaError_t atmm_fused_##NAME##_f16(FusedArgs const& a, cudaStream_t s) { return gemv_shrink<__half>(a, s); } \
  cudaError_t atmm_fused_##NAME##_bf16(FusedArgs const& a, cudaStream_t s) { return gemv_shrink<__nv_bfloat16>(a, s); } \
  }
#define ATMM_FUSED_EXPAND(NAME, BM, BN, WM, WN, MINB) ATMM_DEFINE_FUSED(NAME, fused_expand, BM, BN, WM, WN, MINB)
#include "atmm/tile_configs.def"
