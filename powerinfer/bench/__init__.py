"""Benchmarks run by `powerinfer bench TARGET` (never by the test suite)."""
