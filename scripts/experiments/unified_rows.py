"""Does a request's logit row stay bit-identical when other sequences hold
cells in the same KV buffer? One KV stream per slot (``kv_unified =
false``) is how ``--parallel`` keeps every request exact; a unified buffer
(llama-server's default for ``-np``, and what PipeInfer's and PipeDec's
shared cells need) puts other sequences' cells beside a request's own.

    python scripts/experiments/unified_rows.py -m smollm2-135m
    python scripts/experiments/unified_rows.py -m smollm2-goliath-40l -fa on

One stage holding the whole model, ``-t`` threads (default 1), extra
buffer types off (as ``--exact``). Sequence 0 decodes a 700-token context in chunks, then 40
tokens one at a time; the reference does that alone in a context of one
sequence. Compared, bit for bit, with the same in a unified buffer of two
sequences where sequence 1 (another request) holds cells:

* ``interleaved``: sequence 1's chunks alternate with sequence 0's (two
  requests prefilled and decoded side by side);
* ``after``: sequence 1 decodes 500 tokens once sequence 0's context is in
  (a cached prefix of another slot);
* ``empty``: sequence 1 holds nothing (the control).

Printed per layout: the largest difference of any logit over the 40 rows,
and how many rows were bit-identical. Run it in the exact build
(``scripts/install_exact.sh``) to leave sgemm out of the question; the
default build gives the same picture.
"""

from __future__ import annotations

import argparse

import numpy as np

from ggpipe.models.gguf_info import read_model_info
from ggpipe.models.registry import resolve
from ggpipe.runtime.stage import Stage, StageSpec

CHUNK = 50


def one_seq(st: Stage, seq: int, tokens: list[int], p0: int, logits: bool) -> np.ndarray | None:
    """Decode ``tokens`` in sequence ``seq`` from position ``p0``; the last row's logits if asked."""
    n = len(tokens)
    out = np.zeros(n, np.int8)
    out[-1] = int(logits)
    got = st.decode(tokens=np.asarray(tokens, np.int32), pos=np.arange(p0, p0 + n, dtype=np.int32),
                    n_seq_id=np.ones(n, np.int32), seq_ids=np.full(n, seq, np.int32), outputs=out)
    return got[-1].copy() if logits else None


def rows(path, n_layer: int, fa: str, threads: int, layout: str) -> list[np.ndarray]:
    """Sequence 0's 40 decode rows in ``layout`` (``alone``: a context of one sequence)."""
    rng = np.random.default_rng(0)
    a, b, gen = (rng.integers(100, 20000, n).tolist() for n in (700, 700, 40))
    st = Stage(StageSpec(model_path=path, n_layer=n_layer, first=True, last=True, n_ctx=4096, n_threads=threads,
                         n_seq_max=1 if layout == "alone" else 2, kv_unified=True, flash_attn=fa,
                         extra_bufts=False))
    try:
        for p in range(0, 700, CHUNK):
            one_seq(st, 0, a[p:p + CHUNK], p, False)
            if layout == "interleaved":
                one_seq(st, 1, b[p:p + CHUNK], p, False)
        if layout == "after":
            for p in range(0, 500, CHUNK):
                one_seq(st, 1, b[p:p + CHUNK], p, False)
        out = []
        for i, t in enumerate(gen):
            out.append(one_seq(st, 0, [t], 700 + i, True))
            if layout == "interleaved":
                one_seq(st, 1, [t], 700 + i, False)
        return out
    finally:
        st.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-fa", "--flash-attn", default="off", choices=["off", "on"])
    ap.add_argument("-t", "--threads", type=int, default=1)
    a = ap.parse_args()
    path = resolve(a.model)
    n_layer = read_model_info(path).n_layer
    ref = rows(path, n_layer, a.flash_attn, a.threads, "alone")
    print(f"{a.model}, flash attention {a.flash_attn}, {a.threads} thread(s): sequence 0's 40 decode rows "
          "against the same alone")
    for layout in ("interleaved", "after", "empty"):
        got = rows(path, n_layer, a.flash_attn, a.threads, layout)
        diff = [float(np.abs(g - r).max()) for g, r in zip(got, ref)]
        print(f"  {layout:12s} largest logit difference {max(diff):.4g}, bit-identical rows "
              f"{sum(d == 0 for d in diff)} of {len(diff)}")


if __name__ == "__main__":
    main()
