"""The settings every rank of a job shares (:class:`ClusterConfig`, whose
digest the ranks compare at start-up) and the reading of its ``-t`` value."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from ggpipe.errors import ConfigError


@dataclass(frozen=True)
class ClusterConfig:
    """Settings every rank must share (their digest is compared at start-up).

    Attributes:
        model: registry name or GGUF path of the target model.
        draft_model: the draft model (speculation modes), or None; several
            draft models, each on ranks of its own, for a vote: comma-separated
            (``-md a,b``; :attr:`draft_models`).
        split: ``--split`` text (PipeInfer syntax), or None for an even split.
        threads: ``-t``: one thread count for every rank, or one per rank
            ("2,1,1").
        ctx_size: KV cache cells per stage (tokens).
        n_seq_max: KV sequence ids per context (1..256).
        ubatch: tokens per micro-batch (n_batch = n_ubatch).
        timeout_s: bound of every wait inside a transaction, seconds.
        load_timeout_s: bound of start-up waits (fetching, slicing, loading).
        liveness_timeout_s: heartbeat silence after which a rank counts as
            dead or stuck and the job is stopped (ggpipe.transport.liveness);
            it also bounds a worker's wait between transactions, which has no
            time-out of its own (a chat or server may idle for days).
        flash_attn: ``-fa``: "off" (the exactness reference), "on", "auto".
        kv_unified: one KV buffer for every sequence (the speculative modes'
            partitions need it); False: one KV stream per sequence, of
            ``ctx_size / n_seq_max`` cells (``--parallel`` slots: a slot's
            cells never sit among another's).
    """

    model: str
    draft_model: str | None = None
    split: str | None = None
    threads: str = "1"
    ctx_size: int = 2048
    n_seq_max: int = 1
    ubatch: int = 512
    timeout_s: float = 60.0
    load_timeout_s: float = 900.0
    liveness_timeout_s: float = 6.0
    flash_attn: str = "off"
    kv_unified: bool = True

    @property
    def draft_models(self) -> list[str]:
        """The draft models in ``-md`` order ([] for none)."""
        if self.draft_model is None:
            return []
        return [m.strip() for m in self.draft_model.split(",")]

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def parse_threads(text: str, n_ranks: int) -> list[int]:
    """``-t`` value -> threads per rank.

    Raises:
        ConfigError: not positive integers, or a list of the wrong length.
    """
    try:
        vals = [int(x) for x in str(text).split(",")]
    except ValueError:
        raise ConfigError(f"-t must be a thread count or a comma-separated list, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise ConfigError(f"-t: thread counts must be at least 1, got {text!r}")
    if len(vals) == 1:
        return vals * n_ranks
    if len(vals) != n_ranks:
        raise ConfigError(f"-t lists {len(vals)} thread counts but the job has {n_ranks} ranks")
    return vals
