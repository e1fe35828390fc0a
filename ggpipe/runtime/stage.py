"""One pipeline stage: a llama.cpp context over a slice of the model's layers.

The first stage takes token ids; later stages take the previous stage's hidden
states through ``llama_batch.embd``. Middle stages return hidden states, the
last stage returns logits (NOTES-llamacpp, "Evaluating a range of layers"):

    tokens  --[stage 0: blk 0..a)-->  hidden (n, n_embd) float32
    hidden  --[stage 1: blk a..b)-->  hidden (n, n_embd) float32
    hidden  --[stage k: blk ..N)-->   logits (n_outputs, n_vocab) float32

A non-last stage captures the output of its slice's last layer (graph node
``l_out-{n_layer-1}``) with the native eval callback, which also skips the
output norm and LM head; it marks every token as an output, because llama.cpp
keeps only output rows in the last layer (``get_rows(inp_out_ids)``).
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ggpipe.errors import ConfigError, GGPipeError, ModelError, NonFiniteError
from ggpipe.runtime import faults, kernels
from ggpipe.runtime import llama as _llama
from ggpipe.runs import ubatch_order


class InvalidBatch(GGPipeError):
    """``llama_decode`` rejected the batch (returned -1), e.g. because its
    positions do not continue a sequence's cells in the KV cache."""


class Cancelled(Exception):
    """``llama_decode`` was aborted through the cancellation flag (it returned 2;
    llama.cpp removed the KV cells of the aborted ubatch)."""


@dataclass(frozen=True)
class StageSpec:
    """What a rank needs to build its stage.

    Attributes:
        model_path: GGUF holding exactly this stage's layers (a slice, or the
            whole model for a single stage).
        n_layer: number of layers in that GGUF.
        first: the stage takes token ids (else hidden states).
        last: the stage returns logits (else hidden states).
        n_ctx: KV cache size in tokens (cells).
        n_threads: CPU threads for llama.cpp.
        n_seq_max: sequence ids the context accepts (1..256, LLAMA_MAX_SEQ).
        n_ubatch: tokens llama.cpp computes at once (``n_ubatch``, its
            physical batch); a larger batch is split into ubatches.
        n_batch: largest batch one decode call takes (tokens; llama.cpp's
            ``n_batch``, the scheduler's token budget per micro-batch);
            None: ``n_ubatch``.
        flash_attn: "off" (llama-cpp-python's Llama() default, the exactness
            reference), "on" or "auto" (llama.cpp's tools' default).
        kv_unified: one KV buffer for every sequence (llama.cpp's
            ``kv_unified``; needed by partial ``seq_cp``, which the
            speculative modes use); False: one KV stream of
            ``n_ctx / n_seq_max`` cells (rounded up to 256) per sequence,
            so a sequence's cells never sit among another's (continuous
            batching, ``--parallel``).
        cache_type_k, cache_type_v: KV cache types (``-ctk``/``-ctv``,
            llama.cpp's names: f16 default, q8_0, q4_0, ...); a quantized V
            cache needs flash attention ``on`` or ``auto``.
        mlock: keep the weights in RAM (``--mlock``).
        no_mmap: read the weights into memory instead of mapping them
            (``--no-mmap``).
        numa: ``--numa`` strategy (distribute, isolate, numactl) or None.
        extra_bufts: llama.cpp's extra buffer types for the weights
            (repacked kernels; :mod:`ggpipe.runtime.kernels`): False with
            ``--exact`` or ``--no-repack``.
        rank: the MPI rank that holds the stage (0 without MPI).
        label: which stage this is, for messages: rank, host, model and
            layers, e.g. "rank 1 (node2), target layers 15-29 of m.gguf".
        layer_output: the graph's name of a block's output (after its
            residual add): ``l_out`` in most of llama.cpp's models
            (:func:`ggpipe.models.slicing.layer_output_name`); the node
            ``{layer_output}-{n_layer - 1}`` is what a non-last stage returns.
    """

    model_path: Path
    n_layer: int
    first: bool
    last: bool
    n_ctx: int = 4096
    n_threads: int = 1
    n_seq_max: int = 1
    n_ubatch: int = 512
    n_batch: int | None = None
    flash_attn: str = "off"
    kv_unified: bool = True
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    mlock: bool = False
    no_mmap: bool = False
    numa: str | None = None
    extra_bufts: bool = True
    rank: int = 0
    label: str = ""
    layer_output: str = "l_out"


def check_cache_types(type_k: str, type_v: str, flash_attn: str, opts: tuple[str, str] = ("-ctk", "-ctv")) -> None:
    """Refuse KV cache types llama.cpp would refuse, in one line: an unknown
    name, or a quantized V cache with flash attention off (llama.cpp's
    ``llama_init_from_model`` returns NULL for it; ``auto`` turns flash
    attention on for it, as llama.cpp does).

    Raises:
        ConfigError: naming the option and ``-fa on``.
    """
    for opt, name in zip(opts, (type_k, type_v)):
        if name not in _llama.KV_CACHE_TYPES:
            raise ConfigError(f"{opt}: unknown KV cache type {name!r} (one of {', '.join(_llama.KV_CACHE_TYPES)})")
    if flash_attn == "off" and _llama.kv_type_is_quantized(type_v):
        raise ConfigError(f"{opts[1]} {type_v}: a quantized V cache needs flash attention (llama.cpp refuses it "
                          f"with -fa off): add -fa on (or -fa auto)")


# KV cache operations (the transaction layer carries these codes).
KV_CLEAR, KV_SEQ_RM, KV_SEQ_CP, KV_SEQ_KEEP, KV_SEQ_ADD = range(5)


class Stage:
    """A llama.cpp model + context for one stage, with native capture and
    cancellation hooks.

    Raises:
        ModelError: the GGUF cannot be loaded by llama.cpp.
        ConfigError: the context cannot be created with these settings.
    """

    def __init__(self, spec: StageSpec):
        self.spec = spec
        L = _llama.lib()
        native = _llama.native()
        self._L = L
        if not 1 <= spec.n_seq_max <= 256:
            raise ConfigError(f"n_seq_max must be 1..256 (LLAMA_MAX_SEQ), got {spec.n_seq_max}")
        check_cache_types(spec.cache_type_k, spec.cache_type_v, spec.flash_attn)
        _llama.numa_init(spec.numa)

        mparams = L.llama_model_default_params()
        mparams.n_gpu_layers = 0
        mparams.load_mode = _llama.load_mode(spec.mlock, spec.no_mmap)
        mparams.use_extra_bufts = kernels.use_extra_bufts(spec.extra_bufts)
        self.model = L.llama_model_load_from_file(str(spec.model_path).encode(), mparams)
        if not self.model:
            raise ModelError(f"llama.cpp could not load {spec.model_path} (run with -v to see its log)")
        self.vocab = L.llama_model_get_vocab(self.model)
        desc = ctypes.create_string_buffer(128)
        L.llama_model_desc(self.model, desc, len(desc))
        #: the weights' type as llama.cpp names it (``llama_model_desc``'s last word: Q4_1, F16, Q4_K - Medium)
        self.weights = desc.value.decode("utf-8", "replace").split(" ", 2)[-1] or "unknown"
        self.n_embd = int(L.llama_model_n_embd(self.model))
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))

        self.hooks = native.Hooks()
        #: most tokens of one decode call (llama.cpp's n_batch)
        self.n_batch = max(spec.n_batch or spec.n_ubatch, 1)
        # with one KV stream per sequence llama.cpp computes a batch's rows ubatch by ubatch, sequence after
        # sequence (llama_batch_allocr::split_equal): a non-last stage puts its captured rows back in batch order
        self._streams = not spec.kv_unified and spec.n_seq_max > 1
        cparams = L.llama_context_default_params()
        cparams.n_ctx = spec.n_ctx
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = min(spec.n_ubatch, self.n_batch)
        cparams.n_seq_max = spec.n_seq_max
        cparams.n_threads = spec.n_threads
        cparams.n_threads_batch = spec.n_threads
        cparams.kv_unified = spec.kv_unified  # partial seq_cp needs a unified KV buffer
        cparams.no_perf = True
        # off by default: llama-cpp-python's Llama() default (flash_attn=False),
        # the single-node reference of the exactness tests; -fa on|auto as llama.cpp
        cparams.flash_attn_type = _llama.flash_attn_type(spec.flash_attn)
        cparams.type_k = _llama.kv_cache_type(spec.cache_type_k)
        cparams.type_v = _llama.kv_cache_type(spec.cache_type_v)
        cparams.embeddings = False
        if not spec.last:
            cparams.cb_eval = L.ggml_backend_sched_eval_callback(native.eval_callback_address())
            cparams.cb_eval_user_data = ctypes.c_void_p(self.hooks.address)
        cparams.abort_callback = L.ggml_abort_callback(native.abort_callback_address())
        cparams.abort_callback_data = ctypes.c_void_p(self.hooks.address)
        self._cparams = cparams  # keep the callback objects alive
        self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            L.llama_model_free(self.model)
            raise ConfigError(
                f"llama.cpp could not create a context (n_ctx={spec.n_ctx}, n_seq_max={spec.n_seq_max}, "
                f"n_ubatch={spec.n_ubatch}, KV types {spec.cache_type_k}/{spec.cache_type_v}) for {spec.model_path}"
            )
        self.mem = L.llama_get_memory(self.ctx)
        self._n_ubatch = int(L.llama_n_ubatch(self.ctx))
        # cells one sequence may fill: n_ctx, or with one KV stream per sequence
        # n_ctx / n_seq_max rounded up to 256 (llama_context's n_ctx_seq)
        self.n_ctx_seq = int(L.llama_n_ctx_seq(self.ctx))
        self._batch = L.llama_batch_init(self.n_batch, 0 if spec.first else self.n_embd, spec.n_seq_max)
        self._batch_addr = ctypes.addressof(self._batch)
        self._mrope_pos = self._mrope_positions(L)
        self._capture_node = f"{spec.layer_output}-{spec.n_layer - 1}"
        self._closed = False
        self._fault = faults.planned(spec.rank, "target" in spec.label)

    def _mrope_positions(self, L):
        """M-RoPE models (Qwen 2/2.5/3-VL, Qwen 3.5: ``llama_model_rope_type``
        MROPE or IMROPE) read 4 positions per token from a batch of hidden
        states (``llama_batch_allocr``: section-major ``pos[j*n + i]``), where
        a token batch gives one and llama.cpp repeats it over the 4 sections.
        A later stage therefore gets a position buffer 4 times as long, which
        :meth:`decode` fills with each text position repeated, as the whole
        model computes it; ``llama_batch_init`` allocated only one per token,
        so the buffer replaces the batch's (given back in :meth:`close`).
        Returns (buffer, original pointer), or None."""
        if self.spec.first or L.llama_model_rope_type(self.model) not in (L.LLAMA_ROPE_TYPE_MROPE,
                                                                           L.LLAMA_ROPE_TYPE_IMROPE):
            return None
        buf = (ctypes.c_int32 * (4 * self.n_batch))()
        original = ctypes.cast(self._batch.pos, ctypes.c_void_p).value  # an address: a field's pointer object shares
        self._batch.pos = ctypes.cast(buf, type(self._batch.pos))         # the field's memory
        return buf, original

    # -- evaluation -----------------------------------------------------------

    def decode(
        self,
        *,
        pos: np.ndarray,
        n_seq_id: np.ndarray,
        seq_ids: np.ndarray,
        outputs: np.ndarray,
        tokens: np.ndarray | None = None,
        embd: np.ndarray | None = None,
    ) -> np.ndarray:
        """Evaluate one micro-batch through this stage's layers.

        Args:
            pos: int32 (n,) positions, 1 <= n <= n_batch.
            n_seq_id: int32 (n,) number of sequence ids of each token.
            seq_ids: int32 (sum(n_seq_id),) the sequence ids, token by token.
            outputs: int8 (n,) 1 where the last stage must return logits.
            tokens: int32 (n,) token ids (first stage only).
            embd: float32 (n, n_embd) hidden states (later stages only).

        Returns:
            Non-last stage: float32 (n, n_embd) hidden states after the
            slice's last layer, in batch order (with one KV stream per
            sequence, the rows llama.cpp computed ubatch by ubatch are put
            back in batch order: :func:`ggpipe.runs.ubatch_order`). Last
            stage: float32 (sum(outputs), n_vocab) logits, in batch order
            (llama.cpp's ``llama_get_logits`` reorders them).

        Raises:
            Cancelled: the cancellation flag was set during the call.
            GGPipeError: no KV slot (context full) or llama.cpp failed.
            ValueError: malformed arrays (checked in C before any write).
        """
        n = int(pos.shape[0])
        flags = outputs if self.spec.last else np.ones(n, dtype=np.int8)
        _llama.native().fill_batch(
            self._batch_addr, self.n_batch, self.n_embd, self.spec.n_seq_max,
            tokens if self.spec.first else None,
            None if self.spec.first else embd,
            pos, n_seq_id, seq_ids, flags,
        )
        if self._mrope_pos is not None:
            sections = np.tile(np.ascontiguousarray(pos, dtype=np.int32), 4)  # pos[j*n + i] = pos[i]
            ctypes.memmove(self._mrope_pos[0], sections.ctypes.data, sections.nbytes)
        hidden = None
        if not self.spec.last:
            hidden = np.empty((n, self.n_embd), dtype=np.float32)
            self.hooks.arm(self._capture_node, hidden, True)
        try:
            rc = self._L.llama_decode(self.ctx, self._batch)
        finally:
            if hidden is not None:
                captured = self.hooks.captured_bytes
                overflow = self.hooks.overflow
                self.hooks.disarm()
        if rc == 2:
            raise Cancelled()
        # the planned fault of this call (GGPIPE_FAULT, ggpipe.runtime.faults): a full KV cache, or NaN output
        fault = self._fault.kind if self._fault is not None and self._fault.due() else None
        if fault == "kvfull":
            rc = 1
        if rc == 1:
            injected = " [injected: GGPIPE_FAULT]" if fault else ""
            raise GGPipeError(
                f"the KV cache is full (n_ctx={self.spec.n_ctx}): raise --ctx-size or shorten the prompt/-n"
                f"{injected}")
        if rc == -1:
            raise InvalidBatch(f"llama_decode rejected a batch of {n} tokens (positions {int(pos[0])}..)")
        if rc != 0:
            raise GGPipeError(f"llama_decode failed with code {rc} on a batch of {n} tokens")
        if hidden is not None:
            if overflow or captured != hidden.nbytes:
                raise GGPipeError(
                    f"captured {captured} bytes of {self._capture_node}, expected {hidden.nbytes}"
                )
            if self._streams:
                order = ubatch_order(seq_ids, self._n_ubatch)
                if order is not None:       # row j of the capture is the batch's row order[j]
                    rows = np.empty_like(hidden)
                    rows[order] = hidden
                    hidden = rows
            if fault == "nan":
                hidden[:, 0] = np.nan
            return self._finite(hidden, "hidden states")
        n_out = int(np.count_nonzero(flags))
        ptr = self._L.llama_get_logits(self.ctx)
        out = np.ctypeslib.as_array(ptr, shape=(n_out, self.n_vocab)).copy()
        if fault == "nan":
            out[:, 0] = np.nan
        return self._finite(out, "logits")

    def warmup(self) -> float:
        """Run one two-token batch through the stage and clear its KV cache,
        as llama.cpp's tools do at load (``common_init_from_params``: BOS and
        EOS decoded with ``llama_set_warmup``, then ``llama_memory_clear``):
        every weight page is touched once (a mixture of experts' every
        expert), the threads start and the compute buffers are used, so the
        first request's prompt goes as fast as the next one's. A later
        stage is fed zero hidden states. Nothing of it stays: the cells are
        removed (their data too) and planned faults (``GGPIPE_FAULT``) do
        not count it. Returns its seconds.

        Raises:
            GGPipeError: llama.cpp failed (as :meth:`decode`).
        """
        L = self._L
        t0 = time.perf_counter()
        toks = [t for t in (L.llama_vocab_bos(self.vocab), L.llama_vocab_eos(self.vocab)) if t >= 0][:2] or [0]
        n = min(len(toks), self.n_batch)
        fault, self._fault = self._fault, None
        L.llama_set_warmup(self.ctx, True)
        try:
            self.decode(pos=np.arange(n, dtype=np.int32), n_seq_id=np.ones(n, np.int32),
                        seq_ids=np.zeros(n, np.int32), outputs=np.eye(1, n, n - 1, dtype=np.int8)[0],
                        tokens=np.asarray(toks[:n], np.int32) if self.spec.first else None,
                        embd=None if self.spec.first else np.zeros((n, self.n_embd), np.float32))
        finally:
            L.llama_set_warmup(self.ctx, False)
            L.llama_memory_clear(self.mem, True)
            self._fault = fault
        return time.perf_counter() - t0

    def _finite(self, out: np.ndarray, what: str) -> np.ndarray:
        """``out`` if every value is finite.

        Raises:
            NonFiniteError: a NaN or infinity (damaged weights: every later
                stage and the sampler would only pass it on), naming this
                stage (rank, host, layers).
        """
        if np.isfinite(out).all():
            return out
        where = self.spec.label or f"the stage of {self.spec.model_path}"
        raise NonFiniteError(
            f"non-finite values (NaN or inf) in the {what} of {where}: its weights are probably damaged "
            f"(compare the GGUF's sha256 with its source, or fetch it again)")

    # -- KV cache --------------------------------------------------------------

    def kv(self, op: int, seq: int = -1, seq_dst: int = -1, p0: int = -1, p1: int = -1, delta: int = 0) -> None:
        """Apply a KV cache metadata operation (``llama_memory_*`` on
        ``llama_get_memory(ctx)``); positions are half-open [p0, p1), -1 = open.

        Raises:
            ValueError: unknown op code or sequence id out of range.
        """
        L, mem = self._L, self.mem
        for s in (seq, seq_dst):
            if s < -1 or s >= self.spec.n_seq_max:
                raise ValueError(f"sequence id {s} out of range for n_seq_max={self.spec.n_seq_max}")
        if op == KV_CLEAR:
            L.llama_memory_clear(mem, True)
        elif op == KV_SEQ_RM:
            L.llama_memory_seq_rm(mem, seq, p0, p1)
        elif op == KV_SEQ_CP:
            L.llama_memory_seq_cp(mem, seq, seq_dst, p0, p1)
        elif op == KV_SEQ_KEEP:
            L.llama_memory_seq_keep(mem, seq)
        elif op == KV_SEQ_ADD:
            L.llama_memory_seq_add(mem, seq, p0, p1, delta)
        else:
            raise ValueError(f"unknown KV op {op}")

    # -- lifetime --------------------------------------------------------------

    def close(self) -> None:
        """Free the batch, the context and the model (``llama_batch_free``,
        ``llama_free``, ``llama_model_free``); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        L = self._L
        if self._mrope_pos is not None:
            # llama_batch_free frees the buffer it allocated
            self._batch.pos = ctypes.cast(ctypes.c_void_p(self._mrope_pos[1]), type(self._batch.pos))
        L.llama_batch_free(self._batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
