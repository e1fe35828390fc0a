"""The head rank's generation service, shared by every front end (generate,
chat, batch, serve): every request is a job of one loop with one interface
(ggpipe.decoding.factory.build_loop), the continuous-batching scheduler
(ggpipe.decoding.parallel.scheduler) with ``--parallel N``, each request in
a slot of its own, or with ``--parallel 1`` its one slot
(ggpipe.decoding.one_at_a_time), where the mode's own decoder runs each
request in full, with the KV cache's prefix reused between requests.
"""

from __future__ import annotations

import sys
from pathlib import Path
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ggpipe.errors import ConfigError
from ggpipe.runtime.vocab import Vocab
from ggpipe.sampling import Sampler, TokenLogprob
from ggpipe.sampling_params import SamplingParams
from ggpipe.cluster.session import Session
from ggpipe.decoding.factory import build_loop
from ggpipe.decoding.loop import Job
from ggpipe.decoding.plan import DecodingPlan
from ggpipe.models.registry import resolve
from ggpipe.models.slicing import check_speculation
from ggpipe.pipeline.waiting import EventWait
from ggpipe.runtime import llama as _llama
from ggpipe.service.chat_prompt import chat_tokens
from ggpipe.service.kernels_report import kernels_report
from ggpipe.service.text import Resume, TextStream


@dataclass
class Completion:
    """One finished request.

    Attributes:
        tokens: generated token ids (an end-of-generation token included;
            of a resumed reply, the other job's too).
        text: their text, end-of-generation tokens left out, cut before a
            stop string.
        finish_reason: "stop" (end of generation or a stop string), "length"
            (``n_predict`` reached) or "interrupted" (``should_stop``).
        n_prompt: prompt tokens (the whole prompt, reused cells included).
        n_reused: prompt tokens whose KV cells were reused (not decoded; of
            a resumed reply, the other job's tokens are not counted).
        metrics: GenerationClock.as_dict() (TTFT, ITL, tokens/s; seconds).
        decoder: the mode's statistics (acceptance rate, target passes, ...).
        logprobs: with log-probabilities asked for (``SamplingParams.logprobs``
            >= 0), one ggpipe.sampling.TokenLogprob per token; else None.
    """

    tokens: list[int]
    text: str
    finish_reason: str
    n_prompt: int
    n_reused: int
    metrics: dict
    decoder: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None

    def as_dict(self) -> dict:
        """The completion as JSON-ready data: every attribute (``logprobs`` only
        when asked for: per token ``{token, logprob, top}``, ``top`` a list of
        ``[token, logprob]`` pairs)."""
        out = dict(tokens=self.tokens, text=self.text, finish_reason=self.finish_reason, n_prompt=self.n_prompt,
                   n_reused=self.n_reused, metrics=self.metrics, decoder=self.decoder)
        if self.logprobs is not None:
            out["logprobs"] = [{"token": lp.token, "logprob": lp.logprob, "top": [list(t) for t in lp.top]}
                               for lp in self.logprobs]
        return out


def _recurrent_models(session: Session, target_recurrent: bool) -> dict[str, bool]:
    """Model file name -> recurrent or hybrid (llama.cpp's answer) for the
    target (``target_recurrent``, asked of the head's own stage) and each
    draft model."""
    out = {Path(session.model_path).name: target_recurrent}
    for name in session.config.draft_models:
        path = resolve(name)
        out[path.name] = _llama.file_is_recurrent(path)
    return out


def request_metrics(job: Job, n_prompt: int) -> dict:
    """A finished request's timing (``Completion.metrics``): its clock's
    figures (:meth:`~ggpipe.metrics.GenerationClock.as_dict`: TTFT, ITL,
    tokens/s, ``prompt_s``; seconds), the seconds it waited for a slot
    (``queue_s``) and the prompt tokens it decoded per second of prompt
    processing (``prompt_tokens_per_s``: its ``n_prompt`` tokens less the
    reused ones; None when nothing was decoded or timed)."""
    m = job.clock.as_dict()
    decoded = n_prompt - job.n_reused
    m["queue_s"] = round(job.queue_s, 4)
    m["prompt_tokens_per_s"] = decoded / m["prompt_s"] if decoded > 0 and m.get("prompt_s") else None
    return m


class Engine:
    """Head rank: generate through ``session``'s pipeline(s) as ``plan`` says.

    Args:
        session: an open session on rank 0 (``session.is_head``).
        plan: the decoding plan (``ggpipe.decoding.plan.DecodingPlan``:
            the mode, its speculation settings, the slots and the
            micro-batches in flight). With ``plan.slots`` above 1, requests
            go through the continuous-batching scheduler, and the session's
            contexts must keep one KV stream per slot
            (``ClusterConfig.kv_unified`` False); ``plan.micro_batches``
            None: as many as the target's stages can compute at once, per
            host as many as its CPUs hold their threads
            (:meth:`Session.micro_batches_in_flight`).
        ignore_eos: keep generating after end-of-generation tokens.
        reuse_kv: keep the KV cache's common prefix between requests.

    Attributes:
        mode: the mode's name; parallel: the slots.

    Raises:
        ConfigError: a speculative mode without a draft model, or over a
            recurrent or hybrid model (its state cannot be rolled back).
    """

    def __init__(self, session: Session, plan: DecodingPlan | None = None, ignore_eos: bool = False,
                 reuse_kv: bool = True):
        plan = plan if plan is not None else DecodingPlan.resolve()
        self.session = session
        self.plan, self.mode, self.parallel = plan, plan.name, plan.slots
        self.vocab = Vocab(session.stage.model, session.stage.vocab)
        self.is_eog = (lambda t: False) if ignore_eos else self.vocab.is_eog
        cfg = session.config
        drafts = session.draft_pipelines
        self.waiter = EventWait([session.pipeline, *drafts])
        # a recurrent or hybrid model's state is kept or dropped whole (llama_memory_seq_rm refuses a cut)
        recurrent = _llama.is_recurrent(session.stage.model)
        if plan.speculates:
            check_speculation(plan.name, _recurrent_models(session, recurrent))
        if plan.start_note:        # the mode is not what it is one request at a time: say so once, at start-up
            sys.stderr.write(f"ggpipe: {plan.start_note}\n")
        # the cells of one request: the context, or with one KV stream per slot the cells of one slot
        self.n_ctx = session.stage.n_ctx_seq if plan.in_slots else cfg.ctx_size
        activity = session.activity
        # micro-batches in flight: as many as stages can compute at once, per host as many as its CPUs hold
        # their threads (3 ranks x 1 thread on 2 cores: 2; 4 x 4 threads on 16 cores: 4; 2 x 2 on 2 cores: 1)
        self.loop = build_loop(plan, session.pipeline, drafts, n_ctx=self.n_ctx, n_batch=cfg.n_batch,
                               n_seq_max=cfg.n_seq_max, is_eog=self.is_eog,
                               depth=plan.micro_batches or session.micro_batches_in_flight(), timeout_s=cfg.timeout_s,
                               idle=self.waiter, target_hosts=session.target_hosts, partial_reuse=not recurrent,
                               reuse_kv=reuse_kv, recover=self.recover,
                               doing=None if activity is None else activity.set)
        self.last: Completion | None = None
        self._ended: list[Job] = []    # resumed requests with nothing left to generate
        self._kernels: dict | None = None
        if plan.speculates and not recurrent:
            self._say_rows(plan.name)

    def _say_rows(self, mode: str) -> None:
        """One line at start-up when this build's batch rows differ from
        lone-token rows for the model (the row probe of :attr:`kernels`,
        cached per model, build and setting): a speculative mode stays
        lossless but may decide another token than iterative at a near-tie."""
        k = self.kernels
        if k.get("batch_rows_exact") is False:
            sys.stderr.write(
                f"ggpipe: note: in this build the model's batch rows differ from lone-token rows by up to "
                f"{k['batch_rows_max_diff']:.3g} in the logits: --mode {mode} stays lossless (greedy: the target's "
                f"argmax) but may give other tokens than iterative at a near-tie; bit-identical: the build without "
                f"llamafile's sgemm, with --exact (docs/user-guide/exactness.md)\n")

    @property
    def kernels(self) -> dict:
        """:func:`kernels_report` of this job, measured on first use."""
        if self._kernels is None:
            self._kernels = kernels_report(self.session)
        return self._kernels

    # -- tokens ------------------------------------------------------------------

    def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None,
                 special_in_messages: bool = False) -> np.ndarray:
        """Token ids (int32 (n,)) of a plain prompt (special-token text
        parsed), or of chat ``messages`` rendered with the GGUF's chat
        template (generation prompt added), in time linear in their length:
        special-token text in a message's content stays text unless
        ``special_in_messages`` (ggpipe.service.chat_prompt).

        Raises:
            ModelError: messages given, but the model has no chat template.
            ConfigError: a content holds special-token text that the
                template does not copy unchanged.
        """
        if messages is not None:
            return chat_tokens(self.vocab, messages, special_in_messages)
        return self.vocab.tokenize(prompt or "")

    def check_fits(self, n_prompt: int, n_predict: int) -> None:
        """Raise ConfigError when the prompt (tokens) plus ``n_predict`` do
        not fit the context (with ``--parallel`` > 1: one slot's cells)."""
        self.loop.check_fits(n_prompt, n_predict)

    def sampler(self, sampling: SamplingParams, context: list[int]) -> Sampler:
        """A request's sampler: its penalties see ``context`` (the prompt's
        token ids), its grammar (``sampling.grammar``) is built on the
        model's vocabulary.

        Raises:
            ConfigError: invalid settings, a logit bias on a token outside
                the vocabulary, a grammar llama.cpp cannot parse.
        """
        sampling.check_vocabulary(self.vocab.n_vocab)
        grammar = self.vocab.grammar(sampling.grammar) if sampling.grammar is not None else None
        return Sampler(sampling, history=context, grammar=grammar)

    # -- the KV cache --------------------------------------------------------------

    def reset(self) -> None:
        """Forget the conversation: clear every stage's KV cache (target and
        draft); no slot holds cells."""
        self.session.pipeline.clear()
        for p in self.session.draft_pipelines:
            p.clear()
        self.loop.reset()

    # -- requests through one loop: submit, step ------------------------------------------

    def generate(self, tokens: np.ndarray, n_predict: int, sampling: SamplingParams = SamplingParams(),
                 on_text: Callable[[str], None] | None = None, stop: list[str] | tuple = (),
                 should_stop: Callable[[], bool] | None = None) -> Completion:
        """Generate up to ``n_predict`` tokens after ``tokens`` (int32 (n,)):
        :meth:`submit` one request and :meth:`step` until it has ended.

        Args:
            on_text: called with each new piece of text as it is accepted
                (text after a stop string is never passed).
            stop: strings that end the generation (not included in the text).
            should_stop: polled after each accepted token list; true stops
                the reply there (Ctrl-C in the chat, a closed HTTP stream).

        Raises:
            ConfigError: the prompt is empty or prompt + n_predict does not fit
                the context; the sampling settings are invalid.
            RankTimeoutError, ProtocolError: from the pipeline; what ended
                the request alone (``job.error``)."""
        done: list[Completion] = []
        self.submit(tokens, n_predict, sampling, on_text=on_text, stop=stop, should_stop=should_stop,
                    on_done=done.append)
        while not done:
            self.step()
        return done[0]

    def submit(self, tokens: np.ndarray, n_predict: int, sampling: SamplingParams = SamplingParams(),
               on_text: Callable[[str], None] | None = None, stop: list[str] | tuple = (),
               should_stop: Callable[[], bool] | None = None,
               on_done: Callable[[Completion | None], None] = lambda c: None,
               on_error: Callable[[Exception], None] | None = None,
               on_tokens: Callable[[list[int]], None] | None = None, resume: Resume | None = None) -> Job:
        """Queue a request; it runs as :meth:`step` is called: in the
        continuous-batching scheduler (``--parallel`` > 1) beside others, or
        alone in the one slot, through the mode's decoder, one request per
        :meth:`step`. ``on_text``, ``stop`` and ``should_stop`` as
        :meth:`generate`; ``on_tokens`` gets, just before each ``on_text``,
        the token ids accepted since the last (ggpipe.service.text);
        ``on_done`` gets the :class:`Completion` when the request ends (also
        :attr:`last`), or None for a job cancelled while queued
        (``job.cancelled``); ``on_error`` gets the exception that ended the
        request alone (``job.error``: its sampling failed; one request at a
        time also its own settings, or an unexpected error after which the
        pipeline was checked and the KV caches cleared, :meth:`recover`),
        instead of :meth:`step` raising it (without ``on_error``).

        ``resume``: the reply was begun by another job (one that lost a
        rank): its tokens are prefilled after the prompt (the slots' prefix
        reuse makes a shared prefix cheap), the sampler is advanced through
        them (penalties, grammar, the keyed noise's output index), and the
        request goes on from there with ``n_predict`` counting them; the
        text they hold beyond ``resume.sent`` characters is passed on first.

        Raises:
            ConfigError: the prompt is empty or does not fit (one slot);
                invalid sampling settings; a ``resume`` that does not fit
                its tokens (more tokens than ``n_predict``, more characters
                sent than they hold)."""
        toks = [int(t) for t in tokens]
        before = [] if resume is None else [int(t) for t in resume.tokens]
        if len(before) > n_predict:
            raise ConfigError(f"the reply to resume has {len(before)} tokens, more than its max_tokens {n_predict}")
        left = n_predict - len(before)
        self.check_fits(len(toks) + len(before), left)     # before the sampler builds its grammar
        stream = TextStream(self.vocab, on_text, stop, should_stop, on_tokens)
        sampler = self.sampler(sampling, toks)
        if before:
            try:
                stream.resume(before, resume.sent)
            except ValueError as e:
                raise ConfigError(f"cannot resume the reply: {e}") from None
            for t in before:
                sampler.accept(t)
        ended = bool(before) and (left == 0 or self.is_eog(before[-1]) or stream.stopped is not None)

        def done(job: Job) -> None:
            if job.error is not None:
                if on_error is None:
                    raise job.error
                on_error(job.error)
                return
            if job.request is None and not ended:
                on_done(None)
                return
            out = before + ([int(t) for t in job.request.out] if job.request is not None else [])
            if job.cancelled:
                stream.stopped = stream.stopped or "interrupted"
            reason = stream.finish(out, n_predict)
            self.last = Completion(tokens=out, text=stream.text, finish_reason=reason,
                                   n_prompt=len(toks), n_reused=min(job.n_reused, len(toks)),
                                   metrics=request_metrics(job, len(job.tokens)),
                                   decoder={"slot": job.slot, "queue_s": round(job.queue_s, 4),
                                            "parallel": self.parallel,
                                            **(self.loop.request_stats(job) if job.request is not None else {})},
                                   logprobs=job.sampler.logprobs[:len(out)] if sampling.logprobs >= 0 else None)
            on_done(self.last)

        job = Job(toks + before, left, sampler, emit=stream.emit, on_done=done, should_stop=stream.check_stop)
        if ended:      # the other job had ended it: nothing to generate, answered at the next step
            self._ended.append(job)
        else:
            self.loop.submit(job)
        return job

    @property
    def queued(self) -> int:
        """Requests submitted and not started."""
        return self.loop.n_queued

    @property
    def free_slots(self) -> int:
        """Requests :meth:`submit` can take now without one waiting for a
        slot: ``--parallel`` minus the running and queued ones (one request
        at a time: 1 while nothing is queued or running)."""
        return max(0, self.parallel - self.loop.n_busy - self.loop.n_queued)

    @property
    def running(self) -> int:
        """Requests in a slot (one at a time: the one running, or the one
        the next :meth:`step` runs to its end)."""
        return self.loop.n_busy

    @property
    def busy(self) -> bool:
        """Requests queued or running."""
        return self.loop.busy or bool(self._ended)

    def step(self, wake: Callable[[], bool] = lambda: False) -> None:
        """One turn of the loop: of the scheduler
        (:meth:`~ggpipe.decoding.parallel.scheduler.Scheduler.step`; ``wake``:
        stop waiting when it is true, new requests from another thread), or
        the next queued request run to its end through the mode's decoder
        (a cancelled one is only reported); first, the resumed requests
        that had nothing left to generate are answered."""
        if self._ended:
            ended, self._ended = self._ended, []
            for job in ended:
                job.on_done(job)
            return
        self.loop.step(wake)

    def recover(self) -> None:
        """After a request failed unexpectedly: wait for its runs still in
        flight and clear every stage's KV cache and the decoder's state, so
        the next request starts clean.

        Raises:
            GGPipeError (RankTimeoutError, ProtocolError, ...) or what the
            head's stage raised: the pipeline is out of step; the job must end.
        """
        session = self.session
        for pipe in (session.pipeline, *session.draft_pipelines):
            pipe.drain()
        self.reset()

    def drain(self) -> None:
        """Wait for the micro-batches in flight (before a shutdown)."""
        self.loop.drain()
