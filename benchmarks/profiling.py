"""Reading profiles of engine steps, for ``benchmarks/engine_floor.py --profile`` / ``--profile-prefill``: the top
kernels by device time, kernels and launch calls per step and the host ops (torch.profiler), where the GPU idles in
each step (its Chrome trace), and the host's Python functions by own time (cProfile); and printing them.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path


def activities(device) -> list:
    """torch.profiler's activities on ``device``: the CPU, and CUDA where it runs."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def kernel_table(prof, steps: int, top: int) -> dict:
    """The top kernels by device time per step, kernels and launch calls per step, from a finished profile."""
    kernels, launches, cpu = [], {}, []
    launch_names = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch",
                    "cudaMemcpyAsync", "cudaMemsetAsync")
    for evt in prof.key_averages():
        dev_us = getattr(evt, "self_device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "self_cuda_time_total", 0)
        is_device = str(getattr(evt, "device_type", "")).endswith("CUDA")
        if is_device and dev_us > 0:
            kernels.append({"name": evt.key[:120], "calls_per_step": evt.count / steps, "us_per_step": dev_us / steps})
        elif evt.key in launch_names:
            launches[evt.key] = evt.count / steps
        if not is_device and getattr(evt, "self_cpu_time_total", 0) > 0:
            cpu.append({"name": evt.key[:120], "calls_per_step": evt.count / steps,
                        "us_per_step": evt.self_cpu_time_total / steps})
    kernels.sort(key=lambda k: -k["us_per_step"])
    cpu.sort(key=lambda k: -k["us_per_step"])
    return {"gpu_kernel_ms_per_step": sum(k["us_per_step"] for k in kernels) / 1e3,
            "kernels_per_step": sum(k["calls_per_step"] for k in kernels), "launch_calls_per_step": launches,
            "top_kernels": kernels[:top], "cpu_ms_per_step": sum(k["us_per_step"] for k in cpu) / 1e3,
            "top_cpu_ops": cpu[:top]}


def gpu_timeline(prof) -> dict:
    """Where each ``vlora_step`` window of a finished profile leaves the GPU idle (ms per step, mean): before
    its first kernel (the host's preparation), between kernels (the host behind the GPU), after its last
    kernel (read-back and the host's bookkeeping). From the profile's Chrome trace."""
    import os
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text()).get("traceEvents", [])
    finally:
        os.unlink(path)
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "vlora_step" and e.get("ph") == "X"
             and e.get("cat") == "user_annotation"]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    rows = []
    for a, b in steps:
        ks = [(x, y) for x, y in kernels if a <= x < b]
        if not ks:
            continue
        gaps, end = 0.0, ks[0][0]
        for x, y in ks:
            gaps += max(0.0, x - end)
            end = max(end, y)
        rows.append({"wall": b - a, "before_first": ks[0][0] - a, "between": gaps, "after_last": b - end,
                     "busy": sum(y - x for x, y in ks)})
    if not rows:
        return {}
    return {k: statistics.mean(r[k] for r in rows) / 1e3 for k in rows[0]} | {"steps": len(rows)}


def python_rows(prof, steps: int, top: int) -> list[dict]:
    """A finished cProfile.Profile over ``steps`` steps: the ``2 * top`` functions with the most own time per step."""
    import pstats

    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        rows.append({"name": f"{Path(file).name}:{line}({fn})", "calls_per_step": nc / steps,
                     "own_us_per_step": 1e6 * tt / steps, "cum_us_per_step": 1e6 * ct / steps})
    rows.sort(key=lambda r: -r["own_us_per_step"])
    return rows[:2 * top]


def print_profile(p: dict) -> None:
    print(f"\nprofile: {p.get('what', 'decode')} bs{p['batch']} ctx{p['context']}, {p['steps']} steps: wall {p['cpu_wall_ms_per_step']:.2f} ms/step "
          f"unprofiled ({p['profiled_wall_ms_per_step']:.2f} profiled), GPU kernels {p['gpu_kernel_ms_per_step']:.2f} ms/step, "
          f"{p['kernels_per_step']:.0f} kernels/step; launch calls/step: "
          + ", ".join(f"{k} {v:.0f}" for k, v in sorted(p["launch_calls_per_step"].items())), flush=True)
    for k in p["top_kernels"]:
        print(f"  {k['us_per_step']:9.1f} us/step  {k['calls_per_step']:6.1f} calls/step  {k['name']}", flush=True)
    if p.get("timeline"):
        t = p["timeline"]
        print(f"  GPU timeline per step (profiled): wall {t['wall']:.2f} ms, kernels {t['busy']:.2f}; GPU idle "
              f"{t['before_first']:.2f} before the first kernel, {t['between']:.2f} between kernels, "
              f"{t['after_last']:.2f} after the last", flush=True)
    if p.get("python"):
        print("  host Python, own time (cumulative) per step:", flush=True)
        for k in p["python"]:
            print(f"  {k['own_us_per_step']:9.1f} us ({k['cum_us_per_step']:9.1f})  {k['calls_per_step']:7.1f} calls  {k['name']}", flush=True)
    if p.get("top_cpu_ops"):
        print(f"  host: {p['cpu_ms_per_step']:.2f} ms/step of self CPU time in profiled ops; the top ones:", flush=True)
        for k in p["top_cpu_ops"]:
            print(f"  {k['us_per_step']:9.1f} us/step  {k['calls_per_step']:6.1f} calls/step  {k['name']}", flush=True)
