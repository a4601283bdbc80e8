"""Triton GPU kernels (imported lazily: triton is an optional, Linux x86-64 dependency)."""
