"""Random-weight GGUFs of real model shapes, written directly in Q4_K_M.

A registry entry ``random = "ARCH:Q4_K_M"`` (an architecture of
:mod:`ggpipe.models.shapes`), ``seed`` and ``base`` names one:
:func:`write_random_gguf` writes a ``llama`` GGUF of that shape whose
tokenizer (every ``tokenizer.*`` entry, chat template included) is the
base model's, so prompts tokenize and chats format as with the base.

Each matrix gets the type llama.cpp's quantizer would give it
(:func:`ggpipe.models.quant_plan.q4_k_m_types`); its blocks are written
directly: random quants (bytes of a PCG64 stream seeded with ``(seed,
tensor index)``) under fixed block scales, so that the dequantized weights
have mean ~0 and standard deviation ~:data:`WEIGHT_STD` and activations stay
finite. Norms are F32 ones. The bytes depend on nothing but the shape,
the seed and the base's tokenizer: the same file (same sha256) everywhere.
The weights mean nothing: such a model measures speed, memory and
throughput, never acceptance or text quality.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import numpy as np
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from ggpipe.errors import GGPipeError, ModelError
from ggpipe.models.derive import copy_fields, write_gguf
from ggpipe.models.gguf_info import load_gguf, read_model_info
from ggpipe.models.quant_plan import QK_K, q4_k_m_types
from ggpipe.models.shapes import Architecture, parse_shape

__all__ = ["LLAMA3_HPARAMS", "WEIGHT_STD", "check_random_arch", "check_random_shape", "random_tensors", "write_random_gguf"]

Q = GGMLQuantizationType
QUANT = "Q4_K_M"
WEIGHT_STD = 0.02  # of the dequantized weights
# Llama 3's settings: RoPE base, RMS norm epsilon, trained context length (tokens)
LLAMA3_HPARAMS = {"rope_freq_base": 500000.0, "rms_eps": 1e-5, "context_length": 8192}
_CHUNK_BLOCKS = 1 << 16  # super-blocks generated at a time (9-14 MB)

# Q4_K: w = d*sc*q - dmin*m, q uniform in 0..15 (std sqrt(255/12)); all sub-block
# scales sc and mins m are 32 (the 12 packed bytes below), dmin = 7.5 d: mean ~0.
_Q4_SCALES = np.array([160] * 8 + [0] * 4, np.uint8)
_Q4_D = WEIGHT_STD / (32 * np.sqrt(255 / 12))
_Q4_HEAD = np.array([_Q4_D, 7.5 * _Q4_D], "<f2").view(np.uint8)
# Q6_K: w = d*sc*(q - 32), q uniform in 0..63 (std sqrt(4095/12)); every sc is 8.
_Q6_SCALES = np.full(16, 8, np.uint8)
_Q6_D = np.array([WEIGHT_STD / (8 * np.sqrt(4095 / 12))], "<f2").view(np.uint8)


def check_random_shape(text: str) -> tuple[str, Architecture]:
    """``"ARCH:Q4_K_M"`` -> (ARCH, its Architecture), if this module can write it.

    Raises:
        ModelError: not a shape, another quantization than Q4_K_M, or an
            architecture :func:`check_random_arch` refuses."""
    try:
        key, arch, quant = parse_shape(text)
    except GGPipeError as e:
        raise ModelError(str(e)) from None
    if quant != QUANT:
        raise ModelError(f"random weights are written in {QUANT} only, not {quant}")
    check_random_arch(key, arch)
    return key, arch


def check_random_arch(key: str, arch: Architecture) -> None:
    """Refuse (ModelError) an Architecture (named ``key``) this module cannot
    write: not a dense Llama (experts, MLA, a 2-matrix FFN, a head size other
    than n_embd / n_head) or widths that are not multiples of 256."""
    dense = not arch.n_expert and not arch.kv_latent and arch.ffn_mats == 3
    if not dense or arch.head_dim not in (None, arch.n_embd // arch.n_head) or arch.n_embd % arch.n_head:
        raise ModelError(f"random weights are written for dense Llama shapes only, not {key}")
    if arch.n_embd % QK_K or arch.n_ff % QK_K:
        raise ModelError(f"{key}: n_embd {arch.n_embd} and n_ff {arch.n_ff} must be multiples of {QK_K}")


def random_tensors(arch: Architecture) -> list[tuple[str, tuple[int, ...]]]:
    """(name, GGML shape ``ne``: row width first) of every tensor of a Llama
    of shape ``arch``, in file order; no ``output.weight`` if ``arch.tied``."""
    e, f, kv = arch.n_embd, arch.n_ff, arch.n_embd // arch.n_head * arch.n_head_kv
    out: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (e, arch.n_vocab))]
    for i in range(arch.n_layer):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (e,)), (b + "attn_q.weight", (e, e)), (b + "attn_k.weight", (e, kv)),
                (b + "attn_v.weight", (e, kv)), (b + "attn_output.weight", (e, e)), (b + "ffn_norm.weight", (e,)),
                (b + "ffn_gate.weight", (e, f)), (b + "ffn_up.weight", (e, f)), (b + "ffn_down.weight", (f, e))]
    out.append(("output_norm.weight", (e,)))
    if not arch.tied:
        out.append(("output.weight", (e, arch.n_vocab)))
    return out


def _blocks(qtype: Q, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` super-blocks of ``qtype`` (Q4_K or Q6_K) with random quants: uint8 (n, bytes per block)."""
    raw = rng.bit_generator.random_raw(n * (16 if qtype == Q.Q4_K else 24)).astype("<u8", copy=False)
    quants = raw.view(np.uint8).reshape(n, -1)
    if qtype == Q.Q4_K:  # d, dmin (fp16), scales[12], qs[128]
        return np.concatenate([np.broadcast_to(_Q4_HEAD, (n, 4)), np.broadcast_to(_Q4_SCALES, (n, 12)), quants], 1)
    # Q6_K: ql[128], qh[64], scales[16] (int8), d (fp16)
    return np.concatenate([quants, np.broadcast_to(_Q6_SCALES, (n, 16)), np.broadcast_to(_Q6_D, (n, 2))], 1)


class _RandomTensor:
    """Tensor data GGUFWriter writes with ``tofile``, generated a chunk at a
    time: ``shape`` is the byte shape (rows, bytes per row) of a quantized
    type, the element shape of F32."""

    def __init__(self, qtype: Q, ne: Sequence[int], seed: int, index: int):
        self.qtype, self.seed, self.index = qtype, seed, index
        rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
        if qtype == Q.F32:
            self.dtype, self.shape = np.dtype("<f4"), tuple(reversed([int(x) for x in ne]))
            self.nbytes = 4 * int(np.prod(ne, dtype=np.int64))
        else:
            block, size = GGML_QUANT_SIZES[qtype]
            self.dtype, self.shape = np.dtype(np.uint8), (rows, ne[0] // block * size)
            self.nbytes = rows * self.shape[1]
            self.n_blocks = rows * ne[0] // block

    def chunks(self) -> Iterator[np.ndarray]:
        if self.qtype == Q.F32:
            yield np.ones(self.shape, self.dtype)
            return
        rng = np.random.Generator(np.random.PCG64([self.seed, self.index]))
        for start in range(0, self.n_blocks, _CHUNK_BLOCKS):
            yield _blocks(self.qtype, rng, min(_CHUNK_BLOCKS, self.n_blocks - start))

    def tofile(self, f: IO[bytes]) -> None:
        for chunk in self.chunks():
            chunk.tofile(f)


def _add_metadata(writer: GGUFWriter, arch: Architecture, name: str, base: Path) -> None:
    hp = LLAMA3_HPARAMS
    writer.add_name(name)
    writer.add_description(f"random weights of a {arch.n_layer}-block Llama shape, {QUANT}: for speed, memory and "
                           f"throughput measurements only, the text is meaningless")
    writer.add_vocab_size(arch.n_vocab)
    writer.add_context_length(hp["context_length"])
    writer.add_embedding_length(arch.n_embd)
    writer.add_block_count(arch.n_layer)
    writer.add_feed_forward_length(arch.n_ff)
    writer.add_head_count(arch.n_head)
    writer.add_head_count_kv(arch.n_head_kv)
    writer.add_rope_freq_base(hp["rope_freq_base"])
    writer.add_layer_norm_rms_eps(hp["rms_eps"])
    writer.add_rope_dimension_count(arch.n_embd // arch.n_head)
    writer.add_file_type(int(LlamaFileType.MOSTLY_Q4_K_M))
    writer.add_quantization_version(2)
    reader = load_gguf(base)
    n_tokens = len(reader.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in reader.fields else 0
    if n_tokens != arch.n_vocab:
        raise ModelError(f"the tokenizer of {base.name} has {n_tokens} tokens but the shape's vocabulary is "
                         f"{arch.n_vocab}: take a base with that vocabulary")
    copy_fields(reader, writer, base, "tokenizer.")


def write_random_gguf(
    shape: str | Architecture,
    base: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    seed: int,
    name: str,
    progress: bool = False,
    desc: str | None = None,
) -> tuple[Path, str]:
    """Write ``out_path``: a ``llama`` GGUF of ``shape`` (``"ARCH:Q4_K_M"``,
    or an Architecture itself) with random Q4_K_M weights from ``seed`` (an integer >= 0), the
    tokenizer of GGUF ``base`` and ``general.name`` ``name``. Written to a
    temporary file in the same folder and renamed at the end; ``progress``:
    a tqdm bar of bytes written (and one of hashing) on stderr, after the
    line ``desc``. Returns (``out_path``, sha256 of the file in hex).

    Raises:
        ModelError: a shape :func:`check_random_shape` or an Architecture
            :func:`check_random_arch` refuses, a negative
            seed, a base that is no readable GGUF or whose vocabulary is not
            the shape's, or a file that cannot be written."""
    if isinstance(shape, Architecture):
        arch = shape
        check_random_arch("this shape", arch)
    else:
        arch = check_random_shape(shape)[1]
    if seed < 0:
        raise ModelError(f"seed must be an integer >= 0, got {seed}")
    base, out_path = Path(base).expanduser(), Path(out_path).expanduser()
    read_model_info(base)  # refuses a damaged GGUF in a bounded child process
    if not out_path.parent.is_dir():
        raise ModelError(f"cannot write {out_path}: directory {out_path.parent} does not exist")
    tensors = random_tensors(arch)
    types = q4_k_m_types(tensors, arch.n_layer, arch.n_head, arch.n_head_kv)

    def fill(writer: GGUFWriter) -> None:
        _add_metadata(writer, arch, name, base)
        for i, ((tname, ne), qtype) in enumerate(zip(tensors, types)):
            data = _RandomTensor(qtype, ne, seed, i)
            writer.add_tensor(tname, data, raw_shape=data.shape, raw_dtype=qtype)  # type: ignore[arg-type]

    return write_gguf(out_path, "llama", fill, progress, desc, hash_progress=True)
