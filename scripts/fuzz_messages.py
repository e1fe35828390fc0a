"""Coverage-guided fuzzing (atheris / libFuzzer) of everything that parses
bytes from another rank: the message decoders of ggpipe/transport/messages.py
and the native llama_batch filler (native/ggpipe_native.c).

    pip install atheris
    python scripts/fuzz_messages.py -atheris_runs=200000     # or -max_total_time=300

A decoder may only return a header or raise ProtocolError; the batch filler
may only fill the batch or raise ValueError. Anything else (another
exception, a crash, a hang, an out-of-bounds write caught by the checks
around the batch) is a finding. The hypothesis tests in
tests/test_messages.py run the same properties in CI.
"""

from __future__ import annotations

import ctypes
import sys

import atheris

with atheris.instrument_imports():
    import numpy as np

    from ggpipe.errors import ProtocolError
    from ggpipe.transport import messages as m

N_SEQ_MAX, MAX_TOKENS, N_VOCAB, N_BATCH = 8, 64, 1000, 8


def _setup_batch():
    from ggpipe.runtime import llama

    L = llama.lib()
    return L, llama.native(), L.llama_batch_init(N_BATCH, 0, 4)


L, NATIVE, BATCH = _setup_batch()


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    which = fdp.ConsumeIntInRange(0, 6)
    n = fdp.ConsumeIntInRange(0, 64)
    ints = np.array(fdp.ConsumeIntListInRange(n, -(2**31), 2**31 - 1), dtype=np.int32)
    if fdp.ConsumeBool() and n >= 2:  # often a valid prefix, so the fuzzer gets past it
        ints[0] = m.MAGIC
        ints[1] = [m.T_DECODE, m.T_LOGITS, m.T_KV, m.T_SHUTDOWN, m.T_CANCEL, m.T_DECODE, m.T_PRUNE][which]
    try:
        if which == 0 or which == 5:
            m.decode_decode(ints, N_SEQ_MAX, MAX_TOKENS)
        elif which == 1:
            m.decode_logits(ints, N_VOCAB, MAX_TOKENS)
        elif which == 2:
            m.decode_kv(ints, N_SEQ_MAX)
        elif which == 3:
            m.decode_simple(ints, m.T_SHUTDOWN)
        elif which == 6:
            m.decode_prune(ints, N_SEQ_MAX)
        else:
            m.decode_simple(ints, m.T_CANCEL)
    except ProtocolError:
        pass
    # the native filler with arbitrary arrays
    k = fdp.ConsumeIntInRange(0, 12)
    tok = np.array(fdp.ConsumeIntListInRange(k, -5, 2000), dtype=np.int32)
    pos = np.array(fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 12), -2, 100), dtype=np.int32)
    nseq = np.array(fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 12), -1, 6), dtype=np.int32)
    seq = np.array(fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 40), -1, 6), dtype=np.int32)
    out = np.array(fdp.ConsumeIntListInRange(fdp.ConsumeIntInRange(0, 12), 0, 1), dtype=np.int8)
    try:
        NATIVE.fill_batch(ctypes.addressof(BATCH), N_BATCH, 0, 4, tok, None, pos, nseq, seq, out)
    except ValueError:
        pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
