"""Loading one rank's stage: the layer split, the rank's slice of its model
(target or draft, cut and cached) loaded into llama.cpp, and the head's own
draft model when no rank runs it; with the checks done before anything loads
(``--n-seq-max``, ``-b``/``-ub``, ``-t``, a draft's vocabulary)."""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ggpipe.cluster.config import ClusterConfig, parse_threads
from ggpipe.cluster.resources import cap_threads, check_kv_memory, context_warning, kv_bytes_per_cell, warn
from ggpipe.cluster.roles import Roles
from ggpipe.cluster.split import parse_split, plan_layers, repair_ranges
from ggpipe.errors import ConfigError, ModelError
from ggpipe.models.derive import stage_slice
from ggpipe.models.gguf_info import load_gguf, read_model_info
from ggpipe.models.registry import cache_dir, resolve
from ggpipe.models.sizes import model_sizes
from ggpipe.models.slicing import FAMILIES, layer_output_name, stage_refusal
from ggpipe.runtime.stage import Stage, StageSpec


@dataclass
class Loaded:
    """One rank's loaded stage: its layers [start, stop), the model file it
    was cut from, the job's roles, and the seconds its load took
    (``load_s``), of which warming it up (``warmup_s``, :meth:`Stage.warmup`)."""

    stage: Stage
    layers: tuple[int, int]
    path: str
    roles: Roles
    draft_stage: Stage | None = None
    load_s: float = 0.0
    warmup_s: float = 0.0


def load_rank(config: ClusterConfig, rank: int, size: int, warm_target: bool = True) -> Loaded:
    """This rank's stage (and the head's draft stage when no rank runs the
    draft), each warmed up (:meth:`~ggpipe.runtime.stage.Stage.warmup`);
    ``warm_target`` False: the target stage is left for the thread that will
    compute it to warm up (llama.cpp's OpenMP threads belong to the thread
    that first computes: a stage warmed up on one thread and computed on
    another decodes about a fifth slower on two cores).

    Raises:
        GGPipeError: a bad setting, a model that cannot be resolved, read, cut or loaded.
    """
    if not 1 <= config.n_seq_max <= 256:
        raise ConfigError(f"--n-seq-max must be 1..256 (llama.cpp's LLAMA_MAX_SEQ), got {config.n_seq_max}")
    t_load = time.perf_counter()
    if config.ctx_size < 8:
        raise ConfigError("--ctx-size must be >= 8")
    config.check_batch()
    config.check_cache_types()
    threads = parse_threads(config.threads, size)
    split = parse_split(config.split)
    names = config.draft_models
    roles = Roles.plan(size, split, bool(names), n_draft_models=len(names))
    path = resolve(config.model)
    info = read_model_info(path)
    drafts = []
    for name in names:
        d_path = resolve(name)
        d_info = read_model_info(d_path)
        check_same_vocab(info, d_info)
        drafts.append((d_path, d_info))
    draft_path, draft_info = drafts[0] if drafts else (None, None)

    model = roles.model_of(rank)
    if model == "target":
        m_path, m_info, weights = path, info, split.target
    else:
        k = roles.draft_of(rank)
        (m_path, m_info), weights = drafts[k], (split.drafts[k] if split.drafts else None)
    index, n_stages = roles.stage_of(rank)
    sizes = model_sizes(m_path) if weights is None and n_stages > 1 else None   # only the default split reads them
    start, stop = layer_ranges(sizes, m_info.n_layer, n_stages, weights, model,
                               head=split.counts_head(model))[index]
    where = f"rank {rank} ({socket.gethostname()})"
    types = (config.cache_type_k, config.cache_type_v) if model == "target" else config.draft_cache_types
    if not m_info.kv_layout.v_cache and types[0] != types[1]:  # llama_init_from_model returns NULL for it
        opts = ("-ctk", "-ctv") if model == "target" else ("-ctkd", "-ctvd")
        raise ConfigError(f"{opts[0]} {types[0]} {opts[1]} {types[1]}: {m_path.name} caches one MLA latent per layer "
                          f"(no separate V), and llama.cpp refuses different K and V cache types for it: give both "
                          f"the same type")
    n_threads, warnings = _check_resources(config, rank, where, describe_role(roles, rank, (start, stop)), m_info,
                                 (start, stop), draft_info if rank == 0 and roles.has_draft and roles.n_draft == 0
                                 else None, threads[rank], info, types, draft_rank=model != "target")
    load = dict(flash_attn=config.flash_attn, mlock=config.mlock, no_mmap=config.no_mmap, numa=config.numa,
                extra_bufts=config.extra_bufts)
    d_ctx, d_seqs, d_unified = config.draft_context
    n_ctx, n_seqs, unified = ((config.ctx_size, config.n_seq_max, config.kv_unified) if model == "target"
                              else (d_ctx, d_seqs, d_unified))
    stage = Stage(StageSpec(
        model_path=stage_slice(m_path, start, stop, cache_dir()), n_layer=stop - start,
        first=index == 0, last=index == n_stages - 1, n_ctx=n_ctx, n_threads=n_threads,
        n_seq_max=n_seqs, n_ubatch=config.ubatch, n_batch=config.n_batch, kv_unified=unified,
        cache_type_k=types[0], cache_type_v=types[1], **load,
        rank=rank, label=f"{where}, {describe_role(roles, rank, (start, stop))} of {m_path.name}",
        layer_output=layer_output_name(m_info.arch),
    ))
    draft_stage = None
    if rank == 0 and roles.has_draft and roles.n_draft == 0:
        d_k, d_v = config.draft_cache_types
        try:
            draft_stage = Stage(StageSpec(model_path=draft_path, n_layer=draft_info.n_layer, first=True, last=True,
                                          n_ctx=d_ctx, n_threads=n_threads, n_seq_max=d_seqs, kv_unified=d_unified,
                                          n_ubatch=config.ubatch, n_batch=config.n_batch, cache_type_k=d_k,
                                          cache_type_v=d_v, **load,
                                          label=f"{where}, the draft model {draft_path.name}"))
        except BaseException:
            stage.close()
            raise
    try:
        t_warm = time.perf_counter()
        for st in (stage if warm_target else None, draft_stage):
            if st is not None:
                st.warmup()
        warm = time.perf_counter() - t_warm
    except BaseException:
        for st in (stage, draft_stage):
            if st is not None:
                st.close()
        raise
    for w in warnings:
        warn(w)
    return Loaded(stage, (start, stop), str(m_path), roles, draft_stage, load_s=time.perf_counter() - t_load,
                  warmup_s=warm)


def default_ranges(path, info, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A default split moved off stages llama.cpp cannot run (hybrid stages
    of one block kind, gpt-oss/Cohere2 stages of global blocks only:
    :func:`ggpipe.models.slicing.stage_refusal`) by
    :func:`ggpipe.cluster.split.repair_ranges`. Families without such
    constraints are returned as they are, without reading the GGUF.

    Raises:
        ModelError: no split of this many stages avoids them (the refusal of
            the first such stage)."""
    fam = FAMILIES.get(info.arch)
    if len(ranges) < 2 or fam is None or not fam.constrains_stages:
        return ranges
    reader = load_gguf(path)

    def refusal(start: int, stop: int) -> str | None:
        return stage_refusal(reader, info.arch, info.n_layer, start, stop)

    ranges = repair_ranges(ranges, lambda a, b: refusal(a, b) is None)
    for a, b in ranges:
        why = refusal(a, b)
        if why:
            raise ModelError(f"{why}: no split of {len(ranges)} stages avoids such a stage; "
                             f"use fewer ranks")
    return ranges


def layer_ranges(sizes, n_layer: int, n_stages: int, weights, model: str = "target",
                 head: bool = True) -> list[tuple[int, int]]:
    """A model's stages' layer ranges as the job cuts them: ``--split``
    ``weights`` as given; without them and with ``sizes``
    (:class:`ggpipe.models.sizes.ModelSizes`), the default split, byte-balanced
    with the LM head on the last stage (not counted with ``head`` False:
    ``--split prompts``) and, for a model whose file is at
    hand, moved off stages llama.cpp cannot run (:func:`default_ranges`).
    The job, ``ggpipe plan`` and ``ggpipe models split`` all call this.

    Raises:
        SplitError: a bad split. ModelError: no default split avoids a refused stage."""
    if weights is not None or sizes is None:
        return plan_layers(n_layer, n_stages, weights, model=model)
    ranges = plan_layers(n_layer, n_stages, None, model=model, layer_bytes=sizes.layer_bytes,
                         head_bytes=sizes.head_bytes if head else 0)
    if Path(sizes.path).is_file():
        ranges = default_ranges(sizes.path, read_model_info(sizes.path), ranges)
    return ranges


def _check_resources(config: ClusterConfig, rank: int, where: str, role: str, m_info, layers: tuple[int, int],
                     draft_info,
                     n_threads: int, target_info, types: tuple[str, str] = ("f16", "f16"),
                     draft_rank: bool = False) -> tuple[int, list[str]]:
    """Before anything is allocated (ggpipe.cluster.resources): the KV cache
    against this rank's memory, the context per sequence against the
    target's training (a warning, on the head), ``-t`` against the rank's
    CPUs (capped, with a warning). ``types``: this rank's model's KV cache
    types (K, V); ``layers``: the stage's blocks [start, stop) (a hybrid
    model's KV depends on which it holds); ``draft_rank``: the rank holds a
    draft model's stage. A draft model's cells are ``config.draft_context``'s
    (one slot's under ``--parallel``), on its own rank or on the head beside
    the target. Returns the threads to use and the warnings, printed once
    the stage has loaded (an error while loading is then the one line).

    Raises:
        ConfigError: the KV cache cannot fit this rank's memory.
    """
    v_trans = config.flash_attn == "off"  # llama.cpp stores V transposed (padded) without flash attention
    draft_cells = () if config.draft_context[0] == config.ctx_size else (config.draft_context[0],)
    parts = [(role, kv_bytes_per_cell(m_info, layers, *types, v_trans=v_trans), *(draft_cells if draft_rank else ()))]
    if draft_info is not None:
        parts.append(("the draft model", kv_bytes_per_cell(draft_info, (0, draft_info.n_layer),
                                                           *config.draft_cache_types, v_trans=v_trans), *draft_cells))
    check_kv_memory(config.ctx_size, parts, where)
    warnings = []
    if rank == 0:
        per_seq = config.ctx_size if config.kv_unified else -(-config.ctx_size // config.n_seq_max)
        warnings.append(context_warning(per_seq, target_info.n_ctx_train, target_info.path.name))
    n_threads, w = cap_threads(n_threads, where)
    warnings.append(w)
    return n_threads, [w for w in warnings if w]


def close_loaded(loaded: Loaded | None) -> None:
    """Free what :func:`load_rank` loaded (None: nothing was)."""
    if loaded is not None:
        loaded.stage.close()
        if loaded.draft_stage is not None:
            loaded.draft_stage.close()


def describe_role(roles: Roles, rank: int, layers: tuple[int, int]) -> str:
    """A rank's model and layer range (inclusive), e.g. "target layers 14-26"."""
    return f"{roles.model_of(rank)} layers {layers[0]}-{layers[1] - 1}"


def check_same_vocab(target, draft) -> None:
    """Refuse a draft whose vocabulary differs from the target's: speculation
    compares token ids, so they must mean the same text.

    Raises:
        ConfigError: sizes, special tokens or token texts differ.
    """
    if target.n_vocab != draft.n_vocab:
        raise ConfigError(
            f"the draft model's vocabulary ({draft.n_vocab} tokens, {draft.path.name}) differs from the target's "
            f"({target.n_vocab} tokens, {target.path.name}): speculation needs the same tokenizer")
    for what in ("bos_token_id", "eos_token_id", "vocab_digest"):
        a, b = getattr(target, what, None), getattr(draft, what, None)
        if a != b:
            raise ConfigError(
                f"the draft model's vocabulary differs from the target's ({what.replace('_', ' ')}: "
                f"{b} vs {a}): speculation needs the same tokenizer")
