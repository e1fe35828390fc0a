"""Recovery from a lost rank: what the supervisor of a job
(:mod:`ggpipe.frontends.supervisor`) learns from a job's stderr and decides
after it ends. MPI-free and unit-tested.

A rank that is lost is named in one line by its guard
(:func:`ggpipe.transport.rank_guard.death_line`) or by the head's heartbeats
(:meth:`ggpipe.transport.liveness.Liveness.message`); :func:`parse_loss`
reads the rank and its host back from either. :class:`RecoveryPolicy` then
decides where the next job runs: on the same hosts (a process died, its host
is still there), or without a host whose ranks were lost in
:data:`EXCLUDE_AFTER` jobs in a row that made no progress (a host that is
gone for good, or crashes whatever it runs), a spare of the hostfile taking
its place where there is one, else with its stages fewer.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field

from ggpipe.cluster.plan import place_ranks

#: The file a supervised job's head writes once every rank has loaded (set by the supervisor).
READY_ENV = "GGPIPE_READY_FILE"

#: Jobs in a row that lost a rank on one host without making progress, after which the host is left out.
EXCLUDE_AFTER = 3

# "ggpipe: error: rank 1 (node2, pid 4242, target layers 20-39) died (killed by SIGKILL) ..." (the guard) and
# "ggpipe: error: [rank 2: ]the head, rank 0 (node1, pid 17) is stopped (SIGSTOP?) ..." (the heartbeats)
_LOSS = re.compile(r"ggpipe: error: (?:rank \d+: )?(?:the head, )?rank (\d+) \(([^,()\s]+), pid (\d+)[^)]*\) "
                   r"(died|is stopped|stopped answering)")


@dataclass(frozen=True)
class Loss:
    """A lost rank as its line names it: rank, host, pid and how ("died",
    "is stopped", "stopped answering"); ``line``: the whole line."""

    rank: int
    host: str
    pid: int
    how: str
    line: str


def parse_loss(line: str) -> Loss | None:
    """The lost rank a line of a job's stderr names, or None."""
    m = _LOSS.search(line)
    if m is None:
        return None
    return Loss(int(m.group(1)), m.group(2), int(m.group(3)), m.group(4), line.strip())


@dataclass
class RecoveryPolicy:
    """Where each job of a supervised command runs (``n_ranks`` ranks on
    ``hosts``), given how the last one ended.

    Args:
        n_ranks: the ranks asked for (``--ranks``).
        hosts: the hostfile's (host, slots), in order; None: every rank on
            this host. Ranks are placed one per host in turn
            (:func:`ggpipe.cluster.plan.place_ranks`, ``node``); hosts past
            the first ``n_ranks`` are spares.
        exclude_after: jobs in a row that lost a rank on one host and made
            no progress, after which that host is left out.
    """

    n_ranks: int
    hosts: list[tuple[str, int]] | None
    exclude_after: int = EXCLUDE_AFTER
    strikes: dict[str, int] = field(default_factory=dict)
    excluded: list[str] = field(default_factory=list)
    last_host: str | None = None

    def placed(self) -> list[str]:
        """The host of each rank of the next job."""
        return place_ranks(self.n_ranks, self.hosts, "node")

    def lost(self, loss: Loss | None, progressed: bool) -> str | None:
        """A job ended with ``loss`` (None: it ended before it was ready and
        named no rank, e.g. a host that cannot be reached; then the host of
        the last loss is blamed). ``progressed``: the job did some of the
        work (a result written). Returns None to run again (see
        :meth:`launch`) or the reason there is nowhere left to run.

        Raises:
            ValueError: no loss and none before it (nothing to recover from).
        """
        host = self._host_of(loss) if loss is not None else self.last_host
        if host is None:
            raise ValueError("no lost rank to recover from")
        self.last_host = host
        if progressed:
            self.strikes.clear()
        self.strikes[host] = self.strikes.get(host, 0) + 1
        if self.strikes[host] < self.exclude_after:
            return None
        return self._exclude(host)

    def _host_of(self, loss: Loss) -> str:
        """The hostfile's entry of the lost rank (the rank's own host name,
        as its line gives it, may be another name of it: a hostfile of
        addresses, a full domain name): ranks are placed one per host in
        turn, so rank r ran on the r-th entry placed."""
        if self.hosts is None:
            return loss.host
        placed = self.placed()
        return placed[loss.rank] if 0 <= loss.rank < len(placed) else loss.host

    def _exclude(self, host: str) -> str | None:
        why = f"host {host} lost a rank in {self.strikes[host]} jobs in a row that made no progress"
        if self.hosts is None or len(self.hosts) == 1:
            return f"{why}, and there is no other host to run on"
        if self.hosts[0][0] == host:
            return f"{why}, and it is the head's host (first in the hostfile)"
        before = self.placed()
        self.hosts = [h for h in self.hosts if h[0] != host]
        spare = any(h not in before for h, _ in self.hosts)
        if not spare:
            self.n_ranks -= before.count(host)
        self.excluded.append(host)
        del self.strikes[host]
        return None if self.n_ranks >= 1 else f"{why}, and no rank is left"


def write_ready(stages: list[str]) -> None:
    """On the head of a supervised job (``$GGPIPE_READY_FILE`` set), once
    every rank has loaded: write that file, a JSON object whose
    ``"stages"`` is each rank's part ("rank 1 (node2): target layers
    10-19"), atomically (a temporary file renamed). Nothing without the
    variable; a file that cannot be written is left unwritten (the
    supervisor then reports no start-up time)."""
    path = os.environ.get(READY_ENV)
    if not path:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"stages": stages}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def read_ready(path: str | os.PathLike) -> list[str] | None:
    """The stages a ready file lists, or None while there is none (or it
    cannot be read)."""
    try:
        with open(path, encoding="utf-8") as f:
            return [str(x) for x in json.load(f)["stages"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
