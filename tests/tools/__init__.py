"""What is around the library: the benchmark scripts (``benchmarks/``), the example (``examples/``) and the README's
result tables."""
