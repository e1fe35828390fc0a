"""A job's workload before it loads: how many prompt tokens its requests
hold and how many tokens they may generate, counted on the head with a
vocabulary-only load of the model (``ggpipe.runtime.vocab.vocab_only``),
as the engine will tokenize them. The session splits the layers for
prompts where they dominate (``ggpipe.cluster.split.prompts_dominate``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

#: A request as the workload counts it: (plain prompt or None, chat messages or None, most tokens to generate).
WorkloadRequest = tuple[str | None, list[dict] | None, int]


def workload(model: str, requests: Callable[[], Iterable[WorkloadRequest]], n_cells: int) -> tuple[int, int] | None:
    """(prompt tokens, most generated tokens) of ``requests()``: each a
    plain prompt (special-token text parsed, as ``Engine.tokenize`` parses
    it) or chat messages rendered with the model's template, and its most
    tokens to generate. None where the requests, the model or a template
    cannot be read or rendered, or a request is empty or does not fit the
    ``n_cells`` KV cells one request may fill
    (:func:`~ggpipe.runtime.vocab.check_prompt_fits`: the job then refuses
    it as always, in one line, with no choice made for it); a model not in
    the cache is not fetched here (its download waits for loading).

    ``model``: a registry name or a GGUF path (``ggpipe.models.registry.resolve``)."""
    from ggpipe.models.registry import resolve  # noqa: PLC0415
    from ggpipe.runtime.vocab import check_prompt_fits, vocab_only  # noqa: PLC0415
    from ggpipe.service.chat_prompt import chat_tokens  # noqa: PLC0415

    n_prompt = n_generated = 0
    try:
        reqs = list(requests())
        with vocab_only(resolve(model, fetch_missing=False)) as vocab:
            for prompt, messages, n_predict in reqs:
                toks = chat_tokens(vocab, messages) if messages is not None else vocab.tokenize(prompt or "")
                check_prompt_fits(int(toks.shape[0]), n_predict, n_cells)
                n_prompt += int(toks.shape[0])
                n_generated += n_predict
    except Exception:   # noqa: BLE001 - a guess only: whatever is wrong, the job reports it once loaded
        return None
    return n_prompt, n_generated
