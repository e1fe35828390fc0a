"""Which kernels a job runs and what that means for exactness: the build,
the extra buffer types in use and the batch-row probe of the head's own
stage (``--json``'s and ``/v1/models``' ``kernels``)."""

from __future__ import annotations

from ggpipe.cluster.session import Session
from ggpipe.runtime import llama as _llama


def kernels_report(session: Session) -> dict:
    """Which kernels the job runs and what that means for exactness
    (``--json``'s and ``/v1/models``' ``kernels``): ``llamafile_sgemm``
    (the build), ``extra_bufts`` (the extra buffer types in use, e.g.
    ``["CPU_REPACK"]``; [] with ``--exact``/``--no-repack``), ``exact``
    (``--exact``), and ``batch_rows_exact``: whether a verification batch's
    rows equal lone-token rows bit for bit, measured on the head's own stage
    with its settings (ggpipe.models.row_probe; cached per model, build and
    setting). Where it is False, speculative greedy output is still the
    target's argmax on every verified row, but can differ from iterative
    decoding's at a near-tie. None where it was not measured: a recurrent
    or hybrid model (no speculation), or a stage llama.cpp could not probe
    (``batch_rows_error`` says why)."""
    from ggpipe.models.row_probe import RowSetting, batch_rows_exact  # noqa: PLC0415
    from ggpipe.runtime.kernels import extra_buffer_types  # noqa: PLC0415

    spec = session.stage.spec
    out = {"llamafile_sgemm": _llama.llamafile_sgemm(), "exact": session.config.exact,
           "extra_bufts": extra_buffer_types() if spec.extra_bufts else [],
           "batch_rows_exact": None, "batch_rows_max_diff": None}
    if _llama.is_recurrent(session.stage.model):
        return out
    try:
        probe = batch_rows_exact(spec.model_path, RowSetting(spec.n_threads, spec.flash_attn, spec.cache_type_k,
                                                             spec.cache_type_v, spec.extra_bufts))
    except RuntimeError as e:
        return {**out, "batch_rows_error": str(e)}
    return {**out, "batch_rows_exact": probe["batch_rows_exact"], "batch_rows_max_diff": probe["max_abs_diff"]}
