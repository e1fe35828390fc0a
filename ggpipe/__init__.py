"""ggpipe: pipeline-parallel GGUF inference over MPI with PipeInfer-style
asynchronous pipelined speculation.

Layout (data flows top to bottom):

    frontends/   click CLI, generate (chat, batch, server later)
    scheduling/  session start-up, the head's Pipeline driver, the worker
                 serve loop, modes (iterative; speculative and pipeinfer
                 later), split planning, sampling
    transport/   MPI transactions: message layouts and the Transport
    runtime/     llama.cpp stage (slice + native hooks), vocabulary
    models/      models.toml registry, fetching, GGUF slicing and derivation
"""

__version__ = "0.1.0"
