"""Benchmark harness: evaluation datasets (``datasets``), runs and plots."""
