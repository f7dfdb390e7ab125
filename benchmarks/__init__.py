"""The benchmark scripts. Run them as files (python benchmarks/bench_flce.py); this file makes
``benchmarks._common`` resolve to this folder ahead of any other installed "benchmarks" package."""
