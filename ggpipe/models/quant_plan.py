"""Which GGML type each tensor of a dense Llama-like model gets in a Q4_K_M file.

The rule is llama.cpp's (``llama_tensor_get_type`` in ``src/llama-quant.cpp``)
for ``LLAMA_FTYPE_MOSTLY_Q4_K_M``, restricted to the tensors such a model has:

* 1-D tensors (norms) stay F32;
* ``output.weight`` is Q6_K, and so is ``token_embd.weight`` when there is no
  ``output.weight`` (tied embeddings); otherwise ``token_embd.weight`` is Q4_K;
* ``attn_v`` and ``ffn_down`` of layer ``i`` of ``n`` are Q6_K where
  :func:`use_more_bits` holds (the first and last eighth of the layers and
  every third one between; counted over the ``attn_v`` tensors and over
  the layers), else Q4_K; a Llama with 80 layers and grouped KV
  heads (llama.cpp's 70B type) has its other ``attn_v`` in Q5_K;
* every other matrix is Q4_K.

Rows must be a multiple of 256 values wide (the K-quants' super-block):
llama.cpp falls back to other types for narrower rows, which this plan
refuses rather than models.
"""

from __future__ import annotations

from collections.abc import Sequence

from gguf.constants import GGMLQuantizationType as Q

from ggpipe.errors import ModelError

QK_K = 256  # values per K-quant super-block

__all__ = ["QK_K", "q4_k_m_types", "use_more_bits"]


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama.cpp's choice of the layers whose ``attn_v``/``ffn_down`` get more bits."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def q4_k_m_types(
    tensors: Sequence[tuple[str, Sequence[int]]], n_layer: int, n_head: int, n_head_kv: int
) -> list[Q]:
    """The type of each of ``tensors`` (``(name, ne)`` in file order, ``ne``
    the GGML shape, row width first) in a Q4_K_M file of a model with
    ``n_layer`` blocks and ``n_head``/``n_head_kv`` attention heads.

    Raises:
        ModelError: a matrix whose rows are not a multiple of 256 values wide."""
    names = [name for name, _ in tensors]
    tied = "output.weight" not in names
    n_v = sum("attn_v.weight" in name for name in names)  # llama.cpp counts them (n_attention_wv)
    seen_v = seen_down = 0
    out: list[Q] = []
    for name, ne in tensors:
        if len(ne) < 2 or not name.endswith("weight") or "_norm.weight" in name:
            out.append(Q.F32)
            continue
        if ne[0] % QK_K:
            raise ModelError(f"tensor {name}: rows of {ne[0]} values are not a multiple of {QK_K}; llama.cpp's "
                             f"Q4_K_M falls back to other types there, which this plan does not model")
        if name == "output.weight" or (tied and name == "token_embd.weight"):
            qtype = Q.Q6_K
        elif "attn_v.weight" in name:
            more = use_more_bits(seen_v, n_v)
            qtype = Q.Q6_K if more else Q.Q5_K if n_layer == 80 and n_head != n_head_kv else Q.Q4_K
            seen_v += 1
        elif "ffn_down" in name:
            qtype = Q.Q6_K if use_more_bits(seen_down, n_layer) else Q.Q4_K
            seen_down += 1
        else:
            qtype = Q.Q4_K
        out.append(qtype)
    return out
