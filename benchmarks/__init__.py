"""The benchmark scripts, run from the repository root as ``python -m benchmarks.<script>``; shared code in
``benchmarks.common`` (``floors``, ``profiling``, ``engine_floor_report`` and ``orchestrator_report`` are parts of
``engine_floor`` and ``orchestrator``). Findings of probes that were removed: ``benchmarks/NOTES.md``."""
