"""ggpipe: pipeline-parallel GGUF inference over MPI with PipeInfer-style
asynchronous pipelined speculation.

Layout (data flows top to bottom):

    frontends/   click CLI (entry point: ggpipe/__main__.py), generate, chat,
                 batch, OpenAI-compatible server, plan, bench; one Engine
    scheduling/  session start-up, the head's Pipeline driver, the worker
                 serve loop, modes (iterative, speculative, pipeinfer), split
                 planning, sampling
    speculation/ MPI-free speculation logic: draft proposer, speculation
                 tree and graph, verification, KV partitions, cutoff
    transport/   MPI transactions: message layouts, the Transport, link
                 emulation, heartbeats (liveness), launcher signals
    runtime/     llama.cpp stage (slice + native hooks), vocabulary
    models/      models.toml registry, fetching, GGUF slicing and derivation
    bench/       ggpipe bench: sweeps, baselines, reports, timelines
"""

__version__ = "0.1.0"
