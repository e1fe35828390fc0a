"""Loading llama.cpp (through llama-cpp-python's ctypes bindings) and the native hooks.

Import cost and global side effects live here, once per process:
``llama_backend_init``, silencing llama.cpp's log (it writes to stderr on
every model load; ggpipe ranks print nothing but errors unless ``-v``), and
``ggpipe._native.init`` with the path of the ``libggml-base`` that
llama-cpp-python loaded.
"""

from __future__ import annotations

import ctypes
import pathlib
import sys

_state: dict = {}


def lib():
    """Return the ``llama_cpp`` module (low-level ctypes API), initialised once.

    Raises:
        ImportError: llama-cpp-python is not installed.
    """
    if "llama_cpp" in _state:
        return _state["llama_cpp"]
    import llama_cpp  # noqa: PLC0415 (heavy import, done on first use)

    llama_cpp.llama_backend_init()
    _install_log_filter(llama_cpp, verbose=_state.get("verbose", False))
    _state["llama_cpp"] = llama_cpp
    return llama_cpp


FLASH_ATTN = ("off", "on", "auto")


def flash_attn_type(mode: str) -> int:
    """llama.cpp's ``llama_flash_attn_type`` for ``-fa on|off|auto`` (its
    tools' meaning: auto = on where the backend supports it, which the CPU
    backend does).

    Raises:
        ValueError: another value.
    """
    L = lib()
    types = {"off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED, "on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED,
             "auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO}
    if mode not in types:
        raise ValueError(f"flash attention must be one of {', '.join(FLASH_ATTN)}, got {mode!r}")
    return types[mode]


#: KV cache types llama.cpp's tools accept for -ctk/-ctv (common/arg.cpp
#: ``kv_cache_types``), by ggml name: (ggml_type id, values per block, bytes
#: per block), as ggml's type traits (``ggml_type_size``/``ggml_blck_size``).
KV_CACHE_TYPES = {
    "f32": (0, 1, 4),
    "f16": (1, 1, 2),
    "bf16": (30, 1, 2),
    "q8_0": (8, 32, 34),
    "q4_0": (2, 32, 18),
    "q4_1": (3, 32, 20),
    "iq4_nl": (20, 32, 18),
    "q5_0": (6, 32, 22),
    "q5_1": (7, 32, 24),
}


def kv_cache_type(name: str) -> int:
    """llama.cpp's ``ggml_type`` for a ``-ctk``/``-ctv`` name (``q8_0``).

    Raises:
        ValueError: not one of :data:`KV_CACHE_TYPES`.
    """
    if name not in KV_CACHE_TYPES:
        raise ValueError(f"KV cache type must be one of {', '.join(KV_CACHE_TYPES)}, got {name!r}")
    return KV_CACHE_TYPES[name][0]


def kv_type_is_quantized(name: str) -> bool:
    """A block-quantized cache type (llama.cpp's ``ggml_is_quantized``): a
    V cache of one needs flash attention."""
    return KV_CACHE_TYPES[name][1] > 1


#: ``--numa``: llama.cpp's names (common/arg.cpp) -> ``ggml_numa_strategy``.
NUMA = {"distribute": 1, "isolate": 2, "numactl": 3}


def numa_init(strategy: str | None) -> None:
    """``llama_numa_init`` with ``--numa``'s strategy, once per process,
    before the first model loads (None: nothing, llama.cpp's default).
    llama.cpp ignores a second call ("numa already initialized").

    Raises:
        ValueError: not one of :data:`NUMA`.
    """
    if strategy is None or _state.get("numa") is not None:
        return
    if strategy not in NUMA:
        raise ValueError(f"--numa must be one of {', '.join(NUMA)}, got {strategy!r}")
    lib().llama_numa_init(NUMA[strategy])
    _state["numa"] = strategy


def load_mode(mlock: bool, no_mmap: bool) -> int:
    """llama.cpp's ``llama_load_mode`` for ``--mlock`` / ``--no-mmap`` (the
    names its tools had before ``--load-mode``; this vendored llama.cpp
    folds ``use_mmap``/``use_mlock`` into ``llama_model_params.load_mode``):
    neither = auto (mmap), ``--no-mmap`` = none (read into memory),
    ``--mlock`` = mmap+mlock, both = mlock."""
    L = lib()
    if mlock:
        return L.LLAMA_LOAD_MODE_MLOCK if no_mmap else L.LLAMA_LOAD_MODE_MMAP_MLOCK
    return L.LLAMA_LOAD_MODE_NONE if no_mmap else L.LLAMA_LOAD_MODE_AUTO


def is_recurrent(model) -> bool:
    """Whether a loaded ``llama_model *`` keeps a recurrent state per
    sequence (``llama_model_is_recurrent`` or ``llama_model_is_hybrid``:
    Mamba, RWKV, LFM2, Qwen 3.5, Nemotron-H, ...)."""
    L = lib()
    return bool(L.llama_model_is_recurrent(model)) or bool(L.llama_model_is_hybrid(model))


def file_is_recurrent(path) -> bool:
    """:func:`is_recurrent` of a GGUF file, asked of llama.cpp with a
    vocabulary-only load (metadata and tokenizer, no weights).

    Raises:
        ModelError: llama.cpp cannot read the file."""
    from ggpipe.errors import ModelError  # noqa: PLC0415

    L = lib()
    params = L.llama_model_default_params()
    params.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelError(f"llama.cpp could not read {path}")
    try:
        return is_recurrent(model)
    finally:
        L.llama_model_free(model)


#: The one line that installs the build ``--exact`` needs (docs/user-guide/exactness.md).
EXACT_INSTALL = ('CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" pip install --no-cache-dir --force-reinstall --no-deps '
                 'llama-cpp-python==0.3.36')


def llamafile_sgemm() -> bool:
    """Whether the loaded llama.cpp was built with llamafile's sgemm
    (``GGML_LLAMAFILE``, on by default; ``ggml_cpu_has_llamafile``).

    With it, a token evaluated inside a batch of 2+ tokens goes through
    another matmul kernel than a token evaluated alone (llamafile/sgemm.cpp
    declines one-column products), so F16/F32 logits differ in the last bits
    between a speculative verification batch and the single-token reference
    (NOTES-llamacpp "Batched vs single-token rows"); quantized weights such
    as Q4_1 agree either way. Built as :data:`EXACT_INSTALL` builds it, both
    use ``ggml_vec_dot`` and agree bit for bit (what ``--exact`` needs)."""
    L = lib()
    fn = getattr(L.llama_cpp._lib, "ggml_cpu_has_llamafile", None)
    if fn is None:
        return True  # not exported: assume the default build
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return bool(fn())


def set_verbose(verbose: bool) -> None:
    """Let llama.cpp's own log through to stderr (``-v``); call before :func:`lib`."""
    _state["verbose"] = bool(verbose)


def _install_log_filter(llama_cpp, verbose: bool) -> None:
    @llama_cpp.llama_log_callback
    def _log(level, text, user_data):  # noqa: ARG001
        if verbose:
            sys.stderr.write(text.decode("utf-8", "replace"))

    # llama.cpp keeps the pointer: keep the callback object alive for the
    # life of the process (NOTES-llamacpp: "Known trouble").
    _state["log_cb"] = _log
    llama_cpp.llama_log_set(_log, ctypes.c_void_p(0))


def native():
    """Return the initialised ``ggpipe._native`` extension.

    Raises:
        ImportError: the extension was not built (install ggpipe with pip).
        OSError: libggml-base lacks a symbol the hooks need.
    """
    if "native" in _state:
        return _state["native"]
    lib()
    from ggpipe import _native  # noqa: PLC0415

    import llama_cpp._ggml as ggml_mod  # noqa: PLC0415

    libdir = pathlib.Path(ggml_mod.libggml_base_path)
    candidates = sorted(libdir.glob("libggml-base.*")) or sorted(libdir.glob("*ggml-base*"))
    if not candidates:
        raise OSError(f"no libggml-base library under {libdir}")
    _native.init(str(candidates[0]))
    _state["native"] = _native
    return _native
