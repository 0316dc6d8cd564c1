"""The benchmark scripts, run from the repository root as ``python -m benchmarks.<script>``; shared code in
``benchmarks.common``. Findings of probes that were removed: ``benchmarks/NOTES.md``."""
