// The fused call (fc_*): a whole ATMM call, shrink and expand, in ONE launch, on Hopper thread-block
// clusters. Instantiations named in tile_configs.def (ATMM_FUSED_CALL lines).
//
// A cluster of `cl` blocks (cl = the table's split_k, 1..8) owns one row tile of one segment:
//   1. every block streams its 1/cl of d_in through the shrink main loop of stream.cuh, while the first
//      chunks of y and lora_B for its expand are already in flight (they do not depend on v);
//   2. each block leaves its fp32 partial of v in its own shared memory; after a cluster barrier every
//      block sums the cl partials over distributed shared memory in the same fixed order, so all hold
//      the same v, rounded to the activation dtype as the reference rounds it;
//   3. every block runs the expand's update loop of stream.cuh over its 1/cl of d_out.
// x is read once, y read and written once, v never leaves the chip, and there is no second launch (nor
// the gap between two kernels): what decides the short calls, and the tail of the long ones.
#include "atmm/stream.cuh"

namespace atmm {
namespace detail {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ int cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return int(r);
}
__device__ __forceinline__ int cluster_nctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(r));
  return int(r);
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }
// The address of the same shared-memory location in block `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_map(uint32_t smem_addr, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(smem_addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0,%1,%2,%3}, [%4];\n" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(addr) : "memory");
  return v;
}
#endif

// Shared memory: the expand's stages and V tile (UpdateOps' layout) first, then the shrink's stages,
// which the fp32 partial of v reuses once the shrink is done.
template <typename T, int BM, int KMAX, int SWM, int SWN, int BN, int EWM, int EWN, int SS, int ES>
struct CallCfg {
  using Shrink = ShrinkTile<T, BM, 64, SWM, SWN, KMAX, SS>;
  using Update = UpdateOps<T, BM, BN, EWM, EWN, KMAX, ES, false>;
  static constexpr int kThreads = 32 * SWM * SWN;
  static_assert(kThreads == 32 * EWM * EWN, "the shrink and the expand of a fused call run on the same threads");
  static constexpr int kPF = KMAX + 8;  // fp32 partial row stride: conflict-free float2 stores of mma fragments
  static constexpr size_t kPartBytes = size_t(BM) * kPF * sizeof(float);
  static constexpr size_t kShrinkBytes = Shrink::C::kSmem > kPartBytes ? Shrink::C::kSmem : kPartBytes;
  static constexpr size_t kUpdateBytes = Update::C::kSmem;
  static constexpr size_t kSmem = kUpdateBytes + kShrinkBytes;
  static_assert(kUpdateBytes % 16 == 0, "the shrink region must stay 16-byte aligned");
  static_assert(kSmem <= 227 * 1024, "a fused call must fit one block per SM");
};

template <typename T, int BM, int KMAX, int SWM, int SWN, int BN, int EWM, int EWN, int SS, int ES>
__global__ void __launch_bounds__(32 * SWM * SWN, 1) fused_call_kernel(FusedArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Cfg = CallCfg<T, BM, KMAX, SWM, SWN, BN, EWM, EWN, SS, ES>;
  using Shrink = typename Cfg::Shrink;
  using Update = typename Cfg::Update;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* usmem = reinterpret_cast<T*>(smem_raw);
  T* ssmem = reinterpret_cast<T*>(smem_raw + Cfg::kUpdateBytes);
  float* part = reinterpret_cast<float*>(smem_raw + Cfg::kUpdateBytes);
  const int cl = cluster_nctarank(), cr = cluster_ctarank();
  int seg, tile;
  find_tile<BM, Cfg::kThreads>(a, blockIdx.x / cl, seg, tile);
  if (seg < 0) return;  // the same answer in every block of the cluster: no barrier is left waiting
  const int slot = a.seg_slot[seg];
  const int rp = a.slots.rank_padded[slot];
  const int K16 = (rp + 15) & ~15;
  const int row0 = a.seg_indptr[seg] + tile * BM;
  const int rows = min(BM, a.seg_indptr[seg + 1] - row0);
  // This block's share: a 64-aligned chunk of d_in for the shrink, a range of BN-wide chunks of d_out.
  const int k_chunk = ((a.d_in + cl - 1) / cl + 63) / 64 * 64;
  const int k0 = min(cr * k_chunk, a.d_in);
  const int kc = min(k_chunk, a.d_in - k0);
  const int chunks = (a.d_out + BN - 1) / BN, per = (chunks + cl - 1) / cl;
  const int c_begin = min(chunks, cr * per), c_end = min(chunks, c_begin + per);

  UpdateTile<T> t;
  t.v = nullptr;
  t.partial = nullptr;
  t.split_stride = 0;
  t.splits = 0;
  t.ld_v = 0;
  t.b = static_cast<const T*>(a.lora_b) + int64_t(slot) * a.d_out * a.r_max;
  t.ld_b = a.r_max;
  t.y = static_cast<T*>(a.y) + int64_t(row0) * a.ld_y;
  t.ld_y = a.ld_y;
  t.rows = rows;
  t.rp = rp;
  t.n_total = a.d_out;
  t.alpha = a.slots.scale[slot];
  Update::prefetch(usmem, t, c_begin, c_end);  // in flight during the shrink

  typename Shrink::Acc acc;
  const T* X = static_cast<const T*>(a.x) + int64_t(row0) * a.ld_x + k0;
  const T* A = static_cast<const T*>(a.lora_a) + int64_t(slot) * a.r_max * a.d_in + k0;
  Shrink::mainloop(ssmem, X, a.ld_x, A, a.d_in, rows, rp, kc, acc);  // ends with a barrier: stages free
  Shrink::for_each(acc, [&](int r, int n, float a0, float a1) {
    *reinterpret_cast<float2*>(part + r * Cfg::kPF + n) = make_float2(a0, a1);
  });
  cluster_arrive();
  cluster_wait();  // every block's partial is written and visible across the cluster

  // v = the cluster's partials summed in rank order (identical in every block), rounded to T.
  using PT = typename Pair<T>::P;
  T* sv = Update::v_tile(usmem);
  const uint32_t part_addr = smem_u32(part);
  for (int i = threadIdx.x; i < BM * (K16 / 4); i += Cfg::kThreads) {
    const int r = i / (K16 / 4), k = (i % (K16 / 4)) * 4;
    const uint32_t addr = part_addr + uint32_t(r * Cfg::kPF + k) * 4u;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int c = 0; c < cl; ++c) {
      const float4 u = ld_cluster_f4(cluster_map(addr, c));
      s.x += u.x; s.y += u.y; s.z += u.z; s.w += u.w;
    }
    PT* o = reinterpret_cast<PT*>(sv + r * Update::C::kVP + k);
    o[0] = Pair<T>::from_f2(s.x, s.y);
    o[1] = Pair<T>::from_f2(s.z, s.w);
  }
  cluster_arrive();  // done reading the other blocks' partials (waited for before leaving)
  __syncthreads();   // the V tile is complete
  Update::mainloop(usmem, t, c_begin, c_end);
  cluster_wait();  // no block leaves while another may still read its partial
#endif
}

template <typename T, int BM, int KMAX, int SWM, int SWN, int BN, int EWM, int EWN, int SS, int ES>
cudaError_t fused_call(FusedArgs const& a, cudaStream_t stream) {
  using Cfg = CallCfg<T, BM, KMAX, SWM, SWN, BN, EWM, EWN, SS, ES>;
  if (device_cc_major() < 9) return cudaErrorNotSupported;  // thread-block clusters: Hopper and later
  const int cl = a.splits;
  if (cl < 1 || cl > 8) return cudaErrorInvalidValue;  // portable cluster sizes
  constexpr auto kernel = fused_call_kernel<T, BM, KMAX, SWM, SWN, BN, EWM, EWN, SS, ES>;
  cudaError_t e = ensure_smem<kernel>(Cfg::kSmem);
  if (e != cudaSuccess) return e;
  const int64_t row_tiles = a.num_tokens / BM + a.num_segments;  // >= the tiles of every segment together
  if (row_tiles * cl > (int64_t(1) << 31) - 1) return cudaErrorInvalidConfiguration;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(unsigned(row_tiles * cl));
  cfg.blockDim = dim3(Cfg::kThreads);
  cfg.dynamicSmemBytes = Cfg::kSmem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(cl);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  e = cudaLaunchKernelEx(&cfg, kernel, a);
  return e != cudaSuccess ? e : cudaGetLastError();
}

}  // namespace detail
}  // namespace atmm

#define ATMM_FUSED_CALL(NAME, BM, KMAX, SWM, SWN, BN, EWM, EWN, SS, ES) \
  ATMM_ONE_LAUNCH_ENTRIES(NAME, fused_call, CallCfg, BM, KMAX, SWM, SWN, BN, EWM, EWN, SS, ES)
#include "atmm/tile_configs.def"
