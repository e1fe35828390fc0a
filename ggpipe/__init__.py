"""ggpipe: pipeline-parallel GGUF inference over MPI with PipeInfer-style
asynchronous pipelined speculation.

Layout (data flows top to bottom):

    frontends/   click CLI (entry point: ggpipe/__main__.py), generate, chat,
                 batch, OpenAI-compatible server, plan, bench; one Engine
    cluster/     session start-up, rank roles, layer split planning
    decoding/    modes: iterative; the speculative loop (speculative,
                 pipeinfer), which knows proposers only by their protocol
    speculation/ MPI-free speculation logic: speculation tree and graph,
                 verification, KV partitions, cutoff; proposers/ (drafting
                 strategies: draft model, n-gram) behind one protocol
    pipeline/    the head's Pipeline driver, the worker serve loop, run records
    transport/   MPI transactions: message layouts, the Transport, link
                 emulation, heartbeats (liveness), launcher signals
    runtime/     llama.cpp stage (slice + native hooks), vocabulary
    models/      models.toml registry, fetching, GGUF slicing and derivation
    bench/       ggpipe bench: sweeps, baselines, reports, timelines
    sampling.py, kv_reuse.py, metrics.py, trace.py, errors.py: shared, pure helpers
"""

__version__ = "0.1.0"
