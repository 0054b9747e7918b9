"""Benchmark suites (`kinject bench ...`), one module per suite."""
