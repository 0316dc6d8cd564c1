// Streaming ATMM kernels: cp.async multi-stage pipelines feeding mma.sync (m16n8k16, fp32 accumulate).
//
//   stream shrink (xs_*): v = x[seg] @ A[slot]^T. Block = (row tile of a segment, chunk of d_in); the
//     x and lora_A sub-tiles of 64 columns flow through STAGES shared-memory buffers, so x is read
//     once from HBM at full rate while the tensor cores work. Writes v in the activation dtype when
//     d_in is not split (no reduce pass), fp32 split-K partials otherwise.
//   stream update (ye_*, mg_*): Y[rows, :] += alpha * V[rows, :K] @ Bop (K <= KMAX, small).
//     Block = (row tile, range of column chunks). The V tile is loaded once and kept in registers
//     as mma fragments; the column chunks of Y (read-modify-write, the HBM traffic) and of Bop
//     flow through STAGES buffers, with the update written back in place in shared memory and
//     stored as coalesced 16-byte vectors.
//       expand: V = v (or the sum of the shrink's partials), Bop = lora_B[slot] stored [n][k], Y = y.
//       merge : V = lora_B[l] rows, Bop = lora_A[l] stored [k][n] (ldmatrix .trans), Y = W[l].
// On Hopper the expand is launched as a programmatic dependent of the shrink: it starts while the
// shrink runs, prefetches its y and lora_B chunks, and waits (griddepcontrol.wait) only before it
// reads v. The shrink lets it start at once (griddepcontrol.launch_dependents).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

#include <cub/block/block_scan.cuh>

#include "atmm/atmm.h"
#include "atmm/fused.cuh"
#include "atmm/merge.h"

namespace atmm {
namespace detail {

// ---- PTX helpers ---------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16-byte asynchronous copy global -> shared; pred false writes 16 zero bytes and reads nothing.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool pred) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(pred ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// ldmatrix .x4 of four 8x8 b16 tiles; LAYOUT "" or ".trans" (each tile transposed on the way).
#define ATMM_LDSM_X4(FN, LAYOUT)                                                             \
  __device__ __forceinline__ void FN(uint32_t (&r)[4], const void* p) {                      \
    asm volatile("ldmatrix.sync.aligned.m8n8.x4" LAYOUT ".shared.b16 {%0,%1,%2,%3}, [%4];\n" \
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])                            \
                 : "r"(smem_u32(p)));                                                        \
  }
ATMM_LDSM_X4(ldsm_x4, "")
ATMM_LDSM_X4(ldsm_x4_t, ".trans")
#undef ATMM_LDSM_X4

// mma.sync m16n8k16, T x T -> fp32, for T = __nv_bfloat16 ("bf16") and __half ("f16").
template <typename T>
struct Mma;
#define ATMM_MMA_M16N8K16(T, PTX)                                                                                 \
  template <>                                                                                                     \
  struct Mma<T> {                                                                                                 \
    static __device__ __forceinline__ void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) { \
      asm("mma.sync.aligned.m16n8k16.row.col.f32." PTX "." PTX ".f32 "                                            \
          "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                                               \
          : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                                        \
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                                        \
    }                                                                                                             \
  };
ATMM_MMA_M16N8K16(__nv_bfloat16, "bf16")
ATMM_MMA_M16N8K16(__half, "f16")
#undef ATMM_MMA_M16N8K16

template <typename T>
struct Pair;  // two elements packed in 32 bits, and their conversions
template <>
struct Pair<__nv_bfloat16> {
  using P = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_f2(P v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ P from_f2(float a, float b) { return __floats2bfloat162_rn(a, b); }
};
template <>
struct Pair<__half> {
  using P = __half2;
  static __device__ __forceinline__ float2 to_f2(P v) { return __half22float2(v); }
  static __device__ __forceinline__ P from_f2(float a, float b) { return __floats2half2_rn(a, b); }
};

// Zeroes a warp's mma accumulators: M x N fragments of four floats.
template <int M, int N>
__device__ __forceinline__ void zero_acc(float (&acc)[M][N][4]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;
}

// Programmatic dependent launch (sm_90): let the next kernel start / wait for the previous one.
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---- segments --------------------------------------------------------------------------------------
__device__ __forceinline__ int seg_rank(FusedArgs const& a, int i) {
  int slot = a.seg_slot[i];
  return (slot >= 0 && slot < kMaxSlots) ? a.slots.rank_padded[slot] : 0;
}

// Which segment, and which of its BM-row tiles, block `target` serves: a block scan of the tile
// counts over the segments (segments with no adapter, rank 0 or no tokens have none). -1: no tile.
template <int BM, int THREADS>
__device__ inline void find_tile(FusedArgs const& a, int target, int& seg_out, int& tile_out) {
  using Scan = cub::BlockScan<int, THREADS>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int s_seg, s_tile;
  if (threadIdx.x == 0) s_seg = -1;
  int carry = 0;
  for (int base = 0; base < a.num_segments; base += THREADS) {
    int i = base + threadIdx.x;
    int n = 0;
    if (i < a.num_segments && seg_rank(a, i) > 0) n = (a.seg_indptr[i + 1] - a.seg_indptr[i] + BM - 1) / BM;
    int incl, total;
    __syncthreads();
    Scan(scan_tmp).InclusiveSum(n, incl, total);
    int excl = carry + incl - n;
    if (n > 0 && target >= excl && target < excl + n) {
      s_seg = i;
      s_tile = target - excl;
    }
    carry += total;
    __syncthreads();
    if (s_seg >= 0 || carry > target) break;
  }
  __syncthreads();
  seg_out = s_seg;
  tile_out = s_tile;
}

// ---- stream shrink -----------------------------------------------------------------------------
template <typename T, int BM, int BK, int WM, int WN, int KMAX, int STAGES>
struct ShrinkCfg {
  static constexpr int kThreads = 32 * WM * WN;
  static constexpr int kBM = BM;
  static constexpr int kBK = BK;           // d_in columns per pipeline stage (64 or 128)
  static constexpr int kXP = kBK + 8;      // smem row stride: an odd number of 16-byte units, conflict-free ldmatrix
  static constexpr int kWarpM = BM / WM, kWarpN = KMAX / WN;
  static constexpr int MT = kWarpM / 16, NT = kWarpN / 8;
  static constexpr int kStageElems = (BM + KMAX) * kXP;
  static constexpr size_t kSmem = size_t(STAGES) * kStageElems * sizeof(T);
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tile: rows and rank columns multiples of 16");
  static_assert(STAGES >= 2, "at least double buffering");
  static_assert(BK % 64 == 0, "stage width: a multiple of 64 columns");
};

// The shrink's main loop over one row tile, shared by the stream shrink and the fused call:
// acc = X[0:rows, 0:kc] @ A[0:K16, 0:kc]^T, x and lora_A sub-tiles of BK columns flowing through
// STAGES buffers at `smem` (rows past `rows` and rank rows in [rp, K16) read as zero; rank columns
// past K16 are never computed and stay zero). Ends with every copy landed and a barrier, so the
// stage buffers may be reused.
template <typename T, int BM, int BK, int WM, int WN, int KMAX, int STAGES>
struct ShrinkTile {
  using C = ShrinkCfg<T, BM, BK, WM, WN, KMAX, STAGES>;
  using Acc = float[C::MT][C::NT][4];

  static __device__ __forceinline__ void mainloop(T* smem, const T* X, int64_t ld_x, const T* A, int64_t ld_a, int rows,
                                                  int rp, int kc, Acc& acc) {
    const int K16 = (rp + 15) & ~15;
    const int nk = (kc + C::kBK - 1) / C::kBK;
    auto load_stage = [&](int s, int kb) {
      T* sx = smem + s * C::kStageElems;
      T* sa = sx + BM * C::kXP;
      const int kbase = kb * C::kBK;
#pragma unroll
      for (int it = 0; it < (BM * (BK / 8) + C::kThreads - 1) / C::kThreads; ++it) {
        const int v = threadIdx.x + it * C::kThreads;
        if ((BM * (BK / 8)) % C::kThreads != 0 && v >= (BM * (BK / 8))) break;
        const int r = v / (BK / 8), kv = (v % (BK / 8)) * 8;
        const bool p = r < rows && kbase + kv < kc;
        cp_async16(sx + r * C::kXP + kv, p ? X + int64_t(r) * ld_x + kbase + kv : X, p);
      }
#pragma unroll
      for (int it = 0; it < (KMAX * (BK / 8) + C::kThreads - 1) / C::kThreads; ++it) {
        const int v = threadIdx.x + it * C::kThreads;
        if ((KMAX * (BK / 8)) % C::kThreads != 0 && v >= (KMAX * (BK / 8))) break;
        const int n = v / (BK / 8), kv = (v % (BK / 8)) * 8;
        if (n < K16) {  // rank rows [rp, K16) are zero-filled; rows past K16 are never read
          const bool p = n < rp && kbase + kv < kc;
          cp_async16(sa + n * C::kXP + kv, p ? A + int64_t(n) * ld_a + kbase + kv : A, p);
        }
      }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) load_stage(s, s);
      cp_async_commit();
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp % WM, wn = warp / WM;
    zero_acc(acc);

    for (int kb = 0; kb < nk; ++kb) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage kb has landed for every thread; stage kb-1 is no longer read
      {
        const int nb = kb + STAGES - 1;
        if (nb < nk) load_stage(nb % STAGES, nb);
        cp_async_commit();
      }
      const T* sx = smem + (kb % STAGES) * C::kStageElems;
      const T* sa = sx + BM * C::kXP;
#pragma unroll
      for (int kk = 0; kk < C::kBK; kk += 16) {
        uint32_t af[C::MT][4];
#pragma unroll
        for (int mt = 0; mt < C::MT; ++mt)
          ldsm_x4(af[mt], sx + (wm * C::kWarpM + mt * 16 + (lane & 15)) * C::kXP + kk + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < C::NT / 2; ++np) {
          const int n0 = wn * C::kWarpN + np * 16;
          if (n0 < K16) {  // warp-uniform
            uint32_t bf[4];
            ldsm_x4(bf, sa + (n0 + (lane & 7) + ((lane >> 4) << 3)) * C::kXP + kk + ((lane >> 3) & 1) * 8);
#pragma unroll
            for (int mt = 0; mt < C::MT; ++mt) {
              Mma<T>::run(acc[mt][2 * np], af[mt], bf[0], bf[1]);
              Mma<T>::run(acc[mt][2 * np + 1], af[mt], bf[2], bf[3]);
            }
          }
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // every thread is done reading the stage buffers
  }

  // f(r, n, a0, a1) for each accumulator pair this thread holds: tile row r, rank columns n and n + 1.
  template <class F>
  static __device__ __forceinline__ void for_each(Acc const& acc, F&& f) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp % WM, wn = warp / WM;
    const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          f(wm * C::kWarpM + mt * 16 + g + 8 * h, wn * C::kWarpN + nt * 8 + t4 * 2, acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
  }
};

// One shrink unit of a call: d_in chunk c of row tile `tile` of segment `seg`, through Tile's main loop
// (smem: its stage buffers). Writes v in the activation dtype when d_in is not split (the reference
// rounds v too), else chunk c's fp32 partial.
template <typename Tile, typename T>
__device__ __forceinline__ void shrink_unit(FusedArgs const& a, T* smem, int seg, int tile, int c) {
  const int k0 = c * a.k_chunk;
  const int kc = min(a.k_chunk, a.d_in - k0);
  if (kc <= 0) return;
  const int slot = a.seg_slot[seg];
  const int rp = a.slots.rank_padded[slot];
  const int row0 = a.seg_indptr[seg] + tile * Tile::C::kBM;
  const int rows = min(Tile::C::kBM, a.seg_indptr[seg + 1] - row0);
  const T* X = static_cast<const T*>(a.x) + int64_t(row0) * a.ld_x + k0;
  const T* A = static_cast<const T*>(a.lora_a) + int64_t(slot) * a.r_max * a.d_in + k0;
  typename Tile::Acc acc;
  Tile::mainloop(smem, X, a.ld_x, A, a.d_in, rows, rp, kc, acc);
  using PT = typename Pair<T>::P;
  Tile::for_each(acc, [&](int r, int n, float a0, float a1) {
    if (n >= rp || r >= rows) return;
    const int64_t row = row0 + r;
    if (a.splits == 1)
      *reinterpret_cast<PT*>(static_cast<T*>(a.v) + row * a.r_max + n) = Pair<T>::from_f2(a0, a1);
    else
      *reinterpret_cast<float2*>(a.partial + (int64_t(c) * a.num_tokens + row) * a.r_max + n) = make_float2(a0, a1);
  });
}

template <typename T, int BM, int BK, int WM, int WN, int KMAX, int STAGES>
__global__ void __launch_bounds__(32 * WM * WN) stream_shrink_kernel(FusedArgs a) {
  using Tile = ShrinkTile<T, BM, BK, WM, WN, KMAX, STAGES>;
  pdl_launch_dependents();  // the expand may start now: it prefetches y and lora_B, then waits for v
  extern __shared__ __align__(16) unsigned char smem_raw[];
  int seg, tile;
  find_tile<BM, Tile::C::kThreads>(a, blockIdx.x, seg, tile);
  if (seg >= 0) shrink_unit<Tile>(a, reinterpret_cast<T*>(smem_raw), seg, tile, int(blockIdx.y));
}

// ---- stream update (expand and merge) ------------------------------------------------------------
template <typename T, int BM, int BN, int WM, int WN, int KMAX, int STAGES, bool TRANS_B>
struct UpdateCfg {
  static constexpr int kThreads = 32 * WM * WN;
  static constexpr int kWarpM = BM / WM, kWarpN = BN / WN;
  static constexpr int MT = kWarpM / 16, NT = kWarpN / 8, KS = KMAX / 16;
  static constexpr int kYP = BN + 8;    // y chunk row stride (elements): conflict-free epilogue
  static constexpr int kVP = KMAX + 8;  // v tile row stride
  // Bop chunk: [BN][KMAX] (rows n, expand) or [KMAX][BN] (rows k, merge), rows padded by 8 elements.
  static constexpr int kBP = TRANS_B ? BN + 8 : KMAX + 8;
  static constexpr int kBElems = TRANS_B ? KMAX * kBP : BN * kBP;
  static constexpr int kYElems = BM * kYP;
  static constexpr int kStageElems = kBElems + kYElems;
  static constexpr size_t kSmem = (size_t(STAGES) * kStageElems + size_t(BM) * kVP) * sizeof(T);
  static_assert(kWarpM % 16 == 0 && kWarpN % 16 == 0, "warp tile: multiples of 16");
  static_assert(KMAX % 16 == 0 && BN % 8 == 0, "KMAX multiple of 16");
  static_assert(STAGES >= 2, "at least double buffering");
};

// One block's work: rows [0, rows) of V/Y from the given bases, column chunks [c_begin, c_end).
template <typename T>
struct UpdateTile {
  const T* v;            // V rows in the dtype (null when summing partials)
  const float* partial;  // split-K partials of the same rows: partial[c * split_stride + r * ld_v + k]
  int64_t split_stride;
  int splits;
  int64_t ld_v;
  const T* b;  // Bop of this tile's adapter / layer
  int64_t ld_b;
  T* y;
  int64_t ld_y;
  int rows, rp, n_total;
  float alpha;
  // The merge only (TRANS_B): a second term whose V rows and Bop rows follow the first's rank k2 (V columns
  // and Bop rows k >= k2 come from v2 and b2, with the same leading dimensions), negated when neg2.
  const T* v2;
  const T* b2;
  int k2;
  bool neg2;
};

// The update's pieces, shared by the stream expand and the merge. Shared memory:
// STAGES stage buffers (Bop chunk, then y chunk) at `smem`, then the V tile (sv = v_tile(smem)).
template <typename T, int BM, int BN, int WM, int WN, int KMAX, int STAGES, bool TRANS_B>
struct UpdateOps {
  using C = UpdateCfg<T, BM, BN, WM, WN, KMAX, STAGES, TRANS_B>;

  static __device__ __forceinline__ T* v_tile(T* smem) { return smem + STAGES * C::kStageElems; }

  // Stage s <- column chunk j of y and of Bop (cp.async, not committed).
  static __device__ __forceinline__ void load_stage(T* smem, UpdateTile<T> const& t, int s, int j) {
    const int K16 = (t.rp + 15) & ~15;
    T* sb = smem + s * C::kStageElems;
    T* sy = sb + C::kBElems;
    const int n0 = j * BN;
#pragma unroll
    for (int it = 0; it < (BM * (BN / 8) + C::kThreads - 1) / C::kThreads; ++it) {
      const int v = threadIdx.x + it * C::kThreads;
      if ((BM * (BN / 8)) % C::kThreads != 0 && v >= (BM * (BN / 8))) break;
      const int r = v / (BN / 8), cv = (v % (BN / 8)) * 8;
      const bool p = r < t.rows && n0 + cv < t.n_total;
      cp_async16(sy + r * C::kYP + cv, p ? t.y + int64_t(r) * t.ld_y + n0 + cv : t.y, p);
    }
    if constexpr (!TRANS_B) {
#pragma unroll
      for (int it = 0; it < (BN * (KMAX / 8) + C::kThreads - 1) / C::kThreads; ++it) {
        const int v = threadIdx.x + it * C::kThreads;
        if ((BN * (KMAX / 8)) % C::kThreads != 0 && v >= (BN * (KMAX / 8))) break;
        const int n = v / (KMAX / 8), kv = (v % (KMAX / 8)) * 8;
        if (kv < K16) {
          const bool p = n0 + n < t.n_total && kv < t.rp;
          cp_async16(sb + n * C::kBP + kv, p ? t.b + int64_t(n0 + n) * t.ld_b + kv : t.b, p);
        }
      }
    } else {
#pragma unroll
      for (int it = 0; it < (KMAX * (BN / 8) + C::kThreads - 1) / C::kThreads; ++it) {
        const int v = threadIdx.x + it * C::kThreads;
        if ((KMAX * (BN / 8)) % C::kThreads != 0 && v >= (KMAX * (BN / 8))) break;
        const int k = v / (BN / 8), cv = (v % (BN / 8)) * 8;
        if (k < K16) {
          const bool p = k < t.rp && n0 + cv < t.n_total;
          const T* src = k < t.k2 ? t.b + int64_t(k) * t.ld_b : t.b2 + int64_t(k - t.k2) * t.ld_b;
          cp_async16(sb + k * C::kBP + cv, p ? src + n0 + cv : t.b, p);
        }
      }
    }
  }

  // The first STAGES - 1 chunks, one commit group each (y and Bop do not depend on v).
  static __device__ __forceinline__ void prefetch(T* smem, UpdateTile<T> const& t, int c_begin, int c_end) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < c_end - c_begin) load_stage(smem, t, s, c_begin + s);
      cp_async_commit();
    }
  }

  // V tile -> shared memory (zero past the rows and the rank), summing split-K partials if given.
  // Loads go to L2 (ld.cg): v and the partials were written by the previous kernel (the shrink).
  static __device__ __forceinline__ void load_v(T* smem, UpdateTile<T> const& t) {
    T* sv = v_tile(smem);
    const int K16 = (t.rp + 15) & ~15;
#pragma unroll
    for (int it = 0; it < (BM * (KMAX / 8) + C::kThreads - 1) / C::kThreads; ++it) {
      const int v = threadIdx.x + it * C::kThreads;
      if ((BM * (KMAX / 8)) % C::kThreads != 0 && v >= (BM * (KMAX / 8))) break;
      const int r = v / (KMAX / 8), kv = (v % (KMAX / 8)) * 8;
      if (kv >= K16) continue;
      uint4 out = make_uint4(0, 0, 0, 0);
      if (r < t.rows && kv < t.rp) {
        if (t.partial) {
          float s[8];
#pragma unroll
          for (int e = 0; e < 8; ++e) s[e] = 0.f;
          const float* p = t.partial + int64_t(r) * t.ld_v + kv;
#pragma unroll 8
          for (int c = 0; c < t.splits; ++c) {  // unrolled: the partials' loads are in flight together
            const float4 u = __ldcg(reinterpret_cast<const float4*>(p + c * t.split_stride));
            const float4 w = __ldcg(reinterpret_cast<const float4*>(p + c * t.split_stride + 4));
            s[0] += u.x; s[1] += u.y; s[2] += u.z; s[3] += u.w;
            s[4] += w.x; s[5] += w.y; s[6] += w.z; s[7] += w.w;
          }
          using PT = typename Pair<T>::P;
          PT* o = reinterpret_cast<PT*>(&out);
#pragma unroll
          for (int e = 0; e < 4; ++e) o[e] = Pair<T>::from_f2(s[2 * e], s[2 * e + 1]);
        } else if constexpr (TRANS_B) {  // the merge: V columns past k2 are the second term's, maybe negated
          if (kv < t.k2) {
            out = __ldcg(reinterpret_cast<const uint4*>(t.v + int64_t(r) * t.ld_v + kv));
          } else {
            out = __ldcg(reinterpret_cast<const uint4*>(t.v2 + int64_t(r) * t.ld_v + kv - t.k2));
            if (t.neg2) {  // flip the sign bit of all eight fp16/bf16 values: exact
              out.x ^= 0x80008000u; out.y ^= 0x80008000u; out.z ^= 0x80008000u; out.w ^= 0x80008000u;
            }
          }
        } else {
          out = __ldcg(reinterpret_cast<const uint4*>(t.v + int64_t(r) * t.ld_v + kv));
        }
      }
      *reinterpret_cast<uint4*>(sv + r * C::kVP + kv) = out;
    }
  }

  // Column chunks [c_begin, c_end) of y += alpha * V @ Bop, after prefetch() and with the V tile in
  // shared memory behind a barrier. Every commit group is waited for on return.
  static __device__ __forceinline__ void mainloop(T* smem, UpdateTile<T> const& t, int c_begin, int c_end) {
    const T* sv = v_tile(smem);
    const int K16 = (t.rp + 15) & ~15;
    const int nj = c_end - c_begin;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int wm = warp % WM, wn = warp / WM;
    uint32_t vf[C::MT][C::KS][4];
#pragma unroll
    for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
      for (int ks = 0; ks < C::KS; ++ks)
        if (ks * 16 < K16)
          ldsm_x4(vf[mt][ks], sv + (wm * C::kWarpM + mt * 16 + (lane & 15)) * C::kVP + ks * 16 + (lane >> 4) * 8);

    const int g = lane >> 2, t4 = lane & 3;
    using PT = typename Pair<T>::P;
    for (int j = 0; j < nj; ++j) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // chunk j has landed; every thread is done storing chunk j-1
      {
        const int jn = j + STAGES - 1;
        if (jn < nj) load_stage(smem, t, jn % STAGES, c_begin + jn);
        cp_async_commit();
      }
      const T* sb = smem + (j % STAGES) * C::kStageElems;
      T* sy = const_cast<T*>(sb) + C::kBElems;
      float acc[C::MT][C::NT][4];
      zero_acc(acc);
#pragma unroll
      for (int ks = 0; ks < C::KS; ++ks) {
        if (ks * 16 >= K16) break;
#pragma unroll
        for (int np = 0; np < C::NT / 2; ++np) {
          uint32_t bf[4];
          const int nb = wn * C::kWarpN + np * 16;
          if constexpr (!TRANS_B)
            ldsm_x4(bf, sb + (nb + (lane & 7) + ((lane >> 4) << 3)) * C::kBP + ks * 16 + ((lane >> 3) & 1) * 8);
          else
            ldsm_x4_t(bf, sb + (ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3)) * C::kBP + nb + ((lane >> 4) << 3));
#pragma unroll
          for (int mt = 0; mt < C::MT; ++mt) {
            Mma<T>::run(acc[mt][2 * np], vf[mt][ks], bf[0], bf[1]);
            Mma<T>::run(acc[mt][2 * np + 1], vf[mt][ks], bf[2], bf[3]);
          }
        }
      }
      // y chunk += alpha * acc, in place in shared memory (each thread its own elements).
#pragma unroll
      for (int mt = 0; mt < C::MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < C::NT; ++nt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = wm * C::kWarpM + mt * 16 + g + 8 * h;
            const int col = wn * C::kWarpN + nt * 8 + t4 * 2;
            PT* p = reinterpret_cast<PT*>(sy + r * C::kYP + col);
            const float2 yv = Pair<T>::to_f2(*p);
            *p = Pair<T>::from_f2(yv.x + t.alpha * acc[mt][nt][2 * h], yv.y + t.alpha * acc[mt][nt][2 * h + 1]);
          }
      __syncthreads();
      const int n0 = (c_begin + j) * BN;
#pragma unroll
      for (int it = 0; it < (BM * (BN / 8) + C::kThreads - 1) / C::kThreads; ++it) {
        const int v = threadIdx.x + it * C::kThreads;
        if ((BM * (BN / 8)) % C::kThreads != 0 && v >= (BM * (BN / 8))) break;
        const int r = v / (BN / 8), cv = (v % (BN / 8)) * 8;
        if (r < t.rows && n0 + cv < t.n_total)
          *reinterpret_cast<uint4*>(t.y + int64_t(r) * t.ld_y + n0 + cv) = *reinterpret_cast<const uint4*>(sy + r * C::kYP + cv);
      }
    }
    cp_async_wait<0>();
  }
};

template <typename T, int BM, int BN, int WM, int WN, int KMAX, int STAGES, bool TRANS_B>
__device__ __forceinline__ void stream_update_tile(UpdateTile<T> const& t, int c_begin, int c_end, bool wait_for_v) {
  using Ops = UpdateOps<T, BM, BN, WM, WN, KMAX, STAGES, TRANS_B>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* smem = reinterpret_cast<T*>(smem_raw);
  // y and Bop do not depend on the previous kernel (the shrink): start them before waiting on it.
  Ops::prefetch(smem, t, c_begin, c_end);
  if (wait_for_v) pdl_wait();
  Ops::load_v(smem, t);
  __syncthreads();
  Ops::mainloop(smem, t, c_begin, c_end);
}

// Column chunks of this block: gridDim.y ranges of contiguous BN-wide chunks.
template <int BN>
__device__ __forceinline__ bool column_range(int n_total, int& c_begin, int& c_end) {
  const int chunks = (n_total + BN - 1) / BN;
  const int per = (chunks + gridDim.y - 1) / gridDim.y;
  c_begin = blockIdx.y * per;
  c_end = min(chunks, c_begin + per);
  return c_begin < c_end;
}

// The expand's update tile for row tile `tile` (BM rows) of segment `seg`: v of its rows (or the split-K
// partials, summed as they load), lora_B and scale of its adapter, its rows of y.
template <typename T, int BM>
__device__ __forceinline__ UpdateTile<T> expand_tile(FusedArgs const& a, int seg, int tile) {
  const int slot = a.seg_slot[seg];
  const int row0 = a.seg_indptr[seg] + tile * BM;
  UpdateTile<T> t;
  t.v = a.v_ready ? static_cast<const T*>(a.v) + int64_t(row0) * a.r_max : nullptr;
  t.partial = a.v_ready ? nullptr : a.partial + int64_t(row0) * a.r_max;
  t.split_stride = a.num_tokens * a.r_max;
  t.splits = a.splits;
  t.ld_v = a.r_max;
  t.b = static_cast<const T*>(a.lora_b) + int64_t(slot) * a.d_out * a.r_max;
  t.ld_b = a.r_max;
  t.y = static_cast<T*>(a.y) + int64_t(row0) * a.ld_y;
  t.ld_y = a.ld_y;
  t.rows = min(BM, a.seg_indptr[seg + 1] - row0);
  t.rp = a.slots.rank_padded[slot];
  t.n_total = a.d_out;
  t.alpha = a.slots.scale[slot];
  return t;
}

template <typename T, int BM, int BN, int WM, int WN, int KMAX, int STAGES>
__global__ void __launch_bounds__(32 * WM * WN) stream_expand_kernel(FusedArgs a) {
  using C = UpdateCfg<T, BM, BN, WM, WN, KMAX, STAGES, false>;
  int seg, tile;
  find_tile<BM, C::kThreads>(a, blockIdx.x, seg, tile);
  int c_begin, c_end;
  if (seg < 0 || !column_range<BN>(a.d_out, c_begin, c_end)) return;
  stream_update_tile<T, BM, BN, WM, WN, KMAX, STAGES, false>(expand_tile<T, BM>(a, seg, tile), c_begin, c_end, true);
}

template <typename T, int BM, int BN, int WM, int WN, int KMAX, int STAGES>
__global__ void __launch_bounds__(32 * WM * WN) stream_merge_kernel(MergeArgs a) {
  const int tiles_per_layer = (a.d_out + BM - 1) / BM;
  const int l = blockIdx.x / tiles_per_layer;
  const int row0 = (blockIdx.x % tiles_per_layer) * BM;
  int c_begin, c_end;
  if (l >= a.layers || !column_range<BN>(a.d_in, c_begin, c_end)) return;
  // V = lora_B[l] rows (ld_b apart), Bop = lora_A[l] [rank, d_in], Y = W[l]; matrix l of each is stride_* further on.
  const bool two = a.lora_a2 != nullptr;
  UpdateTile<T> t;
  t.v = static_cast<const T*>(a.lora_b) + int64_t(l) * a.stride_b + int64_t(row0) * a.ld_b;
  t.partial = nullptr;
  t.split_stride = 0;
  t.splits = 0;
  t.ld_v = a.ld_b;
  t.b = static_cast<const T*>(a.lora_a) + int64_t(l) * a.stride_a;
  t.ld_b = a.d_in;
  t.y = static_cast<T*>(a.w) + int64_t(l) * a.stride_w + int64_t(row0) * a.d_in;
  t.ld_y = a.d_in;
  t.rows = min(BM, a.d_out - row0);
  t.rp = two ? 2 * a.rank : a.rank;
  t.n_total = a.d_in;
  t.alpha = a.alpha;
  t.v2 = two ? static_cast<const T*>(a.lora_b2) + int64_t(l) * a.stride_b + int64_t(row0) * a.ld_b : t.v;
  t.b2 = two ? static_cast<const T*>(a.lora_a2) + int64_t(l) * a.stride_a : t.b;
  t.k2 = two ? a.rank : t.rp;
  t.neg2 = a.negate2;
  stream_update_tile<T, BM, BN, WM, WN, KMAX, STAGES, true>(t, c_begin, c_end, false);
}

// ---- host side ---------------------------------------------------------------------------------
// Raise a kernel's dynamic shared-memory limit once per device (the attribute is per device: a
// process-wide flag would leave the second GPU of a multi-instance server at the 48 KB default).
template <auto Kernel>
cudaError_t ensure_smem(size_t bytes) {
  static std::atomic<uint64_t> done{0};  // one flag per kernel (the template argument) and device
  if (bytes <= 48 * 1024) return cudaSuccess;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (done.load(std::memory_order_acquire) & bit) return cudaSuccess;
  e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
  if (e == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
  return e;
}

// Resident blocks per SM of a kernel at its shared memory, cached per device.
template <auto Kernel>
int blocks_per_sm(int threads, size_t smem) {
  static std::atomic<int> cached[64];
  int dev = 0;
  cudaGetDevice(&dev);
  dev &= 63;
  int v = cached[dev].load(std::memory_order_relaxed);
  if (v <= 0) {
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, Kernel, threads, smem) != cudaSuccess || v <= 0) v = 1;
    cached[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Launch, as a programmatic dependent of the previous kernel on the stream when `pdl` is set.
template <typename... KArgs, typename... Args>
cudaError_t launch_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, bool pdl,
                      Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = pdl ? attr : nullptr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

// Column splits: enough blocks for `waves` full waves of resident blocks, at most one per chunk.
inline int column_splits(int64_t row_tiles, int n_total, int bn, int resident_blocks) {
  const int chunks = (n_total + bn - 1) / bn;
  int64_t want = (int64_t(resident_blocks) + row_tiles - 1) / std::max<int64_t>(row_tiles, 1);
  return int(std::max<int64_t>(1, std::min<int64_t>(want, chunks)));
}

template <typename T, int BM, int BK, int WM, int WN, int KMAX, int STAGES>
cudaError_t stream_shrink(FusedArgs const& a, cudaStream_t stream) {
  using C = ShrinkCfg<T, BM, BK, WM, WN, KMAX, STAGES>;
  constexpr auto kernel = stream_shrink_kernel<T, BM, BK, WM, WN, KMAX, STAGES>;
  cudaError_t e = ensure_smem<kernel>(C::kSmem);
  if (e != cudaSuccess) return e;
  const int64_t row_tiles = a.num_tokens / BM + a.num_segments;  // >= the tiles of every segment together
  if (row_tiles > (int64_t(1) << 31) - 1 || a.splits > 65535) return cudaErrorInvalidConfiguration;
  kernel<<<dim3(unsigned(row_tiles), a.splits), C::kThreads, C::kSmem, stream>>>(a);
  return cudaGetLastError();
}

template <typename T, int BM, int BN, int WM, int WN, int KMAX, int STAGES>
cudaError_t stream_expand(FusedArgs const& a, cudaStream_t stream) {
  using C = UpdateCfg<T, BM, BN, WM, WN, KMAX, STAGES, false>;
  constexpr auto kernel = stream_expand_kernel<T, BM, BN, WM, WN, KMAX, STAGES>;
  cudaError_t e = ensure_smem<kernel>(C::kSmem);
  if (e != cudaSuccess) return e;
  const int64_t row_tiles = a.num_tokens / BM + a.num_segments;
  if (row_tiles > (int64_t(1) << 31) - 1) return cudaErrorInvalidConfiguration;
  const int resident = sm_count() * blocks_per_sm<kernel>(C::kThreads, C::kSmem);
  const int cs = column_splits(row_tiles, a.d_out, BN, resident);
  return launch_ex(kernel, dim3(unsigned(row_tiles), cs), dim3(C::kThreads), C::kSmem, stream, a.pdl != 0, a);
}

template <typename T, int BM, int BN, int WM, int WN, int KMAX, int STAGES>
cudaError_t stream_merge(MergeArgs const& a, cudaStream_t stream) {
  using C = UpdateCfg<T, BM, BN, WM, WN, KMAX, STAGES, true>;
  if (a.total_rank() > KMAX || a.rank % 8 || a.d_in % 8 || a.ld_b % 8 || a.stride_a % 8 || a.stride_b % 8 || a.stride_w % 8)
    return cudaErrorInvalidValue;
  constexpr auto kernel = stream_merge_kernel<T, BM, BN, WM, WN, KMAX, STAGES>;
  cudaError_t e = ensure_smem<kernel>(C::kSmem);
  if (e != cudaSuccess) return e;
  const int64_t row_tiles = int64_t(a.layers) * ((a.d_out + BM - 1) / BM);
  if (row_tiles > (int64_t(1) << 31) - 1) return cudaErrorInvalidConfiguration;
  const int resident = sm_count() * blocks_per_sm<kernel>(C::kThreads, C::kSmem);
  const int cs = column_splits(row_tiles, a.d_in, BN, resident);
  kernel<<<dim3(unsigned(row_tiles), cs), C::kThreads, C::kSmem, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace detail
}  // namespace atmm
