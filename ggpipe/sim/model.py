"""Model descriptions for the simulator: per-layer weight bytes and weights,
the output head, the hidden size (activation bytes on a link) and the
vocabulary. Read from a GGUF's header (no weights loaded), or built from an
architecture's shape and a quantization's bits per weight, so a 70B Q3_K_M
is described without being downloaded (PipeInfer section V, Table I).
"""

from __future__ import annotations

from dataclasses import dataclass

from ggpipe.models.shapes import (
    ARCHITECTURES,
    BITS_PER_WEIGHT,
    Architecture,
    is_shape,
    parse_shape,
)
from ggpipe.sim.profile import LayerShape

__all__ = ["ARCHITECTURES", "BITS_PER_WEIGHT", "Architecture", "ModelDesc", "described", "from_gguf", "from_sizes",
           "resolve_desc"]


@dataclass(frozen=True)
class ModelDesc:
    """Attributes:
        name: for reports.
        layers: one LayerShape per block, in order.
        head: the output norm + LM head (tied: the token embedding).
        n_embd: hidden size (float32 activations of n_embd x 4 bytes per
            token cross each link).
        n_vocab: vocabulary size (a full logit row is n_vocab x 4 bytes).
    """

    name: str
    layers: tuple[LayerShape, ...]
    head: LayerShape
    n_embd: int
    n_vocab: int

    @property
    def n_layer(self) -> int:
        """Blocks of the model."""
        return len(self.layers)

    @property
    def bytes(self) -> int:
        """Weight bytes of every block and the head."""
        return sum(s.bytes for s in self.layers) + self.head.bytes


def from_sizes(name: str, m) -> ModelDesc:
    """The description of a model of sizes ``m`` (ggpipe.models.sizes.ModelSizes:
    of a GGUF's header or of a shape); routed experts as such."""
    n = m.n_layer
    eb, ep = m.layer_expert_bytes or [0] * n, m.layer_expert_params or [0] * n
    layers = tuple(LayerShape(b, p, e, q, m.n_expert if e else 0, m.n_expert_used if e else 0)
                   for b, p, e, q in zip(m.layer_bytes, m.layer_params or m.layer_bytes, eb, ep))
    return ModelDesc(name, layers, LayerShape(m.head_bytes, m.head_params or m.head_bytes), m.n_embd, m.n_vocab)


def from_gguf(name_or_path: str) -> ModelDesc:
    """The description of a model from its GGUF's header (registry name or
    path), or from its shape (ARCH:QUANT, or a described registry model
    whose file is not in the cache).

    Raises:
        ModelError: unknown name, unreadable or non-GGUF file."""
    from ggpipe.models.sizes import model_sizes

    return from_sizes(name_or_path, model_sizes(name_or_path))


def described(name: str, arch: Architecture, quant: str) -> ModelDesc:
    """A model of shape ``arch`` quantized as ``quant`` (a key of BITS_PER_WEIGHT).

    Raises:
        ConfigError: unknown quantization."""
    from ggpipe.models.sizes import shape_sizes

    return from_sizes(f"{name} {quant.upper()}", shape_sizes(arch, quant, f"{name}:{quant.upper()}"))


def resolve_desc(text: str) -> ModelDesc:
    """``ARCH:QUANT`` (a key of ARCHITECTURES and of BITS_PER_WEIGHT, e.g.
    ``llama2-70b:Q3_K_M``) or a GGUF (registry name or path; a described
    registry model without its file: its shape).

    Raises:
        ConfigError, ModelError: neither."""
    if is_shape(text):
        name, arch, quant = parse_shape(text)
        return described(name, arch, quant)
    return from_gguf(text)
