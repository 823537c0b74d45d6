"""Benchmarks: one module per benchmark."""
