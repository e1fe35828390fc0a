"""Cost profiles of hosts and links: what ``ggpipe calibrate`` measures and
``ggpipe simulate`` / ``ggpipe plan --balance`` read. Pure (numpy, json).

A profile file (JSON, ``"format": "ggpipe-profile/1"``) holds one record per
rank (its host, thread count and measured costs) and one per measured link.
Every cost is in seconds, every size in bytes.

Costs are measured on one model (the calibration model) and carried to
another by weight bytes: decoding a layer on a CPU streams its weights from
memory, so a layer twice as large costs about twice as much at the same batch
size (PipeInfer section V: CPU inference is memory-bandwidth bound). A
*described* host (no measurement: memory bandwidth and peak FLOP/s, for
hosts one cannot run on) uses the roofline ``max(bytes / bandwidth,
2 * params * n / flops)`` instead.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ggpipe.errors import ConfigError

FORMAT = "ggpipe-profile/1"
BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear in x through (xs, ys), extended linearly past the
    last point with the slope of the last two (batch sizes above the
    calibrated ones, e.g. 512-token prompt chunks)."""
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    if x <= xs[-1]:
        return float(np.interp(x, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (x - xs[-1])


@dataclass(frozen=True)
class LayerShape:
    """One layer (or the output head) of a model, for costs.

    Attributes:
        bytes: weight bytes of the layer (what it holds in memory).
        params: weights (count).
        expert_bytes, expert_params: the part of ``bytes``/``params`` in
            mixture-of-experts tensors (``*_exps``), of which each token uses
            ``n_expert_used`` of ``n_expert``.
    """

    bytes: int
    params: int
    expert_bytes: int = 0
    expert_params: int = 0
    n_expert: int = 0
    n_expert_used: int = 0

    def bytes_read(self, n: int) -> float:
        """Weight bytes a batch of ``n`` tokens reads: the dense part, and
        the experts the batch touches, expected under uniform routing:
        ``1 - (1 - used/experts)^n`` of them (one token reads
        used/experts; a large batch reads them all)."""
        if not self.n_expert or not self.expert_bytes:
            return float(self.bytes)
        touched = 1.0 - (1.0 - self.n_expert_used / self.n_expert) ** max(1, n)
        return self.bytes - self.expert_bytes + self.expert_bytes * touched

    def active_params(self) -> float:
        """Weights one token multiplies (its experts only): FLOPs = 2 x this."""
        if not self.n_expert:
            return float(self.params)
        return self.params - self.expert_params + self.expert_params * self.n_expert_used / self.n_expert


@dataclass
class HostProfile:
    """Measured (or described) costs of one rank.

    Attributes:
        host: host name.
        rank: MPI rank the record was measured on.
        threads: llama.cpp threads the rank used.
        batch_sizes: tokens per decode the costs were measured at.
        layer_s: seconds per layer of the calibration model, per batch size,
            at KV length ``kv_ref``.
        layer_bytes: weight bytes of one calibration-model layer.
        head_s: seconds of the output norm + LM head per batch size (one
            logit row per token).
        head_bytes: weight bytes of the calibration model's output head.
        kv_s_per_cell: extra seconds per layer, per token, per KV cell
            attended beyond ``kv_ref`` (attention's share).
        kv_ref: KV length (cells) ``layer_s`` was measured at.
        draft_s: seconds of a whole draft-model decode per batch size, one
            logit row (None: no draft measured; the draft's cost then scales
            from the layer and head costs).
        draft_name: the draft model ``draft_s`` was measured on.
        overhead_s: the head's own work per result in the iterative loop
            (sampling, the next submit; measured on rank 0), also charged
            per draft result.
        spec_overhead_s: the same per target result in the pipelined loop
            (speculation graph, KV partitions, verification).
        mem_bw_Bps, flops: a described host's memory bandwidth (bytes/s) and
            peak FLOP/s; set, they replace the measured curves (roofline).
        mem_bytes: memory the host offers to ranks (bytes; 0 unknown).
        busy_slowdown: ``busy_slowdown[j-1]``: how many times longer a layer
            takes while j other ranks of the same host compute (shared cores,
            memory bandwidth); empty: measured alone.
        wait_slowdown: the same while j other ranks wait for a message
            (an idle MPI rank polls).
        stream_layers: blocks of the middle stage ``layer_s`` was measured
            on (enough that their weights exceed the last-level cache, as a
            job's stage streams them from memory every token); 0: unknown.
        cached_layer_s: seconds of one block at batch 1 timed alone, again
            and again (its weights in the cache): the check that
            ``layer_s`` streams (``layer_s[0]`` / this is how much a cached
            measurement would have overstated the speed); None: not measured.
    """

    host: str
    rank: int = 0
    threads: int = 1
    batch_sizes: list[int] = field(default_factory=lambda: list(BATCH_SIZES))
    layer_s: list[float] = field(default_factory=list)
    layer_bytes: int = 0
    head_s: list[float] = field(default_factory=list)
    head_bytes: int = 0
    kv_s_per_cell: float = 0.0
    kv_ref: int = 0
    draft_s: list[float] | None = None
    draft_name: str | None = None
    overhead_s: float = 0.0
    spec_overhead_s: float = 0.0
    mem_bw_Bps: float | None = None
    flops: float | None = None
    mem_bytes: int = 0
    busy_slowdown: list[float] = field(default_factory=list)
    wait_slowdown: list[float] = field(default_factory=list)
    stream_layers: int = 0
    cached_layer_s: float | None = None

    @property
    def described(self) -> bool:
        """A described host (a memory bandwidth given): costs come from the
        roofline of ``mem_bw_Bps`` and ``flops``, not from measured curves."""
        return self.mem_bw_Bps is not None

    def _roofline(self, shape: LayerShape, n: int) -> float:
        return max(shape.bytes_read(n) / self.mem_bw_Bps, 2.0 * shape.active_params() * n / self.flops)

    def layer_cost(self, shape: LayerShape, n: int, kv: int = 0) -> float:
        """Seconds to evaluate one layer of ``shape`` for ``n`` tokens whose
        attention spans ``kv`` cells."""
        if self.described:
            return self._roofline(shape, n)
        # measured on a dense calibration layer: scaled by the bytes this batch reads
        scale = shape.bytes_read(n) / self.layer_bytes
        return (_interp(self.batch_sizes, self.layer_s, n) + self.kv_s_per_cell * n * max(0, kv - self.kv_ref)) * scale

    def head_cost(self, shape: LayerShape, n_out: int) -> float:
        """Seconds of the output norm + LM head for ``n_out`` logit rows."""
        if n_out <= 0:
            return 0.0
        if self.described:
            return self._roofline(shape, n_out)
        return _interp(self.batch_sizes, self.head_s, n_out) * shape.bytes / self.head_bytes

    def draft_cost(self, n: int, n_out: int, head: LayerShape, draft_name: str | None = None) -> float | None:
        """Seconds of a whole draft decode of ``n`` tokens returning ``n_out``
        logit rows (``head``: the draft's output head), measured on the draft
        ``draft_name``; None when not measured on that draft."""
        if self.draft_s is None or self.described or (draft_name is not None and draft_name != self.draft_name):
            return None
        extra = self.head_cost(head, n_out) - self.head_cost(head, 1) if n_out > 1 else 0.0
        return _interp(self.batch_sizes, self.draft_s, n) + extra

    def check(self) -> None:
        """Raises ConfigError: a record whose curves cannot give a cost."""
        if self.described:
            if not (self.mem_bw_Bps > 0 and self.flops and self.flops > 0):
                raise ConfigError(f"host {self.host}: mem_bw_Bps and flops must be positive")
            return
        n = len(self.batch_sizes)
        if n == 0 or len(self.layer_s) != n or len(self.head_s) != n or (
                self.draft_s is not None and len(self.draft_s) != n):
            raise ConfigError(f"host {self.host} (rank {self.rank}): every cost curve needs one value per batch size")
        if self.layer_bytes <= 0 or self.head_bytes <= 0:
            raise ConfigError(f"host {self.host} (rank {self.rank}): layer_bytes and head_bytes must be positive")
        if any(not math.isfinite(v) or v < 0 for v in self.layer_s + self.head_s + (self.draft_s or [])):
            raise ConfigError(f"host {self.host} (rank {self.rank}): a cost is negative or not a number")


@dataclass
class LinkProfile:
    """One direction of a link between two ranks.

    Attributes:
        src, dst: ranks.
        latency_s: one-way time of an empty message (seconds).
        bandwidth_Bps: bytes per second (0: unlimited).
    """

    src: int
    dst: int
    latency_s: float
    bandwidth_Bps: float = 0.0

    def transfer_s(self, nbytes: int) -> float:
        """One-way seconds for a message of ``nbytes``."""
        return self.latency_s + (nbytes / self.bandwidth_Bps if self.bandwidth_Bps > 0 else 0.0)


@dataclass
class Profile:
    """Hosts (one record per rank, in rank order) and links.

    Attributes:
        model: name of the calibration model.
        draft: name of the calibration draft model (or None).
        hosts: per-rank records.
        links: measured links (either direction).
        meta: free-form facts (when, ggpipe version, command).
        agreement: how often the draft's token is the target's, measured by
            ``calibrate -md`` (ggpipe.service.agreement.Agreement's fields:
            ``rate`` (0..1), ``positions``, ``agreed``, ``prompts``,
            ``tokens``, ``exponent``), or None; ``simulate`` takes ``rate``
            as its ``--acceptance`` and ``exponent`` as its
            ``--confidence-exponent`` for this model pair.
    """

    model: str
    draft: str | None
    hosts: list[HostProfile]
    links: list[LinkProfile] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    agreement: dict | None = None

    def _agreement_of(self, target: str, draft: str | None) -> dict | None:
        """The measured agreement when ``target`` and ``draft`` (names or
        paths, as given to simulate) are the pair calibrated, by name or
        file name; else None."""
        if not self.agreement or draft is None or self.draft is None:
            return None

        def same(a: str, b: str) -> bool:
            return a == b or Path(a).name == Path(b).name or Path(a).stem == Path(b).stem

        return self.agreement if same(target, self.model) and same(draft, self.draft) else None

    def acceptance_for(self, target: str, draft: str | None) -> float | None:
        """The measured agreement rate (0..1) of the pair ``target``,
        ``draft`` (see :meth:`_agreement_of`), or None."""
        a = self._agreement_of(target, draft)
        return None if a is None else float(a["rate"])

    def confidence_exponent_for(self, target: str, draft: str | None) -> float | None:
        """The measured k of P(agreed | the draft's confidence q) = q ** k of
        the pair ``target``, ``draft`` (see :meth:`_agreement_of`), or None
        (not calibrated, or by a calibrate that did not measure it)."""
        a = self._agreement_of(target, draft)
        return None if a is None or a.get("exponent") is None else float(a["exponent"])

    def host(self, rank: int) -> HostProfile:
        """The record of ``rank``; a job larger than the profile reuses the
        records cyclically (rank r gets record r mod len(hosts))."""
        return self.hosts[rank % len(self.hosts)]

    def link(self, src: int, dst: int) -> LinkProfile:
        """The measured link src -> dst, else dst -> src, else the first
        measured link (a uniform network), else a free link."""
        for ln in self.links:
            if (ln.src, ln.dst) == (src, dst):
                return ln
        for ln in self.links:
            if (ln.src, ln.dst) == (dst, src):
                return LinkProfile(src, dst, ln.latency_s, ln.bandwidth_Bps)
        if self.links:
            return LinkProfile(src, dst, self.links[0].latency_s, self.links[0].bandwidth_Bps)
        return LinkProfile(src, dst, 0.0, 0.0)

    def to_dict(self) -> dict:
        """The profile as JSON-ready data (``format``, ``model``, ``draft``,
        ``meta``, ``hosts``, ``links``), as :meth:`from_dict` reads it."""
        return {"format": FORMAT, "model": self.model, "draft": self.draft, "meta": self.meta,
                "hosts": [asdict(h) for h in self.hosts], "links": [asdict(ln) for ln in self.links],
                "agreement": self.agreement}

    @classmethod
    def from_dict(cls, d: dict, where: str = "profile") -> "Profile":
        """Raises ConfigError: not a profile, or a record is malformed."""
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ConfigError(f"{where} is not a ggpipe profile (expected \"format\": \"{FORMAT}\"; "
                              "make one with ggpipe calibrate)")
        try:
            hosts = [HostProfile(**h) for h in d["hosts"]]
            links = [LinkProfile(**ln) for ln in d.get("links", [])]
            prof = cls(d.get("model", ""), d.get("draft"), hosts, links, d.get("meta", {}), d.get("agreement"))
            if prof.agreement is not None:
                rate = float(prof.agreement["rate"])
                if not 0.0 <= rate <= 1.0:
                    raise TypeError(f"agreement rate {rate} is not in 0..1")
                k = prof.agreement.get("exponent")
                if k is not None and not 0.05 <= float(k) <= 20.0:
                    raise TypeError(f"confidence exponent {k} is not in 0.05..20")
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: malformed profile record ({exc})") from None
        if not hosts:
            raise ConfigError(f"{where}: the profile has no host records")
        for h in hosts:
            h.check()
        return prof

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_dict` to ``path`` as indented JSON."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Raises ConfigError: missing, unreadable or not a profile."""
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"profile {p} does not exist (make one with ggpipe calibrate)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read profile {p}: {exc}") from None
        return cls.from_dict(d, str(p))


def slowdown(curve: list[float], others: float) -> float:
    """Factor (>= 1) of ``others`` (possibly fractional) other ranks, from a
    measured curve (index j-1: j others), linear in between and beyond."""
    if not curve or others <= 0:
        return 1.0
    xs = [0.0] + [float(j) for j in range(1, len(curve) + 1)]
    ys = [1.0] + [max(1.0, c) for c in curve]
    if others <= xs[-1]:
        return float(np.interp(others, xs, ys))
    return ys[-1] + (ys[-1] - 1.0) / xs[-1] * (others - xs[-1])
