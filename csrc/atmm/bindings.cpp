// pybind11 bindings for vlora_atmm_ext: thin. They validate, then launch on the stream the caller
// passes (an integer cudaStream_t). Device memory travels as integer pointers: no libtorch here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>

#include "atmm/atmm.h"
#include "atmm/driver.h"
#include "atmm/merge.h"
#include "atmm/table.h"

namespace py = pybind11;
using namespace atmm;

namespace {
DType parse_dtype(std::string const& s) {
  if (s == "fp16" || s == "float16") return DType::kF16;
  if (s == "bf16" || s == "bfloat16") return DType::kBF16;
  throw std::invalid_argument("atmm: unknown dtype '" + s + "' (fp16 or bf16)");
}
Direction parse_direction(std::string const& s) {
  if (s == "shrink") return Direction::kShrink;
  if (s == "expand") return Direction::kExpand;
  throw std::invalid_argument("atmm: unknown direction '" + s + "' (shrink or expand)");
}
template <typename T>
T* ptr(uintptr_t p) { return reinterpret_cast<T*>(p); }

py::dict key_dict(ShapeKey const& k) {
  py::dict d;
  d["direction"] = direction_name(k.direction);
  d["dtype"] = dtype_name(k.dtype);
  d["tokens"] = k.tokens;
  d["width"] = k.width;
  d["rank"] = k.rank;
  d["segments"] = k.segments;
  return d;
}
}  // namespace

PYBIND11_MODULE(vlora_atmm_ext, m) {
  m.doc() = "ATMM CUTLASS grouped-GEMM kernels for batches of LoRA adapters (see vlora.atmm)";
  m.attr("MAX_SLOTS") = kMaxSlots;
  m.attr("ALIGNMENT") = kAlignment;
#ifdef ATMM_CUDA_ARCHS
  m.attr("CUDA_ARCHS") = ATMM_CUDA_ARCHS;
#else
  m.attr("CUDA_ARCHS") = "";
#endif

  m.def("configs", [] {
    py::list out;
    for (auto const& c : kernel_configs()) {
      py::dict d;
      d["name"] = c.name;
      d["tb_m"] = c.tb_m; d["tb_n"] = c.tb_n; d["tb_k"] = c.tb_k;
      d["warp_m"] = c.warp_m; d["warp_n"] = c.warp_n; d["warp_k"] = c.warp_k;
      d["stages"] = c.stages;
      d["shrink"] = c.serves(Direction::kShrink, DType::kBF16);
      d["expand"] = c.serves(Direction::kExpand, DType::kBF16);
      d["kind"] = c.kind == Kind::kCutlass ? "cutlass"
                  : c.kind == Kind::kGemvShrink ? "gemv"
                  : (c.kind == Kind::kStreamShrink || c.kind == Kind::kStreamExpand) ? "stream"
                  : c.kind == Kind::kSm90 ? "cutlass3"
                  : (c.kind == Kind::kTritonShrink || c.kind == Kind::kTritonExpand) ? "triton" : "fused";
      d["max_rank"] = c.max_rank;
      d["smem_bytes"] = c.smem;
      out.append(d);
    }
    return out;
  }, "Every compiled tiling configuration, in the order of tile_configs.def.");

  m.def("workspace_size", [](int num_segments, int split_k, int64_t num_tokens, int r_max, std::string const& dtype) {
    if (num_segments < 0 || split_k < 1 || num_tokens < 0 || r_max < 0)
      throw std::invalid_argument("atmm.workspace_size: negative size or split_k < 1");
    return workspace_layout(num_segments, split_k, num_tokens, r_max, parse_dtype(dtype)).total;
  }, py::arg("num_segments"), py::arg("split_k"), py::arg("num_tokens"), py::arg("r_max"), py::arg("dtype"),
     "Bytes of device workspace one forward() call needs.");

  m.def("forward",
        [](uintptr_t y, uintptr_t x, uintptr_t lora_a, uintptr_t lora_b, uintptr_t seg_indptr, uintptr_t seg_slot,
           uintptr_t workspace, size_t workspace_bytes, int64_t num_tokens, int d_in, int d_out, int r_max,
           int64_t ld_x, int64_t ld_y, int num_segments, std::vector<int> ranks, std::vector<float> scales,
           std::string const& dtype, int shrink_config, int split_k, int expand_config, uintptr_t stream, int phases,
           bool pdl) {
          for (uintptr_t p : {y, x, lora_a, lora_b, workspace})
            if (p % 16) throw std::invalid_argument("atmm: operand pointers must be 16-byte aligned");
          ForwardArgs a{ptr<void>(y), ptr<const void>(x), ptr<const void>(lora_a), ptr<const void>(lora_b),
                        ptr<const int32_t>(seg_indptr), ptr<const int32_t>(seg_slot), ptr<void>(workspace),
                        workspace_bytes, num_tokens, d_in, d_out, r_max, ld_x, ld_y, num_segments,
                        std::move(ranks), std::move(scales), parse_dtype(dtype), shrink_config, split_k, expand_config, pdl};
          if (phases < 1 || phases > kPhaseAll) throw std::invalid_argument("atmm: phases must be a mask of 1 (prep), 2 (shrink), 4 (expand)");
          std::string err = forward_phases(a, phases, reinterpret_cast<cudaStream_t>(stream));
          if (!err.empty()) throw std::runtime_error(err);
        },
        py::arg("y"), py::arg("x"), py::arg("lora_a"), py::arg("lora_b"), py::arg("seg_indptr"), py::arg("seg_slot"),
        py::arg("workspace"), py::arg("workspace_bytes"), py::arg("num_tokens"), py::arg("d_in"), py::arg("d_out"),
        py::arg("r_max"), py::arg("ld_x"), py::arg("ld_y"), py::arg("num_segments"), py::arg("ranks"), py::arg("scales"),
        py::arg("dtype"), py::arg("shrink_config"), py::arg("split_k"), py::arg("expand_config"), py::arg("stream"), py::arg("phases") = int(kPhaseAll),
        py::arg("pdl") = true,
        "y += segment-wise x @ A^T @ B^T * scale: prep, shrink (split-K), reduce and expand on `stream`.\n"
        "pdl: the expand may be launched as a programmatic dependent of the shrink (Hopper).");

  m.def("merge_configs", &merge_config_names, "Compiled merge configurations, by index.");
  m.def("merge_config_max_ranks", &merge_config_max_ranks, "Largest rank (of all terms together) each merge configuration serves, by index.");
  m.def("merge",
        [](uintptr_t w, uintptr_t lora_a, uintptr_t lora_b, int layers, int d_out, int d_in, int rank, float alpha,
           std::string const& dtype, int config, uintptr_t stream, int64_t stride_a, int64_t stride_b, int64_t ld_b,
           int64_t stride_w, uintptr_t lora_a2, uintptr_t lora_b2, bool negate2) {
          for (uintptr_t p : {w, lora_a, lora_b, lora_a2, lora_b2})
            if (p % 16) throw std::invalid_argument("merge: operand pointers must be 16-byte aligned");
          MergeArgs a{ptr<void>(w), ptr<const void>(lora_a), ptr<const void>(lora_b), layers, d_out, d_in, rank, alpha,
                      parse_dtype(dtype) == DType::kBF16, config};
          // 0: the contiguous layout, A [L, rank, d_in] and B [L, d_out, rank].
          a.ld_b = ld_b ? ld_b : rank;
          a.stride_a = stride_a ? stride_a : int64_t(rank) * d_in;
          a.stride_b = stride_b ? stride_b : int64_t(d_out) * a.ld_b;
          a.stride_w = stride_w ? stride_w : int64_t(d_out) * d_in;
          a.lora_a2 = ptr<const void>(lora_a2);
          a.lora_b2 = ptr<const void>(lora_b2);
          a.negate2 = negate2;
          std::string err = merge(a, reinterpret_cast<cudaStream_t>(stream));
          if (!err.empty()) throw std::runtime_error(err);
        },
        py::arg("w"), py::arg("lora_a"), py::arg("lora_b"), py::arg("layers"), py::arg("d_out"), py::arg("d_in"),
        py::arg("rank"), py::arg("alpha"), py::arg("dtype"), py::arg("config"), py::arg("stream"), py::arg("stride_a") = 0,
        py::arg("stride_b") = 0, py::arg("ld_b") = 0, py::arg("stride_w") = 0, py::arg("lora_a2") = 0, py::arg("lora_b2") = 0,
        py::arg("negate2") = false,
        "W[l] += alpha * (B[l] @ A[l] + s * B2[l] @ A2[l]) for every l, in place, one pass over W: matrix l of W at\n"
        "w + l * stride_w ([d_out, d_in], rows d_in apart), of A at lora_a + l * stride_a ([rank, d_in], rows d_in\n"
        "apart), of B at lora_b + l * stride_b ([d_out, rank], rows ld_b apart), strides in elements (0: contiguous). The second term (lora_a2, lora_b2: 0 for none) has the\n"
        "same rank and strides; s = -1 with negate2, else +1.");

  py::class_<TilingTable>(m, "TilingTable")
      .def(py::init<>())
      .def("add",
           [](TilingTable& t, std::string const& direction, std::string const& dtype, int64_t tokens, int width, int rank,
              int segments, std::string const& config, int split_k) {
             t.add(ShapeKey{parse_direction(direction), parse_dtype(dtype), tokens, width, rank, segments}, config, split_k);
           },
           py::arg("direction"), py::arg("dtype"), py::arg("tokens"), py::arg("width"), py::arg("rank"),
           py::arg("segments"), py::arg("config"), py::arg("split_k") = 1)
      .def("lookup",
           [](TilingTable const& t, std::string const& direction, std::string const& dtype, int64_t tokens, int width,
              int rank, int segments) {
             LookupResult r = t.lookup(ShapeKey{parse_direction(direction), parse_dtype(dtype), tokens, width, rank, segments});
             if (r.config < 0) throw std::runtime_error("atmm: default configuration is not compiled");
             py::dict d;
             d["config"] = kernel_configs()[r.config].name;
             d["config_index"] = r.config;
             d["split_k"] = r.split_k;
             d["exact"] = r.exact;
             d["default"] = r.from_default;
             d["matched"] = key_dict(r.matched);
             return d;
           },
           py::arg("direction"), py::arg("dtype"), py::arg("tokens"), py::arg("width"), py::arg("rank"),
           py::arg("segments"))
      .def("__len__", &TilingTable::size)
      .def("key", [](TilingTable const&, std::string const& direction, std::string const& dtype, int64_t tokens, int width,
                     int rank, int segments) {
             Key128 k = pack_key(ShapeKey{parse_direction(direction), parse_dtype(dtype), tokens, width, rank, segments});
             return py::make_tuple(k.hi, k.lo);
           }, "The 128-bit key (hi, lo) a shape maps to.");
}
