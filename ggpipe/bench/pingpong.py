"""Ping-pong between ranks 0 and 1 through ggpipe's Transport (so through
link emulation when ``GGPIPE_LINK`` is set).

    mpiexec -n 2 python -m ggpipe.bench.pingpong [--bytes 2344] [--iters 50]

Rank 0 prints one JSON line: the link, message size (bytes) and the round
trip's mean / p50 / min in seconds. A round trip crosses the hop in both
directions, so an emulated link adds ``2 * (latency + bytes / bandwidth)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

TAG = 77


def pingpong(transport, peer: int, nbytes: int, iters: int, warmup: int = 5) -> list[float]:
    """Round-trip times (s) of ``iters`` ping-pongs of ``nbytes`` bytes with
    ``peer`` (rank 0 pings, the other rank echoes; returns [] there)."""
    msg = np.zeros(nbytes, dtype=np.int8)
    out = []
    for i in range(warmup + iters):
        if transport.rank == 0:
            t0 = time.perf_counter()
            transport.send(peer, TAG, msg)
            transport.recv(peer, TAG, np.int8, "the pong")
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        else:
            _, buf = transport.recv(peer, TAG, np.int8, "the ping")
            transport.send(peer, TAG, buf)
    transport.flush()
    return out


def main() -> None:
    """Command-line entry (``--bytes``, ``--iters``): ranks 0 and 1 ping-pong
    through a :class:`~ggpipe.transport.mpi.Transport`; rank 0 prints the JSON
    line. Raises SystemExit when not started under an MPI launcher with at
    least 2 ranks; further ranks take no part."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=2344, help="message size (bytes); 2344 = one SmolLM2 hidden state")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    from ggpipe.transport.link import format_link
    from ggpipe.transport.mpi import Transport, mpi_world

    world = mpi_world()
    if world is None or world[2] < 2:
        raise SystemExit("run under mpiexec -n 2")
    comm, rank, _ = world
    t = Transport(comm, timeout_s=30)
    if rank > 1:
        return
    rtt = pingpong(t, 1 - rank, a.bytes, a.iters)
    if rank == 0:
        print(json.dumps({"link": format_link(t._link.link if t._link else None), "bytes": a.bytes,
                          "iters": a.iters, "rtt_mean_s": statistics.mean(rtt), "rtt_p50_s": statistics.median(rtt),
                          "rtt_min_s": min(rtt)}), flush=True)


if __name__ == "__main__":
    main()
