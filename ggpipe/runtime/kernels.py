"""Which CPU kernels a stage's weights run on: llama.cpp's extra buffer types.

llama.cpp's CPU backend offers *extra buffer types* for weights
(``ggml_backend_dev_get_extra_bufts``): ``CPU_REPACK`` re-lays Q4_0, Q4_K,
IQ4_NL, Q8_0, ... matrices into interleaved blocks at load time for faster
GEMV/GEMM kernels (``ggml-cpu/repack.cpp``), and on CPUs with AMX the ``AMX``
buffer type runs Q4_0/Q4_1/Q8_0/K-quants through AMX tiles
(``ggml-cpu/amx/``). llama.cpp uses them by default
(``llama_model_params.use_extra_bufts``; its tools' ``-nr, --no-repack``
turns them all off).

ggpipe uses them by default too, with one exception: the ``AMX`` buffer type
is left out wherever the CPU has it, because its matmul crashed
(``ggml_backend_amx_mul_mat``) on multi-token batches of a Q4_1 model on an
AMX-capable Xeon (docs/ERRORS.md, "A model whose kernels crash"). Leaving it
out keeps ``CPU_REPACK`` for every type it supports: the weights AMX would
have taken are then repacked (or run on the plain kernels, for Q4_1).
The list llama.cpp reads is the CPU device's own array
(``ggml_backend_cpu_device_get_extra_buffers_type`` returns a pointer to a
static, NULL-terminated array that ``llama_model_load_from_file`` reads on
every load): :func:`drop_extra_buffer_types` removes entries from it in
place, once per process, before any model loads.

``exact=True`` (``--exact``) turns every extra buffer type off, as
llama.cpp's ``--no-repack``: repacked GEMM kernels compute a batch's rows in
groups of 4 and the rest with the GEMV kernel, so a row's last bits could
depend on where it sits in a batch.
"""

from __future__ import annotations

import ctypes
import pathlib

from ggpipe.runtime import llama as _llama

#: Extra buffer types ggpipe leaves out by default (by ``ggml_backend_buft_name``).
LEFT_OUT = ("AMX",)

_state: dict = {}


def _ggml():
    """libggml (the backend registry: ``ggml_backend_dev_by_type``, ...) as
    llama-cpp-python loaded it, with the prototypes used here."""
    if "ggml" in _state:
        return _state["ggml"]
    _llama.lib()
    import llama_cpp._ggml as ggml_mod  # noqa: PLC0415

    libdir = pathlib.Path(ggml_mod.libggml_base_path)
    found = sorted(libdir.glob("libggml.so*")) or sorted(libdir.glob("libggml.*"))
    if not found:
        raise OSError(f"no libggml library under {libdir}")
    g = ctypes.CDLL(str(found[0]))
    g.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    g.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    g.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    g.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    g.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    g.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    g.ggml_backend_buft_name.restype = ctypes.c_char_p
    g.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    _state["ggml"] = g
    return g


def _extra_bufts_array():
    """The CPU device's NULL-terminated array of extra buffer types
    (``ggml_backend_buffer_type_t *``), or None where the backend has none."""
    g = _ggml()
    dev = g.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev:
        return None
    reg = g.ggml_backend_dev_backend_reg(dev)
    fn = g.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    if not fn:
        return None
    get = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(fn)
    arr = get(dev)
    return ctypes.cast(arr, ctypes.POINTER(ctypes.c_void_p)) if arr else None


def extra_buffer_types() -> list[str]:
    """Names of the extra buffer types a model load uses now, in llama.cpp's
    order of preference (e.g. ``["CPU_REPACK"]``, or ``["AMX", "CPU_REPACK"]``
    before :func:`drop_extra_buffer_types`)."""
    arr = _extra_bufts_array()
    names: list[str] = []
    i = 0
    while arr is not None and arr[i]:
        names.append(_ggml().ggml_backend_buft_name(arr[i]).decode())
        i += 1
    return names


def drop_extra_buffer_types(names=LEFT_OUT) -> list[str]:
    """Remove the extra buffer types called ``names`` from the list every
    later model load of this process reads (in place, keeping the others'
    order). Returns the names removed (none where the CPU lacks them)."""
    arr = _extra_bufts_array()
    if arr is None:
        return []
    g = _ggml()
    kept, dropped, i = [], [], 0
    while arr[i]:
        name = g.ggml_backend_buft_name(arr[i]).decode()
        if name in names:
            dropped.append(name)
        else:
            kept.append(arr[i])
        i += 1
    for j, p in enumerate(kept):
        arr[j] = p
    for j in range(len(kept), i):
        arr[j] = None
    return dropped


def use_extra_bufts(wanted: bool) -> bool:
    """``llama_model_params.use_extra_bufts`` for a load: ``wanted`` (False
    with ``--exact`` or ``--no-repack``), after leaving out :data:`LEFT_OUT`
    once per process when True."""
    if not wanted:
        return False
    if "dropped" not in _state:
        _state["dropped"] = drop_extra_buffer_types()
    return True
