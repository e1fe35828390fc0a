"""Benchmarks and baselines (``scripts/`` drives them; the bench issue adds
``ggpipe bench``)."""
