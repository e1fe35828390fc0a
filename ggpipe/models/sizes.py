"""Tensor sizes of a GGUF grouped by layer (bytes): what ``ggpipe plan``'s
memory table and the simulator's model description (ggpipe.sim.model) read
from a file's header. Remembered per file, as ModelInfo is. The KV cache is
sized by ggpipe.models.kv_size from the layout ModelInfo read."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ggpipe.models.cache import remembered
from ggpipe.models.gguf_info import load_gguf, read_model_info
from ggpipe.models.kv_size import KVLayout, kv_bytes_per_cell, kv_cells
from ggpipe.models.registry import resolve

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

    @property
    def head_bytes(self) -> int:
        """Weight bytes the LM head reads (output norm + output, or the tied token_embd)."""
        return self.output_bytes + (self.embd_bytes if self.tied else 0)

    @property
    def head_params(self) -> int:
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


def model_sizes(name_or_path: str) -> ModelSizes:
    """Tensor sizes of a model (registry name or path) grouped by layer.

    Raises:
        ModelError: unknown name, unreadable or non-GGUF file.
    """
    path = resolve(name_or_path)
    info = read_model_info(path)  # validates the file in a bounded child process first

    def compute() -> dict:
        reader = load_gguf(path)
        layer = [0] * info.n_layer
        params = [0] * info.n_layer
        embd = out = other = embd_n = out_n = 0
        has_output = False
        for t in reader.tensors:
            n, k = int(t.n_bytes), int(t.n_elements)
            m = _LAYER.match(t.name)
            if m and int(m.group(1)) < info.n_layer:
                layer[int(m.group(1))] += n
                params[int(m.group(1))] += k
            elif t.name.startswith("token_embd."):
                embd += n
                embd_n += k
            elif t.name.startswith(("output.", "output_norm.")):
                out += n
                out_n += k
                has_output = has_output or t.name.startswith("output.")
            else:
                other += n
        return {"format": _SIZES_FORMAT, "n_layer": info.n_layer, "layer_bytes": layer, "embd_bytes": embd,
                "output_bytes": out, "other_bytes": other, "tied": not has_output, "layer_params": params,
                "embd_params": embd_n, "output_params": out_n,
                "n_embd": info.n_embd, "n_vocab": info.n_vocab}

    # GGUFReader takes seconds on a large vocabulary: remember the sizes per file (as ModelInfo)
    rec = remembered(path, "plan", compute, None, lambda v: isinstance(v, dict) and v.get("format") == _SIZES_FORMAT,
                     strict=False)
    return ModelSizes(str(path), **{k: v for k, v in rec.items() if k != "format"}, kv=info.kv_layout)


_SIZES_FORMAT = 3  # 3: the KV cache from ModelInfo's layout (was kv_bytes_per_layer_cell)


