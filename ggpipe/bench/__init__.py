"""Benchmarks and baselines: ``ggpipe bench`` (sweeps, reports, timelines)
and the single-node references the exactness tests and ``scripts/`` use."""
