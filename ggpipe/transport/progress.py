"""One reusable helper thread that polls while the caller's thread is busy
(:meth:`ggpipe.transport.mpi.Transport.computing`: pending sends, PipeInfer's
cancellation probes, while a stage is inside ``llama_decode``).

A thread per computation leaked: MPICH keeps per-thread state for every
thread that enters MPI and does not free it when the thread ends, about 300
bytes each (``mpiexec -n 1`` with 20,000 short threads that each call
``Iprobe``: +5.1 MB RSS). A last stage under ``serve`` computes some 1,500
runs a minute, which was the steady 0.37 MB a minute that a 30-minute
``serve`` soak measured (docs/benchmarks/memory.md, Long runs, has the
figures since). A transport now keeps its helpers for its life (one per
thread that computes at once), each asleep on a condition between blocks. No MPI here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class PollingHelper:
    """A daemon thread, started on first use, that runs ``step()`` between
    :meth:`start` and :meth:`stop`, sleeping between steps with back-off.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str):
        self.name = name
        self._cv = threading.Condition()
        self._job: tuple | None = None   # (step, first_delay_s, max_delay_s, shorten) while a block runs
        self._gen = 0                    # blocks started so far
        self._busy = False               # the thread is inside a block's loop
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.threads_started = 0

    def start(self, step: Callable[[], bool], first_delay_s: float, max_delay_s: float,
              shorten: Callable[[float], float] = lambda d: d) -> None:
        """Begin a block: call ``step()`` now and then after sleeps growing
        1.5x from ``first_delay_s`` to ``max_delay_s`` (seconds, each passed
        through ``shorten``), until ``step()`` returns False (nothing more to
        do in this block) or :meth:`stop` is called."""
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
                self.threads_started += 1
            self._job = (step, first_delay_s, max_delay_s, shorten)
            self._gen += 1
            self._error = None
            self._cv.notify_all()

    def stop(self) -> BaseException | None:
        """End the block: returns once ``step()`` is not running and will not
        run again before the next :meth:`start`. Returns what ``step()``
        raised in this block (it ends the block's polling), or None."""
        with self._cv:
            self._job = None
            self._cv.notify_all()
            while self._busy:
                self._cv.wait()
            err, self._error = self._error, None
            return err

    def _run(self) -> None:
        served = 0
        while True:
            with self._cv:
                while self._job is None or self._gen == served:
                    self._cv.wait()
                served = self._gen
                step, delay, max_delay, shorten = self._job
                self._busy = True
            try:
                while step():
                    with self._cv:
                        if self._job is None or self._gen != served:
                            break
                        self._cv.wait(shorten(delay))
                        if self._job is None or self._gen != served:
                            break
                    delay = min(delay * 1.5, max_delay)
            except BaseException as exc:  # noqa: BLE001 - handed to stop(), which the block's thread raises
                with self._cv:
                    self._error = exc
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()
