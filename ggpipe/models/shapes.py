"""Model shapes: a transformer's architecture (layer count, widths, heads,
experts) and a quantization's average bits per weight, so that a model can
be sized without its file ("ARCH:QUANT", e.g. ``llama3.3-70b:Q4_K_M``).

``ggpipe plan`` sizes a shape's weights and KV cache from these
(:func:`ggpipe.models.sizes.shape_sizes`), ``ggpipe simulate`` its costs
(:mod:`ggpipe.sim.model`), and a *described* registry entry (models.toml
``shape = "ARCH:QUANT"``) names one.
"""

from __future__ import annotations

from dataclasses import dataclass

from ggpipe.errors import ConfigError

# average bits per weight of llama.cpp quantization mixes (file bytes x 8 / weights
# of published GGUFs of these sizes; the K-quant mixes keep some tensors wider)
BITS_PER_WEIGHT = {"F32": 32.0, "F16": 16.0, "Q8_0": 8.5, "Q6_K": 6.56, "Q5_K_M": 5.69, "Q4_K_M": 4.85,
                   "Q4_0": 4.55, "Q3_K_M": 3.91, "Q2_K": 3.41,
                   "MXFP4": 4.25}  # GPT-OSS's own release format (experts in MXFP4)


@dataclass(frozen=True)
class Architecture:
    """A transformer's shape (GGUF ``{arch}.*`` keys). ``ffn_mats``: 3 for a
    gated MLP (Llama), 2 for a plain one (Falcon). ``head_dim``: None for
    n_embd / n_head. Mixture of experts: ``n_expert`` experts of
    ``n_ff_exp`` per layer, ``n_expert_used`` per token, ``n_expert_shared``
    always-on experts, the first ``n_layer_dense_lead`` layers dense (n_ff).
    ``kv_latent``: MLA (DeepSeek-2/3) caches one latent of this many values
    per layer and cell (kv_lora_rank + rope dims), K only; 0: K and V rows
    of head_dim x n_head_kv."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    ffn_mats: int = 3
    tied: bool = False
    head_dim: int | None = None
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_expert_shared: int = 0
    n_layer_dense_lead: int = 0
    kv_latent: int = 0

    def attn_params(self) -> int:
        """Weights of one layer's attention: the Q and output projections
        (``n_embd x head_dim x n_head`` each), K and V (``n_embd x head_dim x
        n_head_kv`` each), and the layer's two norm vectors (``n_embd`` each)."""
        hd = self.head_dim or self.n_embd // self.n_head
        return self.n_embd * hd * (2 * self.n_head + 2 * self.n_head_kv) + 2 * self.n_embd

    def layer_params(self, il: int = 0) -> tuple[int, int]:
        """(weights, of which in routed experts) of layer ``il``."""
        if not self.n_expert or il < self.n_layer_dense_lead:
            return self.attn_params() + self.ffn_mats * self.n_embd * self.n_ff, 0
        experts = self.n_expert * self.ffn_mats * self.n_embd * self.n_ff_exp
        shared = self.n_expert_shared * self.ffn_mats * self.n_embd * self.n_ff_exp
        return self.attn_params() + self.n_embd * self.n_expert + shared + experts, experts

    def kv_row(self) -> tuple[int, int]:
        """(K values, V values) one layer caches per cell (llama.cpp's
        n_embd_k_gqa, n_embd_v_gqa; MLA: the latent, no V)."""
        if self.kv_latent:
            return self.kv_latent, 0
        hd = self.head_dim or self.n_embd // self.n_head
        return hd * self.n_head_kv, hd * self.n_head_kv


# PipeInfer Table I's models and PipeDec's pair (shapes from their published config.json / GGUF headers)
ARCHITECTURES = {
    "llama2-70b": Architecture(80, 8192, 28672, 64, 8, 32000),        # Dolphin 2.1 70B
    "goliath-120b": Architecture(137, 8192, 28672, 64, 8, 32000),     # Goliath 120B (Llama 2 70B merge)
    "falcon-180b": Architecture(80, 14848, 59392, 232, 8, 65024, ffn_mats=2),
    "tinyllama-1.1b": Architecture(22, 2048, 5632, 32, 4, 32000),
    "llama2-7b": Architecture(32, 4096, 11008, 32, 32, 32000),        # XWin-LM 7B
    "llama2-13b": Architecture(40, 5120, 13824, 40, 40, 32000),       # XWin-LM 13B
    "falcon-7b": Architecture(32, 4544, 18176, 71, 1, 65024, ffn_mats=2),
    # PipeDec's pair (its section 4.1)
    "llama3.1-70b": Architecture(80, 8192, 28672, 64, 8, 128256),
    "llama3.2-1b": Architecture(16, 2048, 8192, 32, 8, 128256, tied=True),
    # what CPU clusters run now (shapes from the published config.json)
    "llama3.3-70b": Architecture(80, 8192, 28672, 64, 8, 128256),
    "qwen3-30b-a3b": Architecture(48, 2048, 6144, 32, 4, 151936, head_dim=128, n_expert=128, n_expert_used=8,
                                  n_ff_exp=768),
    "qwen3-235b-a22b": Architecture(94, 4096, 12288, 64, 4, 151936, head_dim=128, n_expert=128, n_expert_used=8,
                                    n_ff_exp=1536),
    "gpt-oss-20b": Architecture(24, 2880, 2880, 64, 8, 201088, head_dim=64, n_expert=32, n_expert_used=4,
                                n_ff_exp=2880),
    "gpt-oss-120b": Architecture(36, 2880, 2880, 64, 8, 201088, head_dim=64, n_expert=128, n_expert_used=4,
                                 n_ff_exp=2880),
    # the random-weight models of the registry (ggpipe.models.random_model): Llama-3-8B's and
    # Llama-3.2-1B's shapes with SmolLM2's vocabulary (its tokenizer is what they carry)
    "llama-7b-shape": Architecture(32, 4096, 14336, 32, 8, 49152),
    "llama-1b-shape": Architecture(16, 2048, 8192, 32, 8, 49152, tied=True),
    # MLA: kv_lora_rank 512 + qk_rope_head_dim 64 cached per layer
    "deepseek-v2-lite": Architecture(27, 2048, 10944, 16, 16, 102400, head_dim=128, n_expert=64, n_expert_used=6,
                                     n_ff_exp=1408, n_expert_shared=2, n_layer_dense_lead=1, kv_latent=576),
}


def bits_per_weight(quant: str) -> float:
    """Average bits per weight of quantization ``quant`` (any case).

    Raises:
        ConfigError: unknown quantization."""
    try:
        return BITS_PER_WEIGHT[quant.upper()]
    except KeyError:
        raise ConfigError(f"unknown quantization {quant!r}: choose one of {', '.join(BITS_PER_WEIGHT)}") from None


def is_shape(text: str) -> bool:
    """Whether ``text`` is meant as ``ARCH:QUANT`` (ARCH a key of ARCHITECTURES)."""
    return ":" in text and text.split(":", 1)[0] in ARCHITECTURES


def parse_shape(text: str) -> tuple[str, Architecture, str]:
    """``ARCH:QUANT`` -> (ARCH, its Architecture, QUANT in upper case).

    Raises:
        ConfigError: not ARCH:QUANT, unknown architecture or quantization."""
    arch, sep, quant = text.partition(":")
    if not sep or not arch or not quant:
        raise ConfigError(f"expected a shape ARCH:QUANT (e.g. llama3.3-70b:Q4_K_M), got {text!r}")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"unknown architecture {arch!r} in {text!r}: choose one of {', '.join(ARCHITECTURES)}")
    bits_per_weight(quant)
    return arch, ARCHITECTURES[arch], quant.upper()
