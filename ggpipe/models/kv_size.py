"""How many bytes llama.cpp's KV cache takes per cell (token), layer by
layer, read from a GGUF's header: the one sizing that ``ggpipe plan``, the
simulator's placement and the start-up memory check all use.

llama.cpp (``llama_kv_cache``'s constructor, llama-kv-cache.cpp of the
llama.cpp vendored in llama-cpp-python 0.3.36) gives every layer that has a
KV cache one K row of ``n_embd_k_gqa(il)`` and one V row of
``n_embd_v_gqa(il)`` values per cell, stored as ``type_k``/``type_v``
(``ggml_row_size``: a block-quantized type stores whole blocks, q8_0 34
bytes per 32 values). With llama-hparams.cpp:

* ``n_embd_k_gqa(il) = n_embd_head_k(il) * n_head_kv(il)``, the head size
  being ``{arch}.attention.key_length`` (default ``n_embd / n_head`` of
  layer 0) and ``n_head_kv`` the layer's entry of
  ``{arch}.attention.head_count_kv`` (a number or one per layer; default the
  head count). V likewise with ``value_length``. Sliding-window layers use
  ``key_length_swa``/``value_length_swa`` where a model gives other sizes
  for them (Gemma 4), with the layers from
  ``{arch}.attention.sliding_window_pattern``.
* MLA (DeepSeek-2/3, Kimi, ...: ``key_length_mla`` and ``value_length_mla``
  both set) caches one compressed latent per cell: the header's
  ``head_count_kv`` = 1 and ``key_length`` = kv_lora_rank + rope dims (576
  for DeepSeek-V3), and no V tensor at all.
* Layers without a KV cache: recurrent layers of hybrid models (those with
  ``head_count_kv`` 0: LFM2, Granite 4 hybrid, Jamba, ...; the
  ``attention.recurrent_layers`` flags or every ``full_attention_interval``-th
  layer of Qwen3-Next/3.5; Nemotron-H's attention layers are those with
  neither 0 KV heads nor a feed-forward), the trailing
  ``nextn_predict_layers`` MTP blocks (never attended by the main context),
  Gemma 3n/4 layers that reuse an earlier layer's cache, and every layer of
  the purely recurrent architectures (Mamba, RWKV) and of encoders.
* With flash attention off (``v_trans``), V is stored transposed and every V
  row is as wide as the widest of the stage (``n_embd_v_gqa_max``).

Not modelled, so an estimate there:

* sliding-window layers are counted with all the context's cells. That is
  what ggpipe's contexts allocate: they keep llama.cpp's default
  ``swa_full = true`` (full-size SWA cache, which prefix reuse needs). With
  ``swa_full = false`` llama.cpp would give them only
  ``pad256(min(n_ctx, n_swa * n_seq + n_ubatch))`` cells.
* the extra caches of the architectures with their own cache classes
  (:data:`EXTRA_CACHE_ARCHS`: DeepSeek 3.2 / GLM DSA lightning-indexer keys,
  ...) are not counted: a lower bound for them.
* recurrent state (Mamba/RWKV/linear-attention layers) is per sequence, not
  per cell, and not counted here.

The cell count itself: llama.cpp rounds ``n_ctx`` up to 256, and with one KV
stream per sequence each stream to 256 (:func:`kv_cells`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ggpipe.runtime.llama import KV_CACHE_TYPES

#: Purely recurrent architectures (llama-arch.cpp ``llm_arch_is_recurrent``): no KV cache.
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
#: Architectures llama.cpp creates no memory for (encoders, diffusion models: ``create_memory`` gives null).
NO_MEMORY_ARCHS = frozenset({"bert", "jina-bert-v2", "jina-bert-v3", "nomic-bert", "nomic-bert-moe", "neo-bert",
                             "eurobert", "wavtokenizer-dec", "modern-bert", "gemma-embedding", "dream", "llada",
                             "llada-moe", "rnd1"})
#: Hybrids whose recurrent layers are flagged by ``attention.recurrent_layers`` or, without it, are all but every
#: ``full_attention_interval``-th layer (default 4).
_INTERVAL_HYBRIDS = frozenset({"qwen3next", "qwen35", "qwen35moe", "qwen4exp", "minimax-01"})
#: Nemotron-H: attention layers are those with KV heads and no feed-forward (the MLP layers have none).
_FFN_FREE_ATTENTION = frozenset({"nemotron_h", "nemotron_h_moe"})
#: Architectures with caches beyond K/V rows (indexer keys, compressed caches), not counted: an estimate there.
EXTRA_CACHE_ARCHS = frozenset({"deepseek32", "deepseek4", "glm-dsa", "glm5-next", "hy-v4", "dots3note",
                               "minimax-m3", "qwen4exp", "dflash", "gemma4-assistant", "graniteswitch"})
#: load_swa_pattern(..., dense_first=true) callers: a numeric pattern starts with a dense layer.
_DENSE_FIRST = frozenset({"cohere2moe", "smallthinker", "modern-bert"})


@dataclass(frozen=True)
class KVLayout:
    """The KV cache geometry of a model, per layer.

    Attributes:
        rows: per layer, ``(K values, V values)`` per cell (llama.cpp's
            ``n_embd_k_gqa(il)``, ``n_embd_v_gqa(il)``), or None for a layer
            without a KV cache (recurrent, MTP, shared).
        v_cache: False for MLA models, which cache K (the latent) only.
    """

    rows: tuple[tuple[int, int] | None, ...] = ()
    v_cache: bool = True

    @property
    def n_layer(self) -> int:
        """Layers of the model (those without a KV cache included)."""
        return len(self.rows)

    def kv_layers(self, start: int = 0, stop: int | None = None) -> list[int]:
        """The layers of [start, stop) that have a KV cache."""
        stop = len(self.rows) if stop is None else stop
        return [il for il in range(start, stop) if self.rows[il] is not None]


def kv_row_bytes(cache_type: str, n_values: int) -> int:
    """Bytes of one KV row of ``n_values`` values in ``cache_type`` (a
    ``-ctk``/``-ctv`` name; ggml's ``ggml_row_size``: whole blocks of the type).

    Raises:
        KeyError: not a KV cache type (ggpipe.runtime.llama.KV_CACHE_TYPES)."""
    _, block, size = KV_CACHE_TYPES[cache_type]
    return -(-n_values // block) * size


def kv_bytes_per_cell(layout: KVLayout, start: int, stop: int, type_k: str = "f16", type_v: str = "f16",
                      v_trans: bool = False) -> int:
    """KV cache bytes one cell (token) takes in layers [start, stop) of a
    model (a stage's layers: only those with a KV cache count), with K and V
    stored as ``type_k``/``type_v`` (``-ctk``/``-ctv``).

    ``v_trans``: flash attention off (llama.cpp then stores V transposed,
    each layer's V row as wide as the widest in the stage; the same unless
    the layers' V widths differ). Sliding-window layers count all cells (see
    the module docstring: ggpipe's contexts keep ``swa_full``).

    Raises:
        ValueError: a range outside the model's layers.
    """
    if not 0 <= start <= stop <= len(layout.rows):
        raise ValueError(f"layers [{start}, {stop}) outside the model's {len(layout.rows)} layers")
    rows = [r for r in layout.rows[start:stop] if r is not None]
    v_max = max((v for _, v in rows), default=0)
    total = 0
    for k, v in rows:
        total += kv_row_bytes(type_k, k)
        if layout.v_cache:
            total += kv_row_bytes(type_v, v_max if v_trans else v)
    return total


def kv_cells(n_ctx: int, n_seq_max: int = 1, unified: bool = True) -> int:
    """Cells llama.cpp allocates for ``-c n_ctx`` (llama_context: n_ctx
    rounded up to 256; with one KV stream per sequence, ``unified`` False,
    each stream gets n_ctx / n_seq_max rounded up to 256)."""
    if unified or n_seq_max <= 1:
        return _pad256(n_ctx)
    return _pad256(_pad256(n_ctx) // n_seq_max) * n_seq_max


def _pad256(n: int) -> int:
    return -(-n // 256) * 256


# -- reading the layout from a GGUF header ------------------------------------------------------


def per_layer(value: Any, n_layer: int, default: Any) -> list:
    """llama.cpp's ``get_key_or_arr``: a number for every layer, or one per
    layer (a shorter array: ``default`` for the rest); absent: ``default``."""
    if value is None:
        return [default] * n_layer
    if isinstance(value, (list, tuple)):
        vals = list(value[:n_layer])
        return vals + [default] * (n_layer - len(vals))
    return [value] * n_layer


def _swa_layers(fields: dict[str, Any], arch: str, n_layer: int) -> list[bool]:
    """Sliding-window layers from ``attention.sliding_window_pattern``: one
    flag per layer, or a period n (llama_hparams::set_swa_pattern: every
    n-th layer dense). Absent: none (only the head sizes of these layers
    are read here, and only where they differ)."""
    pattern = fields.get("attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):
        return [bool(x) for x in per_layer(pattern, n_layer, False)]
    if pattern is None:
        return [False] * n_layer
    return swa_flags(int(pattern), arch in _DENSE_FIRST, n_layer)


def swa_flags(period: int, dense_first: bool, n_layer: int) -> list[bool]:
    """``llama_hparams::set_swa_pattern(period, dense_first)``: a layer's
    sliding-window flag from its index (period 0: every layer; else one dense
    layer a period, the first of it with ``dense_first``, else the last)."""
    if dense_first:
        return [period == 0 or il % period != 0 for il in range(n_layer)]
    return [period == 0 or il % period < period - 1 for il in range(n_layer)]


def interval_recurrent(interval: int, n_trunk: int, n_layer: int) -> list[bool]:
    """The recurrent layers of the Qwen 3.5 / Qwen3-Next hybrids without a
    ``recurrent_layers`` array (``load_arch_hparams``): every layer of the
    trunk (not an MTP block) but each ``interval``-th."""
    return [il < n_trunk and (il + 1) % interval != 0 for il in range(n_layer)]


def kv_layout(fields: dict[str, Any], arch: str, n_layer: int, n_embd: int) -> KVLayout:
    """The KV layout llama.cpp gives a model with these header values.

    Args:
        fields: the ``{arch}.*`` metadata without the ``{arch}.`` prefix
            (``attention.head_count_kv`` -> value; arrays as lists).
        arch: ``general.architecture``.
        n_layer: ``{arch}.block_count``; n_embd: ``{arch}.embedding_length``.
    """
    if arch in RECURRENT_ARCHS or arch in NO_MEMORY_ARCHS:
        return KVLayout((None,) * n_layer)
    n_head = [int(x) for x in per_layer(fields.get("attention.head_count"), n_layer, 0)]
    head_kv_field = fields.get("attention.head_count_kv")
    n_head_kv = n_head if head_kv_field is None else [int(x) for x in per_layer(head_kv_field, n_layer, 0)]
    if n_layer and n_head[0] > 0:  # llama.cpp's defaults divide by layer 0's head count
        k_full = int(fields.get("attention.key_length", n_embd // n_head[0]))
        v_full = int(fields.get("attention.value_length", n_embd // n_head[0]))
    else:
        k_full = v_full = 0
    k_swa = int(fields.get("attention.key_length_swa", k_full))
    v_swa = int(fields.get("attention.value_length_swa", v_full))
    swa = _swa_layers(fields, arch, n_layer) if (k_swa, v_swa) != (k_full, v_full) else [False] * n_layer
    mla = bool(fields.get("attention.key_length_mla")) and bool(fields.get("attention.value_length_mla"))

    n_trunk = n_layer - int(fields.get("nextn_predict_layers") or 0)  # MTP blocks: not in the main context
    has_kv = [il < n_trunk or n_trunk <= 0 for il in range(n_layer)]
    if arch in _INTERVAL_HYBRIDS:
        flags = fields.get("attention.recurrent_layers")
        if flags is not None:
            recurrent = [bool(x) for x in per_layer(flags, n_layer, False)]
        else:
            interval = int(fields.get("full_attention_interval", 4)) or 4
            recurrent = interval_recurrent(interval, n_trunk, n_layer)
        has_kv = [h and not r for h, r in zip(has_kv, recurrent)]
    if arch in _FFN_FREE_ATTENTION:
        n_ff = per_layer(fields.get("feed_forward_length"), n_layer, 0)
        has_kv = [h and int(f) == 0 for h, f in zip(has_kv, n_ff)]
    if arch == "gemma3n":  # llama.cpp: layers from 20 on reuse layers 18/19's cache
        has_kv = [h and il < 20 for il, h in enumerate(has_kv)]
    elif arch == "gemma4":
        shared = int(fields.get("attention.shared_kv_layers") or 0)
        has_kv = [h and il < n_layer - shared for il, h in enumerate(has_kv)]

    rows: list[tuple[int, int] | None] = []
    for il in range(n_layer):
        # a layer with 0 KV heads (recurrent layer of a hybrid) gets no cache either
        if not has_kv[il] or n_head_kv[il] == 0:
            rows.append(None)
            continue
        hk, hv = (k_swa, v_swa) if swa[il] else (k_full, v_full)
        rows.append((hk * n_head_kv[il], hv * n_head_kv[il]))
    return KVLayout(tuple(rows), v_cache=not mla)


def layout_from_reader(reader, arch: str, n_layer: int, n_embd: int) -> KVLayout:
    """:func:`kv_layout` of an open GGUF (gguf.GGUFReader)."""
    prefix = f"{arch}."
    wanted = ("attention.", "nextn_predict_layers", "full_attention_interval", "feed_forward_length")
    fields: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith(prefix) and key[len(prefix):].startswith(wanted):
            fields[key[len(prefix):]] = field.contents()
    return kv_layout(fields, arch, n_layer, n_embd)


def layout_from_record(rows: Sequence | None, v_cache: bool = True) -> KVLayout:
    """A KVLayout from its JSON form (lists for tuples)."""
    return KVLayout(tuple(None if r is None else (int(r[0]), int(r[1])) for r in rows or ()), bool(v_cache))
