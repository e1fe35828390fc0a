"""Tensor sizes of a GGUF grouped by layer (bytes): what ``ggpipe plan``'s
memory table and the simulator's model description (ggpipe.sim.model) read
from a file's header. Remembered per file, as ModelInfo is. The KV cache is
sized by ggpipe.models.kv_size from the layout ModelInfo read.

A model without its file is sized from its shape (ggpipe.models.shapes):
``ARCH:QUANT``, or a described registry entry whose GGUF is not in the
cache (:func:`shape_sizes`)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ggpipe.models.cache import remembered
from ggpipe.models.gguf_info import load_gguf, read_model_info
from ggpipe.models.kv_size import KVLayout, kv_bytes_per_cell, kv_cells
from ggpipe.models.registry import DescribedModelError, resolve
from ggpipe.models.shapes import Architecture, bits_per_weight, is_shape, parse_shape

_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclass
class ModelSizes:
    """What the memory estimate needs from one GGUF (bytes, counts)."""

    path: str
    n_layer: int
    layer_bytes: list[int]
    embd_bytes: int
    output_bytes: int  # output_norm + output
    other_bytes: int  # tensors outside blocks that every stage keeps (rope factors, ...)
    tied: bool = False  # no output tensor: the last stage's LM head reads token_embd
    layer_params: list[int] = field(default_factory=list)  # weights (elements) per layer
    embd_params: int = 0
    output_params: int = 0
    n_embd: int = 0
    n_vocab: int = 0
    kv: KVLayout = field(default_factory=KVLayout)  # per-layer KV rows (from ModelInfo)
    # mixture of experts: the part of each layer in routed-expert tensors (*_exps), of which a token
    # uses n_expert_used of n_expert ({arch}.expert_count, expert_used_count)
    layer_expert_bytes: list[int] = field(default_factory=list)
    layer_expert_params: list[int] = field(default_factory=list)
    n_expert: int = 0
    n_expert_used: int = 0
    shape: str | None = None  # sized from this ARCH:QUANT, not from a file

    @property
    def head_bytes(self) -> int:
        """Weight bytes the LM head reads (output norm + output, or the tied token_embd)."""
        return self.output_bytes + (self.embd_bytes if self.tied else 0)

    @property
    def head_params(self) -> int:
        """Weights the LM head reads (output norm + output, and the token_embd
        when tied)."""
        return self.output_params + (self.embd_params if self.tied else 0)

    def slice_bytes(self, start: int, stop: int, first: bool, last: bool) -> int:
        """Weight bytes a stage of layers [start, stop) computes with."""
        uses_embd = first or (last and self.tied)
        return (sum(self.layer_bytes[start:stop]) + self.other_bytes + (self.embd_bytes if uses_embd else 0)
                + (self.output_bytes if last else 0))

    def kv_bytes(self, start: int, stop: int, n_ctx: int, type_k: str = "f16", type_v: str = "f16",
                 v_trans: bool = False, n_seq_max: int = 1, unified: bool = True) -> int:
        """KV cache bytes of layers [start, stop) at ``-c n_ctx`` with the
        cache types ``-ctk``/``-ctv`` (``v_trans``: flash attention off),
        as llama.cpp allocates it (:mod:`ggpipe.models.kv_size`)."""
        per_cell = kv_bytes_per_cell(self.kv, start, stop, type_k, type_v, v_trans)
        return kv_cells(n_ctx, n_seq_max, unified) * per_cell


def shape_sizes(arch: Architecture, quant: str, name: str) -> ModelSizes:
    """The sizes of a model of shape ``arch`` quantized as ``quant`` (every
    tensor at the quantization's average bits per weight): per layer its
    weights x bpw / 8, the token embedding and the output (the embedding
    again when tied), and one K and one V row per layer and cell (MLA: the
    latent, K only). Norms outside the blocks are not counted. ``name``
    (the shape's ARCH:QUANT, or the label of a model without a file) becomes
    ``path`` and ``shape``.

    Raises:
        ConfigError: unknown quantization."""
    bpw = bits_per_weight(quant)

    def nbytes(params: int) -> int:
        return int(params * bpw / 8)

    params = [arch.layer_params(il) for il in range(arch.n_layer)]
    embd = arch.n_vocab * arch.n_embd
    out = 0 if arch.tied else embd
    expert = [e for _, e in params]
    row = arch.kv_row()
    return ModelSizes(name, arch.n_layer, [nbytes(p) for p, _ in params], nbytes(embd),
                      nbytes(out), 0, tied=arch.tied, layer_params=[p for p, _ in params], embd_params=embd,
                      output_params=out, n_embd=arch.n_embd, n_vocab=arch.n_vocab,
                      kv=KVLayout((row,) * arch.n_layer, v_cache=not arch.kv_latent),
                      layer_expert_bytes=[nbytes(e) for e in expert], layer_expert_params=expert,
                      n_expert=arch.n_expert if any(expert) else 0,
                      n_expert_used=arch.n_expert_used if any(expert) else 0, shape=name)


def model_sizes(name_or_path: str | os.PathLike[str]) -> ModelSizes:
    """Tensor sizes of a model grouped by layer: of its GGUF (registry name
    or path), or of its shape (``ARCH:QUANT``, or a described registry entry
    whose file is not in the cache).

    Raises:
        ModelError: unknown name, unreadable or non-GGUF file.
        ConfigError: a bad ARCH:QUANT.
    """
    text = os.fspath(name_or_path)
    if isinstance(name_or_path, str) and is_shape(text):
        _, arch, quant = parse_shape(text)
        return shape_sizes(arch, quant, f"{text.split(':', 1)[0]}:{quant}")
    try:
        path = resolve(name_or_path)
    except DescribedModelError as e:  # no file: its shape
        _, arch, quant = parse_shape(e.entry.shape)
        return shape_sizes(arch, quant, e.entry.shape)
    info = read_model_info(path)  # validates the file in a bounded child process first

    def compute() -> dict:
        reader = load_gguf(path)
        layer = [0] * info.n_layer
        params = [0] * info.n_layer
        exp_bytes = [0] * info.n_layer
        exp_params = [0] * info.n_layer
        embd = out = other = embd_n = out_n = 0
        has_output = False
        for t in reader.tensors:
            n, k = int(t.n_bytes), int(t.n_elements)
            m = _LAYER.match(t.name)
            if m and int(m.group(1)) < info.n_layer:
                il = int(m.group(1))
                layer[il] += n
                params[il] += k
                if "_exps." in t.name:  # routed experts (ffn_{gate,up,down,gate_up}_exps); not *_shexp
                    exp_bytes[il] += n
                    exp_params[il] += k
            elif t.name.startswith("token_embd."):
                embd += n
                embd_n += k
            elif t.name.startswith(("output.", "output_norm.")):
                out += n
                out_n += k
                has_output = has_output or t.name.startswith("output.")
            else:
                other += n
        n_expert = _count(reader, f"{info.arch}.expert_count") if any(exp_bytes) else 0
        n_used = _count(reader, f"{info.arch}.expert_used_count") if n_expert else 0
        if not (0 < n_used <= n_expert):  # no usable counts: treat the experts as dense weights
            exp_bytes, exp_params, n_expert, n_used = [0] * info.n_layer, [0] * info.n_layer, 0, 0
        return {"format": _SIZES_FORMAT, "n_layer": info.n_layer, "layer_bytes": layer, "embd_bytes": embd,
                "output_bytes": out, "other_bytes": other, "tied": not has_output, "layer_params": params,
                "embd_params": embd_n, "output_params": out_n,
                "n_embd": info.n_embd, "n_vocab": info.n_vocab, "layer_expert_bytes": exp_bytes,
                "layer_expert_params": exp_params, "n_expert": n_expert, "n_expert_used": n_used}

    # GGUFReader takes seconds on a large vocabulary: remember the sizes per file (as ModelInfo)
    rec = remembered(path, "plan", compute, None, lambda v: isinstance(v, dict) and v.get("format") == _SIZES_FORMAT,
                     strict=False)
    return ModelSizes(str(path), **{k: v for k, v in rec.items() if k != "format"}, kv=info.kv_layout)


def _count(reader, key: str) -> int:
    """An integer header value (0 when absent or not a number)."""
    field = reader.fields.get(key)
    if field is None:
        return 0
    try:
        v = field.contents()
    except (ValueError, IndexError, TypeError):
        return 0
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else 0


# 3: the KV cache from ModelInfo's layout (was kv_bytes_per_layer_cell); 4: routed-expert bytes
_SIZES_FORMAT = 4


