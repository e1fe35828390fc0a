"""The settings every rank of a job shares (:class:`ClusterConfig`, whose
digest the ranks compare at start-up) and the reading of its ``-t`` value."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from ggpipe.errors import ConfigError


def draft_model_list(draft_model: str | None) -> list[str]:
    """``-md a,b`` -> the draft models in order ([] for none)."""
    if draft_model is None:
        return []
    return [m.strip() for m in draft_model.split(",")]


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
        ubatch: ``-ub/--ubatch``, tokens a stage computes at once
            (llama.cpp's ``n_ubatch``; a larger micro-batch is split).
        batch_size: ``-b/--batch-size``, the most tokens of one
            micro-batch (llama.cpp's ``n_batch``: the token budget a step
            shares between generating requests and prompt chunks, and the
            prefill chunk of one request at a time); None: ``ubatch``, at
            most the context (:attr:`n_batch`).
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
        cache_type_k, cache_type_v: ``-ctk``/``-ctv``, KV cache types with
            llama.cpp's names (f16 default, its own; q8_0 halves the KV
            cache; a quantized V needs ``-fa on|auto``).
        cache_type_k_draft, cache_type_v_draft: ``-ctkd``/``-ctvd``, the
            draft models' KV types; None: the target's (-ctk/-ctv). llama.cpp's
            speculative tools default theirs to f16 instead: ggpipe's draft
            ranks take the same memory check as the target's, and the
            draft's KV types never change the greedy tokens (the target
            verifies), only how many drafts it accepts.
        mlock: ``--mlock``, keep the weights in RAM.
        no_mmap: ``--no-mmap``, read the weights instead of mapping them.
        numa: ``--numa`` (distribute, isolate, numactl) or None.
        exact: ``--exact``: bit-exact speculation; needs a llama.cpp built
            without llamafile's sgemm and turns the extra buffer types off
            (:meth:`check_build`).
        repack: llama.cpp's extra buffer types (repacked weights) on; False:
            ``--no-repack``, llama.cpp's option of that name.
    """

    model: str
    draft_model: str | None = None
    split: str | None = None
    threads: str = "1"
    ctx_size: int = 2048
    n_seq_max: int = 1
    ubatch: int = 512
    batch_size: int | None = None
    timeout_s: float = 60.0
    load_timeout_s: float = 900.0
    liveness_timeout_s: float = 6.0
    flash_attn: str = "off"
    kv_unified: bool = True
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    cache_type_k_draft: str | None = None
    cache_type_v_draft: str | None = None
    mlock: bool = False
    no_mmap: bool = False
    numa: str | None = None
    exact: bool = False
    repack: bool = True

    @property
    def n_batch(self) -> int:
        """The most tokens of one micro-batch: ``batch_size``, else
        ``ubatch`` but no more than the context (as llama.cpp cuts its
        ``n_batch`` to ``n_ctx``)."""
        return self.batch_size if self.batch_size is not None else min(self.ubatch, self.ctx_size)

    def check_batch(self) -> None:
        """Refuse a token budget llama.cpp cannot take, in one line, before
        anything loads.

        Raises:
            ConfigError: ``-ub`` or ``-b`` below one token, or ``-b``
                given larger than the context (``-c``)."""
        if self.ubatch < 1:
            raise ConfigError(f"--ubatch must be at least 1 token, got {self.ubatch}")
        if self.n_batch < 1:
            raise ConfigError(f"--batch-size must be at least 1 token, got {self.n_batch}")
        if self.n_batch > self.ctx_size:
            raise ConfigError(f"--batch-size {self.n_batch} is larger than the context (-c {self.ctx_size}): a "
                              f"micro-batch cannot hold more tokens than the KV cache has cells; lower -b or raise -c")

    @property
    def extra_bufts(self) -> bool:
        """Whether stages load their weights with llama.cpp's extra buffer
        types (ggpipe.runtime.kernels): ``repack`` and not ``exact``."""
        return self.repack and not self.exact

    def check_build(self) -> None:
        """Refuse ``--exact`` on a llama.cpp build that cannot give it, in
        one line naming the fix, before any weights load.

        Raises:
            BuildError: ``exact`` and the build has llamafile's sgemm.
        """
        from ggpipe.runtime.llama import EXACT_INSTALL, llamafile_sgemm  # noqa: PLC0415

        if self.exact and llamafile_sgemm():
            from ggpipe.errors import BuildError  # noqa: PLC0415

            raise BuildError(f"--exact needs llama-cpp-python built without llamafile's sgemm (this one has it, "
                             f"so a batch's rows and a lone token's differ in their last bits); install it with: "
                             f"{EXACT_INSTALL}")

    @property
    def draft_cache_types(self) -> tuple[str, str]:
        """(K, V) cache types of the draft models' stages: -ctkd/-ctvd, else -ctk/-ctv."""
        return (self.cache_type_k_draft or self.cache_type_k, self.cache_type_v_draft or self.cache_type_v)

    def check_cache_types(self) -> None:
        """Refuse KV cache types llama.cpp would refuse (a quantized V cache
        with ``-fa off``), target's and draft's, in one line.

        Raises:
            ConfigError: naming the option and ``-fa on``.
        """
        from ggpipe.runtime.stage import check_cache_types  # noqa: PLC0415

        check_cache_types(self.cache_type_k, self.cache_type_v, self.flash_attn)
        if self.draft_model is not None:
            check_cache_types(*self.draft_cache_types, self.flash_attn,
                              opts=("-ctkd" if self.cache_type_k_draft else "-ctk",
                                    "-ctvd" if self.cache_type_v_draft else "-ctv"))

    @property
    def slot_cells(self) -> int:
        """KV cells of one ``--parallel`` slot (one stream per sequence):
        ``ctx_size / n_seq_max`` rounded up to 256, as llama.cpp rounds a
        stream."""
        per_slot = -(-self.ctx_size // self.n_seq_max)
        return -(-per_slot // 256) * 256

    @property
    def request_cells(self) -> int:
        """KV cells one request may fill: one slot's (:attr:`slot_cells`)
        where each sequence has a stream of its own, else the context."""
        return self.ctx_size if self.kv_unified or self.n_seq_max == 1 else self.slot_cells

    @property
    def draft_context(self) -> tuple[int, int, bool]:
        """The draft models' contexts: ``(n_ctx, n_seq_max, kv_unified)``.
        Under ``--parallel`` slots (one KV stream per sequence) a draft
        model drafts for one request at a time, in sequence 0
        (ggpipe.decoding.parallel.chain_draft): one slot's cells (``ctx_size /
        n_seq_max`` rounded up to 256, as llama.cpp rounds a stream) and
        one sequence, not a stream per slot it would never use. Otherwise
        the target's settings (the speculative modes' partitions)."""
        if self.kv_unified or self.n_seq_max == 1:
            return self.ctx_size, self.n_seq_max, self.kv_unified
        return self.slot_cells, 1, True

    @property
    def draft_models(self) -> list[str]:
        """The draft models in ``-md`` order ([] for none)."""
        return draft_model_list(self.draft_model)

    def digest(self) -> str:
        """16 hex digits of the SHA-256 of every field (sorted JSON): ranks
        started with different settings have different digests (the start-up's
        HELLO compares them, ggpipe.cluster.startup)."""
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
