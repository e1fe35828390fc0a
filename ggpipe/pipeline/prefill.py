"""How a prompt goes down the pipeline: its chunks (pipelined prefill,
PipeInfer IV.C's runs applied to the prompt). Pure arithmetic, no MPI.

One stage computes one chunk at a time, so with S stages and k chunks a
prompt takes about (k + S - 1) chunk-steps: the first chunk crosses every
stage before the last stage has work, and the last chunk does so again
after the first stage is done. With k = ceil(n / n_ubatch) chunks of
``--ubatch`` (512) tokens, a 1,700-token prompt on 2 stages is 4 chunks, and
a stage waits for one chunk-step in five. More, smaller chunks keep the
stages busy together, but each chunk streams the stage's weights once and
pays a hop, so chunks stay at least :data:`MIN_CHUNK` tokens. Measured at
2 ranks x 1 thread on a 1,700-token F16 prompt (docs/benchmarks/kernels.md):
chunks of 512, 128 and 64 tokens gave 251, 260 and 269 prompt tok/s.

:func:`prefill_chunks`: with more than one stage, at least
:data:`CHUNKS_PER_STAGE` chunks per stage where the prompt allows chunks of
:data:`MIN_CHUNK` tokens or more, never more than ``n_ubatch`` tokens each,
sizes as even as possible (they differ by at most one token, so no chunk is
a lone token, whose rows llama.cpp computes with other kernels than a
batch's). One stage: chunks of ``n_ubatch``, as llama.cpp decodes a prompt.
"""

from __future__ import annotations

MIN_CHUNK = 64
CHUNKS_PER_STAGE = 16


def prefill_chunks(n: int, n_ubatch: int, n_stages: int) -> list[int]:
    """Sizes (tokens, in order, summing to ``n``) of the runs that carry an
    ``n``-token prompt through ``n_stages`` stages, each at most ``n_ubatch``.

    Raises:
        ValueError: ``n`` < 0, or ``n_ubatch`` or ``n_stages`` < 1.
    """
    if n < 0 or n_ubatch < 1 or n_stages < 1:
        raise ValueError(f"prefill_chunks({n}, {n_ubatch}, {n_stages}): need n >= 0, n_ubatch >= 1, n_stages >= 1")
    if n == 0:
        return []
    if n_stages == 1:
        return [min(n_ubatch, n - i) for i in range(0, n, n_ubatch)]
    k = max(-(-n // n_ubatch), min(n // MIN_CHUNK, CHUNKS_PER_STAGE * n_stages), 1)
    base, extra = divmod(n, k)
    return [base + 1] * extra + [base] * (k - extra)


def submit_chunks(backend, tokens, start_pos: int, n_ubatch: int, seq: int = 0, want_logits: bool = True) -> int:
    """Start ``tokens`` (int (n,)) at positions start_pos.. of sequence
    ``seq`` on ``backend`` (its ``decode(tokens, start_pos, seq=, logits_last=)``
    and ``n_stages``) as the runs :func:`prefill_chunks` sizes, back to back;
    with ``want_logits`` the last asks for its last token's logits. Returns
    the number of runs started (nothing is waited for)."""
    chunks = prefill_chunks(len(tokens), n_ubatch, backend.n_stages)
    i = 0
    for k, size in enumerate(chunks):
        backend.decode(tokens[i:i + size], start_pos + i, seq=seq, logits_last=want_logits and k == len(chunks) - 1)
        i += size
    return len(chunks)
