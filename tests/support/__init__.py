"""Test support shared by the interop, differential, error and CLI tests and the benchmarks."""
