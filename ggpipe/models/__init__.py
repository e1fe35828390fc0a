"""Models: GGUF validation, layer slicing/derivation, the registry and cache.

Public API::

    read_model_info(path) -> ModelInfo          # validate a GGUF, read its facts (remembered)
    check_sliceable(info)                        # ModelError unless layer slices stay exact (models.slicing)
    derive_gguf(src, layers, out_path, out_type="keep", progress=False) -> Path
    parse_layer_list("0-19,10-29") -> list[int]
    stage_slice(src, start, stop, cache_dir=None) -> Path
    registry_path() / load_registry() / cache_dir()
    fetch(name, progress=True) -> Path
    resolve(name_or_path, fetch_missing=True) -> Path
    DEFAULT_MODEL
"""

from ggpipe.models.cache import cache_dir, cached_sha256
from ggpipe.models.derive import derive_gguf, format_layer_list, parse_layer_list, stage_slice
from ggpipe.models.gguf_info import ModelInfo, read_model_info
from ggpipe.models.slicing import check_sliceable, sliceable_archs
from ggpipe.models.registry import (
    DEFAULT_MODEL,
    ModelEntry,
    fetch,
    get_entry,
    is_cached,
    load_registry,
    model_path,
    registry_path,
    resolve,
    verify,
)

__all__ = [
    "DEFAULT_MODEL",
    "ModelEntry",
    "ModelInfo",
    "cache_dir",
    "cached_sha256",
    "check_sliceable",
    "derive_gguf",
    "fetch",
    "format_layer_list",
    "get_entry",
    "is_cached",
    "load_registry",
    "model_path",
    "parse_layer_list",
    "read_model_info",
    "registry_path",
    "resolve",
    "sliceable_archs",
    "stage_slice",
    "verify",
]
