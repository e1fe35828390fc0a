"""Per-hop transport overhead: ping-pong between two MPI ranks.

    mpiexec -n 2 python scripts/bench_transport.py [--iters 2000] [--json OUT]

Compares ggpipe's Transport (Isend with kept-alive buffers; Iprobe waits with
sleep back-off, which yield the core) against raw blocking mpi4py Send/Recv
(which spins a core while waiting), for the messages a pipeline hop carries
with SmolLM2-135M (n_embd 576, n_vocab 49152): a decode start message plus
the hidden states of 1, 4 and 32 tokens, and one token's logits. Reports the
one-way latency (round trip / 2) in microseconds, and the CPU time the
waiting rank used per microsecond of waiting.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import numpy as np
from mpi4py import MPI

from ggpipe.transport import messages as m
from ggpipe.transport.mpi import Transport

N_EMBD, N_VOCAB = 576, 49152


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def start_msg(n: int) -> np.ndarray:
    return m.encode_decode(m.DecodeHeader(1, np.arange(n, dtype=np.int32), np.ones(n, np.int32),
                                          np.zeros(n, np.int32), np.ones(n, np.int8), m.PAYLOAD_EMBD))


def pingpong_transport(t: Transport, rank: int, payload: np.ndarray, start: np.ndarray, iters: int) -> float:
    peer = 1 - rank
    t0 = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            t.send(peer, m.T_DECODE, start)
            t.send(peer, m.T_DECODE, payload)
            t.recv(peer, MPI.ANY_TAG, np.int32, "pong start")
            t.recv(peer, m.T_DECODE, payload.dtype, "pong payload")
        else:
            t.recv(peer, MPI.ANY_TAG, np.int32, "ping start")
            t.recv(peer, m.T_DECODE, payload.dtype, "ping payload")
            t.send(peer, m.T_DECODE, start)
            t.send(peer, m.T_DECODE, payload)
    t.flush()
    return (time.perf_counter() - t0) / iters / 2


def pingpong_raw(comm, rank: int, payload: np.ndarray, start: np.ndarray, iters: int) -> float:
    peer = 1 - rank
    rbuf_s, rbuf_p = np.empty_like(start), np.empty_like(payload)
    t0 = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            comm.Send(start, peer, 1)
            comm.Send(payload, peer, 1)
            comm.Recv(rbuf_s, peer, 1)
            comm.Recv(rbuf_p, peer, 1)
        else:
            comm.Recv(rbuf_s, peer, 1)
            comm.Recv(rbuf_p, peer, 1)
            comm.Send(start, peer, 1)
            comm.Send(payload, peer, 1)
    return (time.perf_counter() - t0) / iters / 2


def idle_cpu(t: Transport, comm, rank: int, wait_s: float) -> dict:
    """CPU seconds rank 1 burns while waiting ``wait_s`` for one message."""
    out = {}
    for name in ("transport", "raw"):
        comm.Barrier()
        if rank == 0:
            time.sleep(wait_s)
            comm.Send(np.zeros(1, np.int32), 1, 77)
        else:
            c0 = cpu_s()
            if name == "transport":
                t.recv(0, 77, np.int32, "idle probe")
            else:
                comm.Recv(np.zeros(1, np.int32), 0, 77)
            out[name] = (cpu_s() - c0) / wait_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    assert comm.Get_size() == 2, "run with mpiexec -n 2"
    t = Transport(comm, timeout_s=30)
    cases = [("1 token hidden state", start_msg(1), np.zeros(N_EMBD, np.float32)),
             ("4 tokens hidden state", start_msg(4), np.zeros(4 * N_EMBD, np.float32)),
             ("32 tokens hidden state", start_msg(32), np.zeros(32 * N_EMBD, np.float32)),
             ("1 token logits", m.encode_logits(m.LogitsHeader(1, 1, N_VOCAB)), np.zeros(N_VOCAB, np.float32))]
    rows = []
    for name, start, payload in cases:
        iters = a.iters if payload.nbytes < 100_000 else max(200, a.iters // 5)
        pingpong_transport(t, rank, payload, start, 50)  # warm up
        ours = pingpong_transport(t, rank, payload, start, iters)
        raw = pingpong_raw(comm, rank, payload, start, iters)
        rows.append({"message": name, "bytes": int(payload.nbytes + start.nbytes),
                     "ggpipe_us": ours * 1e6, "raw_mpi_us": raw * 1e6})
    idle = idle_cpu(t, comm, rank, 2.0)
    if rank == 1:
        comm.send(idle, 0, 78)
    else:
        idle = comm.recv(source=1, tag=78)
        print("| message | bytes | ggpipe Transport one-way (us) | blocking mpi4py one-way (us) |")
        print("|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['message']} | {r['bytes']} | {r['ggpipe_us']:.1f} | {r['raw_mpi_us']:.1f} |")
        print(f"\nCPU used while waiting 2 s for a message: Transport {idle['transport']*100:.1f}% of a core, "
              f"blocking Recv {idle['raw']*100:.1f}%")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"rows": rows, "idle_cpu_fraction": idle}, f, indent=1)


if __name__ == "__main__":
    main()
