"""ggpipe: pipeline-parallel GGUF inference over MPI with PipeInfer-style
asynchronous pipelined speculation.

Layout (upper folders use lower ones, never the reverse):

    cli/         the click commands (entry point: ggpipe/__main__.py) and
                 their options
    frontends/   generate, chat, batch; serve/, the OpenAI-compatible server
                 and its front end for --ranks; supervisor.py, the command
                 that starts mpiexec itself and again after a lost rank
    service/     the head's Engine (requests into one loop: the
                 continuous-batching scheduler with --parallel, or one slot
                 run by the mode) and a job's start and end on every rank
    bench/       ggpipe bench: sweeps, baselines, reports, timelines
    sim/         calibrate, simulate, balanced placement: the real decoding
                 loops against measured costs on a virtual clock
    cluster/     session start-up, rank roles, layer split planning, memory,
                 where a job runs again after a lost rank (recovery.py)
    decoding/    the modes (iterative, speculative, pipeinfer, pipedec), each
                 one module that declares itself (mode.py); loop.py, what
                 every request loop speaks; one_at_a_time.py, --parallel 1's
                 one slot; parallel/, the scheduler of --parallel (slots,
                 micro-batches and their token budget, their prompt cache, a
                 lone request's chains and look-ahead rows)
    speculation/ MPI-free speculation logic: speculation tree and graph,
                 verification, KV partitions, cutoff, the draft gate;
                 proposers/ (drafting strategies: draft model, n-gram,
                 staged, vote) behind one protocol
    pipeline/    the head's Pipeline driver, the worker serve loop, prefill chunks
    transport/   MPI transactions: message layouts, the Transport, link
                 emulation, heartbeats (liveness), launcher signals
    models/      models.toml registry, fetching, GGUF slicing and derivation,
                 the batch-row probe
    runtime/     llama.cpp stage (slice + native hooks), kernels, vocabulary
    sampling.py, sampling_params.py, logits.py, kv_reuse.py, metrics.py, trace.py,
    errors.py: shared, pure helpers
"""

__version__ = "0.1.0"
