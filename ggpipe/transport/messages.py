"""Message layouts of ggpipe's pipeline transactions (PipeInfer IV.A.2).

Pure numpy encode/decode, no MPI. A transaction starts with a *start message*
sent with the MPI tag of its type; every further message of the transaction
uses the same tag, so MPI's non-overtaking rule (same sender, receiver and
tag) keeps them in order. Receivers take start messages with ``ANY_TAG``, which
also preserves the order of transactions between two ranks.

Every start message is a 1-D int32 array that begins with the common prefix

    [0] MAGIC (0x6770, "gp")   [1] transaction type (== MPI tag)   [2] run id

followed by the type's own fields, documented on each encoder below. Decoders
validate magic, type, lengths, counts and ranges and raise ProtocolError; they
never index past the received array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ggpipe.errors import ProtocolError
from ggpipe.logits import MAX_REPLY_K

MAGIC = 0x6770

# Transaction types; each is also the MPI tag of all its messages.
T_DECODE = 1     # head -> ... -> last stage: evaluate a micro-batch
T_LOGITS = 2     # last stage -> head: logits of a finished run
T_KV = 3         # head -> ... -> last stage: KV cache operation, pipelined
T_SHUTDOWN = 4   # head -> ... -> last stage: stop serving
T_STATS = 5      # any rank -> head: pickled per-rank statistics (after shutdown)
T_HELLO = 6      # worker -> head at start: config hash, host (pickled dict)
T_READY = 7      # worker -> head after loading: ok / error text (pickled dict)
T_GO = 8         # head -> worker: start serving, or abort (pickled dict)
T_CANCEL = 9     # head -> stages (backwards): cancel a run (e.g. a rejected speculation)
T_PRUNE = 10     # head -> stages (backwards): mask dead rows of runs in flight (PipeDec 3.3.4)

TYPE_NAMES = {
    T_DECODE: "decode", T_LOGITS: "logits", T_KV: "kv", T_SHUTDOWN: "shutdown", T_STATS: "stats",
    T_HELLO: "hello", T_READY: "ready", T_GO: "go", T_CANCEL: "cancel", T_PRUNE: "prune",
}

# Payload kinds of a decode transaction.
PAYLOAD_NONE = 0    # cancelled run: no payload message follows (placeholder)
PAYLOAD_TOKENS = 1  # int32 (n,) token ids (a pipeline's first stage)
PAYLOAD_EMBD = 2    # float32 (n, n_embd) hidden states

# Values of a decode header's per-token ``outputs`` flags.
OUT_NONE = 0        # evaluate, return no logits
OUT_LOGITS = 1      # evaluate, return its logits
OUT_DROPPED = 2     # masked by a stage upstream (T_PRUNE): neither evaluated nor returned, no payload row

_PREFIX = 3
LOGITS_FIXED = 8  # ints of a logits start message before its optional row indices
DECODE_FIXED = 7  # ints of a decode start message before its per-token arrays


def _check_prefix(msg: np.ndarray, ttype: int, min_len: int) -> None:
    if msg.dtype != np.int32 or msg.ndim != 1:
        raise ProtocolError(f"{TYPE_NAMES.get(ttype, ttype)} start message: expected int32 vector, got {msg.dtype}{msg.shape}")
    if msg.shape[0] < max(min_len, _PREFIX):
        raise ProtocolError(f"{TYPE_NAMES.get(ttype, ttype)} start message too short ({msg.shape[0]} ints)")
    if int(msg[0]) != MAGIC:
        raise ProtocolError(f"bad magic {int(msg[0]):#x} in a {TYPE_NAMES.get(ttype, ttype)} message")
    if int(msg[1]) != ttype:
        raise ProtocolError(f"message of type {int(msg[1])} arrived with tag {ttype}")


@dataclass
class DecodeHeader:
    """A micro-batch to evaluate (one *run* of a pipeline).

    Attributes:
        run_id: unique id of the run (head-assigned, increasing).
        pos: int32 (n,) token positions.
        n_seq_id: int32 (n,) number of sequence ids per token.
        seq_ids: int32 (sum n_seq_id,) the KV sequence ids, token by token.
        outputs: int8 (n,) OUT_LOGITS (1) where the last stage must return
            logits, OUT_NONE (0) elsewhere; OUT_DROPPED (2) marks a row a
            stage upstream masked (ggpipe.pipeline.masking): the payload
            carries no row for it.
        payload: PAYLOAD_NONE / PAYLOAD_TOKENS / PAYLOAD_EMBD.
        reply_k: 0: the last stage returns full float32 logit rows; k in
            1..MAX_REPLY_K: per row the k best token ids, their logits and
            the row's log-sum-exp (ggpipe.logits; greedy decoding).
    """

    run_id: int
    pos: np.ndarray
    n_seq_id: np.ndarray
    seq_ids: np.ndarray
    outputs: np.ndarray
    payload: int
    reply_k: int = 0

    @property
    def n_tokens(self) -> int:
        """Tokens in the transaction."""
        return int(self.pos.shape[0])

    @property
    def n_outputs(self) -> int:
        """Rows whose logits the last stage returns."""
        return int(np.count_nonzero(self.outputs == OUT_LOGITS))

    @property
    def n_live(self) -> int:
        """Rows not masked upstream: the payload's row count."""
        return int(np.count_nonzero(self.outputs != OUT_DROPPED))


def encode_decode(h: DecodeHeader) -> np.ndarray:
    """Start message of a decode transaction, int32:

        [MAGIC, T_DECODE, run_id, n, n_seq_total, payload, reply_k,
         pos[0..n), n_seq_id[0..n), seq_ids[0..n_seq_total), outputs[0..n)]

    It is followed (same tag) by one payload message unless payload is
    PAYLOAD_NONE: int32 (n_live,) token ids, or float32 (n_live * n_embd,)
    hidden states, row-major, one row of n_embd per token not flagged
    OUT_DROPPED, in batch order.
    """
    n = h.n_tokens
    total = int(h.seq_ids.shape[0])
    out = np.empty(DECODE_FIXED + 3 * n + total, dtype=np.int32)
    out[:DECODE_FIXED] = (MAGIC, T_DECODE, h.run_id, n, total, h.payload, h.reply_k)
    o = DECODE_FIXED
    out[o:o + n] = h.pos
    o += n
    out[o:o + n] = h.n_seq_id
    o += n
    out[o:o + total] = h.seq_ids
    o += total
    out[o:o + n] = h.outputs
    return out


def decode_decode(msg: np.ndarray, n_seq_max: int, max_tokens: int) -> DecodeHeader:
    """Parse and validate a decode start message (see :func:`encode_decode`).

    Raises:
        ProtocolError: wrong magic/type, inconsistent lengths, a token count
            outside 1..max_tokens, sequence ids outside 0..n_seq_max-1,
            negative positions, an unknown payload kind, a reply_k
            outside 0..MAX_REPLY_K, an output flag outside 0..2, or a
            payload announced for a run whose every row is masked.
    """
    _check_prefix(msg, T_DECODE, DECODE_FIXED)
    run_id, n, total, payload, reply_k = (int(x) for x in msg[2:DECODE_FIXED])
    if not 1 <= n <= max_tokens:
        raise ProtocolError(f"decode run {run_id}: {n} tokens (1..{max_tokens} allowed)")
    if total < n or total > n * n_seq_max:
        raise ProtocolError(f"decode run {run_id}: {total} sequence ids for {n} tokens")
    if msg.shape[0] != DECODE_FIXED + 3 * n + total:
        raise ProtocolError(f"decode run {run_id}: start message has {msg.shape[0]} ints, "
                            f"expected {DECODE_FIXED + 3 * n + total}")
    if payload not in (PAYLOAD_NONE, PAYLOAD_TOKENS, PAYLOAD_EMBD):
        raise ProtocolError(f"decode run {run_id}: unknown payload kind {payload}")
    if not 0 <= reply_k <= MAX_REPLY_K:
        raise ProtocolError(f"decode run {run_id}: reply_k {reply_k} (0..{MAX_REPLY_K} allowed)")
    o = DECODE_FIXED
    pos = msg[o:o + n].copy()
    o += n
    n_seq_id = msg[o:o + n].copy()
    o += n
    seq_ids = msg[o:o + total].copy()
    o += total
    outputs = msg[o:o + n]
    if (pos < 0).any():
        raise ProtocolError(f"decode run {run_id}: negative position")
    if (n_seq_id < 1).any() or (n_seq_id > n_seq_max).any() or int(n_seq_id.sum()) != total:
        raise ProtocolError(f"decode run {run_id}: bad per-token sequence counts")
    if (seq_ids < 0).any() or (seq_ids >= n_seq_max).any():
        raise ProtocolError(f"decode run {run_id}: sequence id outside 0..{n_seq_max - 1}")
    if ((outputs < OUT_NONE) | (outputs > OUT_DROPPED)).any():
        raise ProtocolError(f"decode run {run_id}: output flags must be 0, 1 or 2")
    if payload != PAYLOAD_NONE and (outputs == OUT_DROPPED).all():
        raise ProtocolError(f"decode run {run_id}: a payload for a run whose every row was masked")
    return DecodeHeader(run_id, pos, n_seq_id, seq_ids, outputs.astype(np.int8), payload, reply_k)


@dataclass
class LogitsHeader:
    """Result of a run, sent by a pipeline's last stage to the head.

    Attributes:
        run_id: the run these logits belong to.
        n_outputs: rows of logits that follow (0: no payload message).
        n_vocab: the vocabulary size (a full row's length).
        cancelled: 1 if the run was cancelled (no payload).
        top_k: 0: full rows follow; k > 0: compact rows (the run's reply_k,
            capped at n_vocab), ggpipe.logits.pack's layout.
        rows: int32 (n_outputs,) the batch index (0..n-1 of the run as the
            head sent it) of each returned row, when a stage masked rows of
            the run (T_PRUNE); None: the rows are the run's output rows, all
            of them, in batch order.
    """

    run_id: int
    n_outputs: int
    n_vocab: int
    cancelled: int = 0
    top_k: int = 0
    rows: np.ndarray | None = None

    def __eq__(self, other) -> bool:
        if not isinstance(other, LogitsHeader):
            return NotImplemented
        same_rows = (self.rows is None and other.rows is None) or (
            self.rows is not None and other.rows is not None and np.array_equal(self.rows, other.rows))
        return (self.run_id, self.n_outputs, self.n_vocab, self.cancelled, self.top_k) == (
            other.run_id, other.n_outputs, other.n_vocab, other.cancelled, other.top_k) and same_rows

    @property
    def row_floats(self) -> int:
        """float32 values per row of the payload."""
        return self.n_vocab if self.top_k == 0 else 2 * self.top_k + 1


def encode_logits(h: LogitsHeader) -> np.ndarray:
    """Start message of a logits transaction, int32:
    ``[MAGIC, T_LOGITS, run_id, n_outputs, n_vocab, cancelled, top_k, masked,
    rows[0..n_outputs) if masked]``, followed (same tag), when n_outputs > 0,
    by float32 (n_outputs * row_floats,): full logit rows (top_k 0) or
    compact ones (ggpipe.logits.pack), row-major in batch order of the
    returned rows."""
    head = [MAGIC, T_LOGITS, h.run_id, h.n_outputs, h.n_vocab, h.cancelled, h.top_k, int(h.rows is not None)]
    if h.rows is None:
        return np.array(head, dtype=np.int32)
    return np.concatenate([np.array(head, dtype=np.int32), np.asarray(h.rows, dtype=np.int32)])


def decode_logits(msg: np.ndarray, n_vocab: int, max_outputs: int) -> LogitsHeader:
    """Parse and validate a logits start message.

    Raises:
        ProtocolError: wrong layout, vocabulary size, output count, or
            row indices that are negative or not increasing.
    """
    _check_prefix(msg, T_LOGITS, LOGITS_FIXED)
    run_id, n_outputs, n_vocab_got, cancelled, top_k, masked = (int(x) for x in msg[2:LOGITS_FIXED])
    if masked not in (0, 1):
        raise ProtocolError(f"logits of run {run_id}: bad masked flag {masked}")
    expect = LOGITS_FIXED + (n_outputs if masked else 0)
    if n_outputs < 0 or msg.shape[0] != expect:
        raise ProtocolError(f"logits start message has {msg.shape[0]} ints, expected {expect}")
    rows = None
    if masked:
        rows = msg[LOGITS_FIXED:].copy()
        if (rows < 0).any() or (n_outputs > 1 and (np.diff(rows) <= 0).any()):
            raise ProtocolError(f"logits of run {run_id}: row indices must be increasing and non-negative")
    h = LogitsHeader(run_id, n_outputs, n_vocab_got, cancelled, top_k, rows)
    if h.n_vocab != n_vocab:
        raise ProtocolError(f"logits of run {h.run_id}: n_vocab {h.n_vocab}, expected {n_vocab}")
    if not 0 <= h.n_outputs <= max_outputs:
        raise ProtocolError(f"logits of run {h.run_id}: {h.n_outputs} rows (0..{max_outputs} allowed)")
    if h.cancelled not in (0, 1) or (h.cancelled and h.n_outputs):
        raise ProtocolError(f"logits of run {h.run_id}: bad cancelled flag")
    if not 0 <= h.top_k <= min(MAX_REPLY_K, n_vocab):
        raise ProtocolError(f"logits of run {h.run_id}: top_k {h.top_k} (0..{min(MAX_REPLY_K, n_vocab)} allowed)")
    return h


@dataclass
class KvHeader:
    """A KV cache operation (``llama_memory_*``), applied by every stage in
    pipeline order. Codes are ggpipe.runtime.stage.KV_*; positions are
    half-open [p0, p1), -1 meaning open-ended."""

    op: int
    seq: int = -1
    seq_dst: int = -1
    p0: int = -1
    p1: int = -1
    delta: int = 0
    run_id: int = 0


N_KV_OPS = 5


def encode_kv(h: KvHeader) -> np.ndarray:
    """Start (and only) message of a KV transaction, int32:
    ``[MAGIC, T_KV, run_id, op, seq, seq_dst, p0, p1, delta]``."""
    return np.array([MAGIC, T_KV, h.run_id, h.op, h.seq, h.seq_dst, h.p0, h.p1, h.delta], dtype=np.int32)


def decode_kv(msg: np.ndarray, n_seq_max: int) -> KvHeader:
    """Parse and validate a KV start message.

    Raises:
        ProtocolError: wrong layout, unknown op, sequence id out of range.
    """
    _check_prefix(msg, T_KV, 9)
    if msg.shape[0] != 9:
        raise ProtocolError(f"kv message has {msg.shape[0]} ints, expected 9")
    run_id, op, seq, seq_dst, p0, p1, delta = (int(x) for x in msg[2:9])
    if not 0 <= op < N_KV_OPS:
        raise ProtocolError(f"unknown KV op {op}")
    for s in (seq, seq_dst):
        if not -1 <= s < n_seq_max:
            raise ProtocolError(f"KV op {op}: sequence id {s} outside -1..{n_seq_max - 1}")
    if p0 < -1 or p1 < -1:
        raise ProtocolError(f"KV op {op}: bad positions [{p0}, {p1})")
    return KvHeader(op, seq, seq_dst, p0, p1, delta, run_id)


def encode_prune(pairs) -> np.ndarray:
    """Start (and only) message of a prune transaction, int32:
    ``[MAGIC, T_PRUNE, 0, n, run_0, seq_0, ..., run_{n-1}, seq_{n-1}]``: in
    run ``run_i`` (not yet evaluated), rows whose every sequence id is
    pruned are dead (ggpipe.pipeline.masking). One message carries every
    pair one decision produced, so each stage learns them together."""
    flat = [x for pair in pairs for x in pair]
    return np.array([MAGIC, T_PRUNE, 0, len(flat) // 2, *flat], dtype=np.int32)


def decode_prune(msg: np.ndarray, n_seq_max: int) -> list[tuple[int, int]]:
    """Parse and validate a prune message: its (run id, sequence id) pairs.

    Raises:
        ProtocolError: wrong layout, a negative run id or a sequence id
            outside 1..n_seq_max-1 (sequence 0 holds accepted tokens: never pruned).
    """
    _check_prefix(msg, T_PRUNE, 4)
    n = int(msg[3])
    if n < 0 or msg.shape[0] != 4 + 2 * n:
        raise ProtocolError(f"prune message has {msg.shape[0]} ints for {n} pairs")
    pairs = msg[4:].reshape(n, 2)
    if (pairs[:, 0] < 0).any():
        raise ProtocolError("prune message: negative run id")
    if ((pairs[:, 1] < 1) | (pairs[:, 1] >= n_seq_max)).any():
        raise ProtocolError(f"prune message: sequence id outside 1..{n_seq_max - 1}")
    return [(int(r), int(s)) for r, s in pairs]


def encode_simple(ttype: int, run_id: int = 0) -> np.ndarray:
    """Start message with no fields beyond the prefix (shutdown, cancel):
    int32 ``[MAGIC, type, run_id]``."""
    return np.array([MAGIC, ttype, run_id], dtype=np.int32)


def decode_simple(msg: np.ndarray, ttype: int) -> int:
    """Validate a prefix-only message; returns its run id."""
    _check_prefix(msg, ttype, 3)
    if msg.shape[0] != 3:
        raise ProtocolError(f"{TYPE_NAMES[ttype]} message has {msg.shape[0]} ints, expected 3")
    return int(msg[2])
