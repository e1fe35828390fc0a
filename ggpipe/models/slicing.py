"""What a layer slice must keep to compute exactly what the whole model does.

A stage loads a GGUF holding only some of the model's blocks, renamed from 0
(:mod:`ggpipe.models.derive`). llama.cpp builds that slice's graph as if it
were a whole model, so every rule that depends on a block's index, and every
operation on the model's input or output, must give the slice what the whole
model gives those blocks. The rule, read from the vendored llama.cpp
(``src/llama-model.cpp``, ``src/llama-graph.cpp``, ``src/models/*.cpp``):

1. **Per-layer arrays** (``{arch}.*`` arrays of ``block_count`` elements: head
   counts, feed-forward sizes, sliding-window flags, ...) are re-indexed with
   the blocks (``derive``).
2. **Patterns computed from the block index** become explicit per-layer
   arrays, which llama.cpp reads in preference to its formula:
   the sliding-window pattern (``llama_model_base::load_swa_pattern``: an
   array ``{arch}.attention.sliding_window_pattern``, else the period from
   that key or the architecture's default, ``llama_hparams::set_swa_pattern``)
   and the recurrent-layer pattern of the Qwen 3.5 / Qwen3-Next hybrids
   (``{arch}.attention.recurrent_layers``, else ``full_attention_interval``).
3. **Leading dense blocks** (``{arch}.leading_dense_block_count``, MoE models
   whose first blocks have a dense feed-forward): the count is shifted by the
   slice's first block.
4. **Input-side operations**: llama.cpp's ``build_inp_embd`` multiplies the
   input by ``{arch}.embedding_scale`` (Granite) for hidden-state input too, so
   a slice that does not start at block 0 gets ``embedding_scale = 0`` (no
   scale). Gemma and Gemma 2 multiply by ``sqrt(n_embd)`` in their own graph
   whatever the input: they cannot be cut (refused in one line).
5. **Output-side operations** (final norm, soft-capping, logit scale) run only
   on the last stage, which is the only one that computes logits.
6. **MTP / NextN blocks** (``{arch}.nextn_predict_layers``, the last blocks of
   GLM-4.5 and others, never run by ggpipe): a slice that does not hold all of
   them at its end says it holds none.

Which architectures use which rule is :data:`FAMILIES`, each proven by a
tiny random-weight model in ``tests/test_arch_families.py`` (every split at
1-4 ranks equals the whole model, token for token). An architecture not in
the table is refused for splitting: ggpipe has not checked its graph.

Recurrent and hybrid models keep a per-sequence state that llama.cpp cannot
roll back to an earlier position; the speculative modes need that, so they
refuse such models (:func:`check_speculation`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gguf import GGUFReader
from gguf.constants import GGUFValueType

from ggpipe.errors import ConfigError, ModelError
from ggpipe.models.gguf_info import ModelInfo, field_value
from ggpipe.models.kv_size import interval_recurrent, layout_from_reader, per_layer, swa_flags


@dataclass(frozen=True)
class Family:
    """What slicing an architecture needs (see the module docstring).

    Attributes:
        swa_period: llama.cpp's default sliding-window period for it
            (``load_swa_pattern(ml, N)``), None when it has no index-based
            sliding-window rule.
        swa_dense_first: the pattern's dense (global) layer comes first in each
            period (``load_swa_pattern(ml, N, true)``).
        swa_optional: the architecture turns sliding-window attention off
            when ``{arch}.attention.sliding_window`` is 0 (Gemma 3). llama.cpp
            asserts that a model with sliding-window attention has at least
            one such layer (``is_swa_any``), so a slice of only global layers
            gets ``sliding_window = 0`` where the architecture allows it and
            is refused otherwise.
        recurrent_interval: default ``full_attention_interval`` of hybrids
            whose recurrent layers are computed from the index.
        hybrid: attention and recurrent blocks in one model. llama.cpp's
            hybrid memory needs at least one block of each kind (an empty
            KV cache or recurrent state aborts at the first decode), so a
            slice of one kind only is refused.
        mlp_blocks: a hybrid whose blocks with a feed-forward part (per-layer
            ``feed_forward_length``) are MLP-only blocks (Nemotron-H).
        layer_output: the graph's name of a block's output after its
            residual add (``cb(cur, "l_out", il)`` in most graphs).
        refuse: why it cannot be cut, or None.
    """

    swa_period: int | None = None
    swa_dense_first: bool = False
    swa_optional: bool = False
    recurrent_interval: int | None = None
    hybrid: bool = False
    mlp_blocks: bool = False
    layer_output: str = "l_out"
    refuse: str | None = None

    @property
    def global_only_refused(self) -> bool:
        """A stage of global-attention blocks only cannot be loaded."""
        return self.swa_period is not None and not self.swa_optional

    @property
    def constrains_stages(self) -> bool:
        """Some contiguous block ranges cannot be a stage (refused by
        :func:`slice_metadata`): hybrid families and those of
        :attr:`global_only_refused`."""
        return self.hybrid or self.global_only_refused


_SCALED_INPUT = "its graph multiplies the input by sqrt(n_embd) even for hidden states, so every stage after the first " \
                "would scale them again"

# Architectures whose slices are proven exact by tests/test_arch_families.py,
# and the two refused ones. Mistral GGUFs use "llama" (dense and Mixtral-style
# MoE); sources: src/models/<arch>.cpp of the vendored llama.cpp.
FAMILIES: dict[str, Family] = {
    "llama": Family(),
    "mistral3": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
    "qwen3moe": Family(),
    "phi3": Family(),
    "deepseek2": Family(),
    "glm4moe": Family(),
    "gemma3": Family(swa_period=6, swa_optional=True),
    "cohere2": Family(swa_period=4),
    "gpt-oss": Family(swa_period=2),
    "lfm2": Family(hybrid=True),
    "nemotron_h": Family(hybrid=True, mlp_blocks=True, layer_output="nemotron_h_block_out"),  # its "l_out" lacks the residual
    "granitehybrid": Family(hybrid=True),
    "qwen35": Family(recurrent_interval=4, hybrid=True),
    "qwen3next": Family(recurrent_interval=4, hybrid=True),
    "gemma": Family(refuse=_SCALED_INPUT),
    "gemma2": Family(swa_period=2, refuse=_SCALED_INPUT),
}


def sliceable_archs() -> tuple[str, ...]:
    """Architectures ggpipe cuts into layer ranges."""
    return tuple(a for a, f in FAMILIES.items() if f.refuse is None)


def check_sliceable(info: ModelInfo) -> None:
    """Raise ModelError (one line) unless cutting ``info``'s model into layer
    ranges keeps its output exact. Whole-model (single-stage) runs never
    need this."""
    fam = FAMILIES.get(info.arch)
    if fam is not None and fam.refuse is None:
        return
    why = fam.refuse if fam is not None else (
        "ggpipe has not verified that a layer slice of this architecture computes what the whole model does")
    raise ModelError(
        f"cannot split {info.path.name} (architecture {info.arch!r}) into layer ranges: {why}; "
        f"run it as a single stage (one rank), or use a model of a checked architecture "
        f"({', '.join(sliceable_archs())})")


def layer_output_name(arch: str) -> str:
    """Name (without ``-{il}``) of a block's output node in ``arch``'s graph."""
    return FAMILIES.get(arch, Family()).layer_output


def describe_slicing(info: ModelInfo) -> str:
    """One line for ``ggpipe models info``: whether and how the model splits."""
    fam = FAMILIES.get(info.arch)
    if fam is None or fam.refuse is not None:
        try:
            check_sliceable(info)
        except ModelError as e:
            return "no: " + str(e).split(": ", 1)[1]
    keeps = ["per-layer arrays re-indexed"] if info.per_layer_keys else []
    if fam.swa_period is not None:
        keeps.append("sliding-window pattern written per layer")
    if fam.global_only_refused:
        keeps.append("a stage of global-attention blocks only is refused")
    if fam.recurrent_interval is not None:
        keeps.append("recurrent layers written per layer")
    if fam.hybrid:
        keeps.append("every stage needs an attention and a recurrent block")
    if info.arch in ("deepseek2", "glm4moe"):
        keeps.append("leading dense blocks shifted")
    how = "; ".join(keeps) or "blocks copied as they are"
    return f"yes, at any block boundary ({how})"


# --------------------------------------------------------------------------
# Metadata a slice needs
# --------------------------------------------------------------------------


def _int(reader: GGUFReader, key: str) -> int | None:
    v = field_value(reader, key)
    return None if v is None or isinstance(v, (list, str)) else int(v)


def _is_array(reader: GGUFReader, key: str) -> bool:
    f = reader.fields.get(key)
    return f is not None and f.types[:1] == [GGUFValueType.ARRAY]


def _swa_pattern(reader: GGUFReader, arch: str, fam: Family, n_main: int, n_all: int) -> list[bool] | None:
    """The whole model's sliding-window flag per block: the GGUF's per-layer
    array, else as ``llama_hparams::set_swa_pattern`` computes it from the
    period (None: the architecture has no such rule)."""
    key = f"{arch}.attention.sliding_window_pattern"
    if fam.swa_period is None:
        return None
    if _is_array(reader, key):
        return [bool(x) for x in field_value(reader, key)]
    n = _int(reader, key)
    return swa_flags(fam.swa_period if n is None else n, fam.swa_dense_first, n_main) + [False] * (n_all - n_main)


def _recurrent_layers(reader: GGUFReader, arch: str, fam: Family, n_main: int, n_all: int) -> list[bool] | None:
    """The whole model's recurrent flag per block (Qwen 3.5 / Qwen3-Next:
    recurrent unless ``(il + 1) % full_attention_interval == 0``)."""
    key = f"{arch}.attention.recurrent_layers"
    if fam.recurrent_interval is None or _is_array(reader, key):
        return None
    interval = _int(reader, f"{arch}.full_attention_interval") or fam.recurrent_interval
    return interval_recurrent(interval, n_main, n_all)


def _hybrid_kinds(reader: GGUFReader, arch: str, fam: Family, n_main: int,
                  n_all: int) -> tuple[list[bool], list[bool]] | None:
    """(recurrent, attention) flag per block of a hybrid model, as its
    llama.cpp graph decides. Attention blocks: those with a KV cache
    (:func:`ggpipe.models.kv_size.kv_layout`). Recurrent: the recurrent
    pattern or array, else a block without KV heads (with ``mlp_blocks``,
    Nemotron-H, one without a feed-forward part: the others are MLP blocks)."""
    if not fam.hybrid:
        return None
    n_embd = _int(reader, f"{arch}.embedding_length") or 0
    attention = [row is not None for row in layout_from_reader(reader, arch, n_all, n_embd).rows]
    recurrent = _recurrent_layers(reader, arch, fam, n_main, n_all)
    if recurrent is None and _is_array(reader, f"{arch}.attention.recurrent_layers"):
        recurrent = [bool(x) for x in field_value(reader, f"{arch}.attention.recurrent_layers")]
    if recurrent is None:
        kv = [int(x) for x in per_layer(field_value(reader, f"{arch}.attention.head_count_kv"), n_all, 1)]
        ff = [int(x) for x in per_layer(field_value(reader, f"{arch}.feed_forward_length"), n_all, 0)]
        recurrent = [kv[i] == 0 and not (fam.mlp_blocks and ff[i]) for i in range(n_all)]
    return recurrent, attention


def _span(layers: list[int]) -> str:
    return f"{layers[0]}-{layers[-1]}" if layers == list(range(layers[0], layers[-1] + 1)) else str(layers)


class StageRefused(ModelError):
    """A stage of blocks llama.cpp cannot run (raised by
    :func:`slice_metadata`): ``reason`` says why, ``advice`` what to give
    instead ("" when none); the message is both, one line."""

    def __init__(self, reason: str, advice: str = ""):
        self.reason, self.advice = reason, advice
        super().__init__(f"{reason}: {advice}" if advice else reason)


def slice_metadata(reader: GGUFReader, arch: str, n_layer: int, layers: Sequence[int]) -> dict[str, tuple[Any, int, int | None]]:
    """Metadata entries to write in (or add to) a GGUF whose block ``i`` is
    block ``layers[i]`` of ``reader``'s model, beyond the per-layer arrays
    that are re-indexed as they are: ``{key: (value, GGUFValueType,
    array sub-type or None)}`` (rules 2, 3, 4 and 6 of the module docstring).

    Raises:
        ModelError: ``layers`` puts leading dense blocks or MTP blocks where
            the slice's metadata cannot say so.
    """
    fam = FAMILIES.get(arch, Family())
    out: dict[str, tuple[Any, int, int | None]] = {}
    n_nextn = _int(reader, f"{arch}.nextn_predict_layers") or 0
    n_main = n_layer - n_nextn
    layers = list(layers)
    for key, flags in ((f"{arch}.attention.sliding_window_pattern", _swa_pattern(reader, arch, fam, n_main, n_layer)),
                       (f"{arch}.attention.recurrent_layers", _recurrent_layers(reader, arch, fam, n_main, n_layer))):
        if flags is not None:
            out[key] = ([flags[i] for i in layers], GGUFValueType.ARRAY, GGUFValueType.BOOL)
    swa = out.get(f"{arch}.attention.sliding_window_pattern")
    window = _int(reader, f"{arch}.attention.sliding_window")
    if swa is not None and not any(swa[0]) and window:
        if fam.global_only_refused:
            raise StageRefused(f"blocks {_span(layers)} of this {arch} model are all global-attention blocks, and "
                               f"llama.cpp cannot load a {arch} model without a sliding-window block",
                               "give that stage one more block (another --split)")
        out[f"{arch}.attention.sliding_window"] = (0, GGUFValueType.UINT32, None)
    kinds = _hybrid_kinds(reader, arch, fam, n_main, n_layer)
    if kinds is not None:
        for flags, what in ((kinds[0], "recurrent"), (kinds[1], "attention")):
            if not any(flags[i] for i in layers):
                raise StageRefused(f"blocks {_span(layers)} of this {arch} model hold no {what} block, and "
                                   f"llama.cpp cannot run a slice of a hybrid model without both kinds",
                                   "give that stage more blocks (another --split)")
    lead_key = f"{arch}.leading_dense_block_count"
    lead = _int(reader, lead_key)
    if lead is not None:
        n_dense = sum(1 for i in layers if i < lead)
        if any(i < lead for i in layers[n_dense:]):
            raise StageRefused(f"blocks {layers} put a leading dense block (the first {lead} of the model) after a "
                               f"mixture-of-experts block, which llama.cpp cannot load")
        out[lead_key] = (n_dense, GGUFValueType.UINT32, None)
    scale_key = f"{arch}.embedding_scale"
    if layers[0] != 0 and scale_key in reader.fields:
        out[scale_key] = (0.0, GGUFValueType.FLOAT32, None)
    if n_nextn:
        mtp = [i for i in layers if i >= n_main]
        if mtp and layers[-len(mtp):] != list(range(n_main, n_layer)):
            raise StageRefused(f"blocks {layers} hold only part of the model's {n_nextn} MTP blocks "
                               f"({n_main}-{n_layer - 1}), which must stay together at the end")
        out[f"{arch}.nextn_predict_layers"] = (len(mtp), GGUFValueType.UINT32, None)
    return out


def stage_refusal(reader: GGUFReader, arch: str, n_layer: int, start: int, stop: int) -> str | None:
    """Why a stage of blocks [start, stop) cannot be cut (the reason of
    :func:`slice_metadata`'s :class:`StageRefused`, without its advice), or
    None. The default split moves its boundaries to avoid such stages
    (:func:`ggpipe.cluster.split.repair_ranges`)."""
    try:
        slice_metadata(reader, arch, n_layer, range(start, stop))
    except StageRefused as e:
        return e.reason
    return None


# --------------------------------------------------------------------------
# Recurrent state and the speculative modes
# --------------------------------------------------------------------------


def check_speculation(mode: str, recurrent: dict[str, bool]) -> None:
    """Refuse a speculative mode over a recurrent or hybrid model.

    Args:
        mode: the name of a decoding mode that speculates (the caller asks
            the mode's declaration; ggpipe.decoding.mode).
        recurrent: model file name -> llama.cpp's ``llama_model_is_recurrent
            or llama_model_is_hybrid`` for the target and each draft.

    Raises:
        ConfigError: one line naming the model and what works.
    """
    for name, flag in recurrent.items():
        if flag:
            raise ConfigError(
                f"--mode {mode} cannot run {name}: it keeps a recurrent state per sequence, which llama.cpp cannot "
                f"roll back to the last accepted token after a rejected guess; use --mode iterative")
