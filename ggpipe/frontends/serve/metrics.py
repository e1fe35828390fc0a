"""The Prometheus metrics of ``ggpipe serve`` (``GET /metrics``)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily


class ServeMetrics:
    """Prometheus metrics of one server (its own registry)."""

    def __init__(self, queue_depth: Callable[[], float], running: Callable[[], float], n_slots: int = 1,
                 tokens_per_s: Callable[[], float] | None = None, step_tokens: Callable[[], dict] | None = None):
        disable_created_metrics()  # no *_created series: they only add noise here
        r = self.registry = CollectorRegistry()
        self.requests = Counter("ggpipe_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ggpipe_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.reused_tokens = Counter("ggpipe_prompt_tokens_reused", "Prompt tokens whose KV cells were reused",
                                     registry=r)
        self.prompt_processed = Counter("ggpipe_prompt_tokens_processed", "Prompt tokens of finished requests "
                                        "that were decoded (not reused)", registry=r)
        self.prompt_seconds = Counter("ggpipe_prompt_seconds", "Seconds finished requests spent processing "
                                      "their prompts (from the slot to the first token; prompt tokens per second: "
                                      "ggpipe_prompt_tokens_processed over it)", registry=r)
        self.gen_tokens = Counter("ggpipe_generated_tokens", "Generated tokens", registry=r)
        self.gen_seconds = Counter("ggpipe_generation_seconds", "Seconds spent generating (after the prompt)",
                                   registry=r)
        self.tokens_per_s = Gauge("ggpipe_tokens_per_second", "Generation speed of the last finished request",
                                  registry=r)
        self.ttft = Histogram("ggpipe_time_to_first_token_seconds",
                              "From the start of a request's generation to its first token (queue wait excluded)",
                              buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.queue_wait = Histogram("ggpipe_queue_wait_seconds", "Time a request waited in the queue",
                                    buckets=(.01, .1, .5, 1, 5, 10, 30, 60, 300), registry=r)
        self.duration = Histogram("ggpipe_request_duration_seconds", "Generation time of a request (queue excluded)",
                                  buckets=(.1, .5, 1, 2.5, 5, 10, 30, 60, 300), registry=r)
        itl = (.005, .01, .02, .03, .05, .075, .1, .15, .25, .5, 1)
        self.itl_p50 = Histogram("ggpipe_inter_token_latency_p50_seconds",
                                 "Median gap between a finished request's accepted tokens", buckets=itl, registry=r)
        self.itl_p90 = Histogram("ggpipe_inter_token_latency_p90_seconds",
                                 "90th percentile gap between a finished request's accepted tokens", buckets=itl,
                                 registry=r)
        self.drafted = Counter("ggpipe_draft_tokens", "Draft tokens proposed (speculative modes)", registry=r)
        self.accepted = Counter("ggpipe_draft_tokens_accepted", "Draft tokens accepted (speculative modes)",
                                registry=r)
        self.acceptance = Gauge("ggpipe_acceptance_rate", "Accepted / drafted tokens since start (speculative modes; "
                                "NaN before any draft)", registry=r)
        self.acceptance.set(float("nan"))
        # by position after a root (ggpipe.speculation.draft_stats; vLLM's spec_decode_num_accepted_tokens_per_pos)
        self.verified_pos = Counter("ggpipe_draft_tokens_verified_per_position",
                                    "Drafted tokens the target verified, by their position after the last token it "
                                    "produced itself (0: the first drafted token)", ["position"], registry=r)
        self.accepted_pos = Counter("ggpipe_draft_tokens_accepted_per_position",
                                    "Of the verified drafted tokens, those the target accepted, by position",
                                    ["position"], registry=r)
        g = Gauge("ggpipe_queue_depth", "Requests waiting in the queue (not counting the running one)", registry=r)
        g.set_function(queue_depth)
        g = Gauge("ggpipe_requests_running", "Requests being generated now (= slots busy)", registry=r)
        g.set_function(running)
        g = Gauge("ggpipe_slots_busy", "Slots holding a request (--parallel)", registry=r)
        g.set_function(running)
        Gauge("ggpipe_slots", "Slots: requests that can run at once (--parallel)", registry=r).set(n_slots)
        g = Gauge("ggpipe_aggregate_tokens_per_second", "Tokens generated per second over the last 10 s, all "
                  "requests together", registry=r)
        if tokens_per_s is not None:
            g.set_function(tokens_per_s)
        self._drafted = self._accepted = 0.0
        if step_tokens is not None:
            r.register(_StepTokens(step_tokens))

    def finished(self, done, queue_wait_s: float) -> None:
        """Record a finished request (``done``: a Completion; its
        ``decoder`` statistics' drafted and accepted tokens, in all and per
        position, go to the drafting counters)."""
        m = done.metrics
        self.prompt_tokens.inc(done.n_prompt)
        self.reused_tokens.inc(done.n_reused)
        self.prompt_processed.inc(done.n_prompt - done.n_reused)
        if m.get("prompt_s"):
            self.prompt_seconds.inc(m["prompt_s"])
        self.gen_tokens.inc(len(done.tokens))
        self.queue_wait.observe(queue_wait_s)
        if m.get("gen_s"):
            self.gen_seconds.inc(m["gen_s"])
        if m.get("tokens_per_s"):
            self.tokens_per_s.set(m["tokens_per_s"])
        if m.get("ttft_wall_s") is not None:
            self.ttft.observe(m["ttft_wall_s"])
        if m.get("total_s") is not None:
            self.duration.observe(m["total_s"])
        if m.get("itl_p50_s") is not None:
            self.itl_p50.observe(m["itl_p50_s"])
            self.itl_p90.observe(m["itl_p90_s"])
        d = done.decoder
        if d.get("drafted"):
            self.drafted.inc(d["drafted"])
            self.accepted.inc(d.get("draft_accepted") or 0)
            self._drafted += d["drafted"]
            self._accepted += d.get("draft_accepted") or 0
            self.acceptance.set(self._accepted / self._drafted)
        for i, (v, a) in enumerate(zip(d.get("verified_per_position") or (), d.get("accepted_per_position") or ())):
            self.verified_pos.labels(position=str(i)).inc(v)
            self.accepted_pos.labels(position=str(i)).inc(a)


class _StepTokens:
    """A Prometheus collector of what the micro-batches carried
    (``RequestLoop.step_tokens``): ``ggpipe_micro_batches`` and
    ``ggpipe_micro_batch_tokens{kind=decode|draft|prompt}``, read when
    ``/metrics`` is."""

    def __init__(self, read: Callable[[], dict]):
        self.read = read

    def collect(self):
        counts = self.read()
        yield CounterMetricFamily("ggpipe_micro_batches", "Micro-batches sent down the pipeline",
                                  value=counts["micro_batches"])
        tokens = CounterMetricFamily("ggpipe_micro_batch_tokens", "Tokens the micro-batches carried, by kind: "
                                     "generating requests' next tokens (decode), drafted tokens (draft), prompt "
                                     "tokens (prompt)", labels=["kind"])
        for kind in ("decode", "draft", "prompt"):
            tokens.add_metric([kind], counts[kind])
        yield tokens
