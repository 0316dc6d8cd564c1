"""Compile the Triton ATMM kernels (triton_lora.py) ahead of time, for the extension's build.

Reads the ATMM_TRITON_SHRINK / _EXPAND / _EXPAND_COLS lines of tile_configs.def, compiles each (config,
dtype, arch, EVEN) to a cubin with Triton (no GPU needed: Triton's own ptxas does the assembly), and writes one
C++ include file: the cubins as byte arrays and, per config, the launch facts (entry name, shared memory,
warps). EVEN = 1 is the variant without column masks, which triton.cu launches when the widths are whole
tiles and r_max is the config's rank (up to 1.5 us per kernel at T 4096-8192 on the H100, csrc/atmm/NOTES.md).
CMake runs it when the triton package is importable (ATMM_TRITON=auto|on); triton.cu includes the file.

    python3 triton_aot.py --def tile_configs.def --archs "90a" --out gen/atmm_triton_cubins.inc [--jobs N]
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
DTYPES = {"f16": "fp16", "bf16": "bf16"}
SEGS = 256  # segments scanned per step when a program looks for its row tile

EXPAND_ARGS = [("y", "*D"), ("v", "*D"), ("partial", "*fp32"), ("lora_b", "*D"), ("slot_scale", "*fp32"),
               ("slot_rank", "*i32"), ("seg_indptr", "*i32"), ("seg_slot", "*i32"), ("num_segments", "i32"),
               ("num_tokens", "i32"), ("d_out", "i32"), ("r_max", "i32"), ("ld_y", "i32"), ("splits", "i32")]
# name -> (kernel, non-constexpr arguments with their Triton types, constexpr names in order of the def line,
#          fields after warps and stages that only the C++ launcher reads)
KERNELS = {
    "SHRINK": ("lora_shrink",
               [("x", "*D"), ("lora_a", "*D"), ("v", "*D"), ("partial", "*fp32"), ("seg_indptr", "*i32"),
                ("seg_slot", "*i32"), ("num_segments", "i32"), ("num_tokens", "i32"), ("d_in", "i32"),
                ("r_max", "i32"), ("k_chunk", "i32"), ("splits", "i32")],
               ["BM", "BK", "R"], []),
    "EXPAND": ("lora_expand", EXPAND_ARGS, ["BM", "BN", "R", "CH"], []),
    # the stages are also the pipelined loop's own num_stages (NS); waves: grid size in waves of the GPU
    "EXPAND_COLS": ("lora_expand_cols", EXPAND_ARGS, ["BM", "BN", "R"], ["waves"]),
}
# Integer arguments that are multiples of 8 (checked by the extension before any launch).
MULTIPLE_OF_8 = {"d_in", "d_out", "r_max", "k_chunk", "ld_y"}


def parse_def(path: Path) -> list[tuple[str, str, list[int], int, int]]:
    """(direction, name, constexpr values, warps, stages) of every ATMM_TRITON_* line."""
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r"^ATMM_TRITON_(SHRINK|EXPAND_COLS|EXPAND)\(([^)]*)\)", line)
        if not m:
            continue
        f = [s.strip() for s in m.group(2).split(",")]
        _, _, consts, extra = KERNELS[m.group(1)]
        if len(f) != 1 + len(consts) + 2 + len(extra):
            raise SystemExit(f"triton_aot: {line!r}: expected name, {', '.join(consts + ['warps', 'stages'] + extra)}")
        out.append((m.group(1), f[0], [int(v) for v in f[1:1 + len(consts)]], int(f[1 + len(consts)]),
                    int(f[2 + len(consts)])))
    return out


def compile_one(job: tuple) -> tuple:
    direction, name, consts, warps, stages, dt, arch, even = job
    import triton
    from triton.backends.compiler import GPUTarget

    sys.path.insert(0, str(HERE))
    import triton_lora

    kname, args, const_names, _ = KERNELS[direction]
    fn = getattr(triton_lora, kname)
    ty = DTYPES[dt]
    signature = {a: t.replace("*D", "*" + ty) for a, t in args}
    constexprs = dict(zip(const_names, consts))
    constexprs["SEGS"] = SEGS
    constexprs["EVEN"] = bool(even)
    if "NS" in fn.arg_names:
        constexprs["NS"] = stages
    if "PDL" in fn.arg_names:  # the programmatic-dependent-launch waits (off only under Triton's interpreter)
        constexprs["PDL"] = True
    for c in constexprs:
        signature[c] = "constexpr"
    # attrs are keyed by the argument's position in the kernel's own parameter list
    index = {a: i for i, a in enumerate(fn.arg_names)}
    attrs = {}
    for a, t in args:
        if t.startswith("*"):
            attrs[(index[a],)] = [["tt.divisibility", 16]]
        elif a in MULTIPLE_OF_8:
            attrs[(index[a],)] = [["tt.divisibility", 8]]
    src = triton.compiler.ASTSource(fn=fn, signature={a: signature[a] for a in fn.arg_names}, constexprs=constexprs,
                                    attrs=attrs)
    cc = int(arch.rstrip("a"))
    target = GPUTarget("cuda", cc, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": warps, "num_stages": stages})
    k = triton.compile(src, target=target, options=options.__dict__)
    md = k.metadata
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        raise SystemExit(f"triton_aot: {name}/{dt}/{arch} needs a global scratch buffer, which the loader does not give")
    ptx = k.asm["ptx"]
    entry = re.search(r"\.entry\s+(\S+)\s*\((.*?)\)", ptx, re.S)
    n_params = entry.group(2).count(".param")
    # Triton adds two pointer parameters (global and profile scratch) after the kernel's own arguments.
    if n_params != len(args) + 2:
        raise SystemExit(f"triton_aot: {name}/{dt}/{arch}: the entry takes {n_params} parameters, expected {len(args) + 2}")
    return (direction, name, dt, cc, even, md.name, md.shared, warps, bytes(k.asm["cubin"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--def", dest="defs", type=Path, default=HERE / "tile_configs.def")
    ap.add_argument("--archs", default="90a", help="CMake CUDA architectures, e.g. '90a' or '80;90a'")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    a = ap.parse_args(argv)
    lines = parse_def(a.defs)
    archs = [s for s in re.split(r"[;, ]+", a.archs) if s]
    jobs = [(d, n, c, w, s, dt, arch, even) for d, n, c, w, s in lines for dt in DTYPES for arch in archs
            for even in (0, 1)]
    t0 = time.time()
    with ProcessPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        results = list(ex.map(compile_one, jobs))
    body = ["// Generated by csrc/atmm/triton_aot.py from tile_configs.def and triton_lora.py. Do not edit.",
            "// The cubins, then kTritonCubins: {config, dtype, cc, even, entry, shared bytes, warps, cubin}."]
    rows = []
    for i, (d, name, dt, cc, even, entry, shared, warps, blob) in enumerate(results):
        arr = f"atmm_triton_cubin_{i}"
        body.append(f"static const unsigned char {arr}[] = {{{','.join(str(b) for b in blob)}}};")
        rows.append(f'    {{"{name}", DType::k{dt.upper()}, {cc}, {even}, "{entry}", {shared}, {warps}, {arr}}},')
    body += ["static const TritonCubin kTritonCubins[] = {"] + rows + ["};"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text("\n".join(body) + "\n")
    tmp.replace(a.out)
    print(f"triton_aot: {len(results)} cubins ({len(lines)} configs x {len(DTYPES)} dtypes x {len(archs)} archs x 2) "
          f"in {time.time() - t0:.0f} s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
