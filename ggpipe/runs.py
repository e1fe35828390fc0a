"""Run records: one micro-batch travelling through a pipeline (PipeInfer IV.A.1
"state tracking"). Pure data, no MPI.

A run is created right before it starts and kept in the head's FIFO of
in-flight runs until its result (logits) comes back; results return in the
order runs were started, because every stage handles transactions in order.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import numpy as np

from ggpipe.errors import ConfigError
from ggpipe.logits import TopLogits

RUN_ID_MODULUS = 2**31   # run ids travel in int32 message fields (ggpipe.transport.messages): 0..2^31-1
_HALF = RUN_ID_MODULUS // 2


def parse_first_run_id(text: str) -> int:
    """The first run id that ``GGPIPE_FIRST_RUN_ID``'s ``text`` asks for
    (tests start near the wrap-around): a whole number, taken modulo 2^31;
    1 when empty.

    Raises:
        ConfigError: not a whole number.
    """
    v = text.strip()
    if not v:
        return 1
    try:
        return int(v) % RUN_ID_MODULUS
    except ValueError:
        raise ConfigError(f"GGPIPE_FIRST_RUN_ID={text!r}: give a whole number (the first run id)") from None


def _initial_run_id() -> int:
    try:
        return parse_first_run_id(os.environ.get("GGPIPE_FIRST_RUN_ID", ""))
    except ConfigError:
        return 1   # refused when the command starts (ggpipe.env_check), after this module is imported


_next_id = _initial_run_id()
_id_lock = threading.Lock()


def next_run_id() -> int:
    """The next run id, in 0..2^31-1. Ids wrap around after 2^31 runs (at
    one run a millisecond, after 25 days); every rank compares them with
    :func:`run_id_after` (serial-number arithmetic, RFC 1982), which stays
    right across the wrap as long as the runs compared were issued fewer
    than 2^30 runs apart (runs in flight number a few dozen)."""
    global _next_id
    with _id_lock:
        rid = _next_id
        _next_id = (_next_id + 1) % RUN_ID_MODULUS
    return rid


def set_next_run_id(rid: int) -> None:
    """Make ``rid`` the next run id (tests: a session that starts near the wrap-around)."""
    global _next_id
    with _id_lock:
        _next_id = int(rid) % RUN_ID_MODULUS


def run_id_after(a: int, b: int | None) -> bool:
    """Run ``a`` was issued after run ``b`` (None: no run; everything is
    after it): serial-number arithmetic modulo 2^31 (RFC 1982), so that
    run 3 comes after run 2^31-2 once the ids wrapped around."""
    if b is None:
        return True
    return 0 < (int(a) - int(b)) % RUN_ID_MODULUS < _HALF


def latest_run_id(a: int, b: int | None) -> int:
    """The later of runs ``a`` and ``b`` (:func:`run_id_after`; None: ``a``)."""
    return a if run_id_after(a, b) else b


def ubatches(seq_ids, n_ubatch: int) -> list[list[int]]:
    """The ubatches a stage's llama.cpp makes of a batch whose tokens each
    belong to one sequence, on a KV cache of one stream per sequence
    (``kv_unified = false``, the scheduler's slots): a model of
    ``llama_batch_allocr::split_equal(n_ubatch, sequential=true)``
    (src/llama-batch.cpp of the llama.cpp that llama-cpp-python 0.3.36
    vendors). Each ubatch takes, from where the unused tokens begin, a run
    of sequences with consecutive ascending ids (``s, s+1, ...``, none taken
    twice), then the same number of tokens of each (as many as the shortest
    has left, at most ``n_ubatch`` in all), and lists them sequence after
    sequence. Pure.

    Args:
        seq_ids: int (n,) the sequence id of each token, in batch order.
        n_ubatch: most tokens of one ubatch (``llama_context_params.n_ubatch``, >= 1).

    Returns:
        One list of batch indices per ubatch, in the order llama.cpp
        computes their rows.
    """
    seq_ids = [int(s) for s in seq_ids]
    where: dict[int, list[int]] = {}
    for i, s in enumerate(seq_ids):
        where.setdefault(s, []).append(i)
    taken = dict.fromkeys(where, 0)    # tokens of each sequence given to ubatches so far (always its first ones)
    used = [False] * len(seq_ids)
    out: list[list[int]] = []
    start = 0
    while True:
        while start < len(seq_ids) and used[start]:
            start += 1
        if start == len(seq_ids):
            return out
        cur = [seq_ids[start]]
        for i in range(start + 1, len(seq_ids)):
            if len(cur) > n_ubatch:
                break
            if not used[i] and seq_ids[i] == cur[-1] + 1:   # ascending ids: never one already taken
                cur.append(seq_ids[i])
        left = [where[s][taken[s]:] for s in cur]
        k = min(min(map(len, left)), max(1, n_ubatch // len(cur)))   # the loop's stop: (k + 1) * len(cur) > n_ubatch
        ub = []
        for s, idx in zip(cur, left):
            ub += idx[:k]
            taken[s] += k
        for i in ub:
            used[i] = True
        out.append(ub)


def in_batch_order(seq_ids, n_ubatch: int) -> bool:
    """Whether llama.cpp computes a batch's rows in batch order
    (:func:`ubatches` concatenated). True for one sequence's chunk, for one
    token of each of several sequences in ascending id order, and for those
    followed by one sequence's chunk unless that sequence's id fills a gap
    among theirs (it would join the ubatch of the ids below the gap)."""
    return ubatch_order(seq_ids, n_ubatch) is None


def ubatch_order(seq_ids, n_ubatch: int) -> np.ndarray | None:
    """The batch indices of a batch's tokens in the order llama.cpp computes
    their rows on a KV cache of one stream per sequence (:func:`ubatches`
    concatenated), or None where that is batch order (always for one
    sequence's tokens). A non-last stage captures its hidden states ubatch
    after ubatch (ggpipe._native) and puts row ``j`` of the capture back at
    batch index ``order[j]`` (:meth:`ggpipe.runtime.stage.Stage.decode`), so
    a micro-batch may hold any sequences' rows in any order. Pure.

    Args:
        seq_ids: int (n,) the sequence id of each token, in batch order.
        n_ubatch: most tokens of one ubatch (>= 1).

    Returns:
        intp (n,) batch indices, or None.
    """
    s = np.asarray(seq_ids)
    if s.size == 0 or bool((s == s.flat[0]).all()):
        return None
    order = np.fromiter((i for u in ubatches(s.tolist(), n_ubatch) for i in u), dtype=np.intp, count=s.size)
    return None if bool((order == np.arange(s.size)).all()) else order


@dataclass
class Run:
    """A micro-batch and how to read its result.

    Attributes:
        run_id: unique id, carried by every message of the run.
        tokens: int32 (n,) token ids.
        pos: int32 (n,) positions.
        n_seq_id: int32 (n,) sequence ids per token.
        seq_ids: int32 (sum n_seq_id,) KV sequence ids, token by token.
        outputs: int8 (n,) 1 where logits are wanted; the result's logit rows
            follow the order of the tokens flagged here.
        speculative: a speculative run (may be cancelled mid-stream) or a
            non-speculative one (always evaluated in full, PipeInfer IV.D.3).
        tag: free slot for the scheduling policy (e.g. the tree node ids).
        reply_k: what a last stage on another rank returns: 0 full float32
            logit rows; k > 0 the k best tokens of each row and its
            log-sum-exp (ggpipe.logits; set by the pipeline from its
            ``reply_k`` when submitted).
    """

    run_id: int
    tokens: np.ndarray
    pos: np.ndarray
    n_seq_id: np.ndarray
    seq_ids: np.ndarray
    outputs: np.ndarray
    speculative: bool = False
    tag: object = None
    started_at: float = 0.0
    reply_k: int = 0

    @property
    def n_tokens(self) -> int:
        """Tokens in the run."""
        return int(self.tokens.shape[0])

    @property
    def n_outputs(self) -> int:
        """Logit rows the run returns (tokens flagged in ``outputs``)."""
        return int(np.count_nonzero(self.outputs))

    @classmethod
    def linear(cls, tokens, start_pos: int, seq: int = 0, output_last: bool = True,
               run_id: int | None = None, output_all: bool = False, **kw) -> Run:
        """A run of consecutive tokens of one sequence starting at ``start_pos``,
        with logits for its last token only (or none, or with ``output_all``
        for every token)."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        n = tokens.shape[0]
        outputs = np.full(n, int(output_all), dtype=np.int8)
        if output_last:
            outputs[-1] = 1
        return cls(
            run_id=next_run_id() if run_id is None else run_id,
            tokens=tokens,
            pos=np.arange(start_pos, start_pos + n, dtype=np.int32),
            n_seq_id=np.ones(n, dtype=np.int32),
            seq_ids=np.full(n, seq, dtype=np.int32),
            outputs=outputs,
            **kw,
        )

    @classmethod
    def layer(cls, tokens, pos: int, seqs, run_id: int | None = None, **kw) -> Run:
        """A layer of a prediction tree (PipeDec): token i at position
        ``pos`` in sequence ``seqs[i]`` alone, with logits for every token."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        n = tokens.shape[0]
        return cls(
            run_id=next_run_id() if run_id is None else run_id,
            tokens=tokens,
            pos=np.full(n, pos, dtype=np.int32),
            n_seq_id=np.ones(n, dtype=np.int32),
            seq_ids=np.ascontiguousarray(seqs, dtype=np.int32),
            outputs=np.ones(n, dtype=np.int8),
            **kw,
        )


@dataclass
class RunResult:
    """What came back for a run: float32 (n_outputs, n_vocab) logits, their
    compact form (ggpipe.logits.TopLogits, when the run's reply_k > 0 and its
    last stage is on another rank), or nothing if it was cancelled.

    Attributes:
        rows: int32 (n_rows,) batch indices (into the run's tokens) of the
            logit rows, when stages masked rows of the run
            (ggpipe.pipeline.masking); None: one row per output token, in
            batch order.
    """

    run: Run
    logits: np.ndarray | TopLogits | None
    cancelled: bool = False
    finished_at: float = 0.0
    rows: np.ndarray | None = None
