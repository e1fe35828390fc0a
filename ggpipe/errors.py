"""Errors that ggpipe reports to a user as one clear line.

Every error a user can cause (bad model file, bad split, prompt too long, a rank
that stopped answering, ...) is a :class:`GGPipeError`. The CLI prints
``ggpipe: error: <message>`` and exits non-zero; a traceback is shown only with
``-v``. Anything else escaping is a bug in ggpipe.
"""

from __future__ import annotations


class GGPipeError(Exception):
    """Base class of every user-facing error (exit code 1, one line).

    ``abort_job``: the other ranks cannot be stopped cleanly (one stopped
    answering, or the message stream is out of step), so the CLI ends the
    whole job with ``MPI_Abort`` after printing the message.
    """

    exit_code = 1
    abort_job = False


class ModelError(GGPipeError):
    """A model name, path or GGUF file that cannot be used (missing, truncated,
    not GGUF, unknown registry name, hash mismatch, unsupported architecture)."""


class SplitError(GGPipeError):
    """A layer split that cannot be built: wrong number of weights, a stage with
    no layers, more stages than layers, non-positive weights."""


class ConfigError(GGPipeError):
    """Inconsistent or impossible settings: prompt longer than the context,
    ranks started with different arguments, bad thread list, ..."""


class BuildError(ConfigError):
    """A setting this llama.cpp build cannot give (``--exact`` on a build with
    llamafile's sgemm): a usage error, exit code 2, reported before any rank
    loads weights; the message names the install line that fixes it."""

    exit_code = 2


class ProtocolError(GGPipeError):
    """A message between ranks that does not match its documented layout."""

    abort_job = True


class RankTimeoutError(GGPipeError):
    """A bounded MPI wait ran out. The message names the rank waited for and
    what this rank was doing; ``waited_for`` is its first part ("rank 0
    waited 30 s for its hello from rank 1"), for a caller that knows better
    why the wait ran out than "it stopped answering"."""

    abort_job = True

    def __init__(self, message: str, waited_for: str | None = None):
        super().__init__(message)
        self.waited_for = waited_for or message


class RankFailedError(GGPipeError):
    """Another rank reported an error and the job is shutting down."""


class RankLostError(GGPipeError):
    """A rank of the job ended or vanished before the heartbeat watch could
    name it (the launcher reported it during start-up)."""

    abort_job = True


class StageFailedError(GGPipeError):
    """The head's own stage of a pipeline (its executor thread, or the call
    that computed it) failed: the run it was computing never went on to the
    next rank, so the pipeline is out of step and the job must end. The
    message is the stage's own error (e.g. "the KV cache is full", non-finite
    values), prefixed with which stage it was."""

    abort_job = True


class NonFiniteError(ModelError):
    """A stage's output (hidden states or logits) holds NaN or infinity: the
    weights of its layers are damaged (a bad copy, a disk error) or the model
    overflows. The message names the rank, its host and the layers."""
