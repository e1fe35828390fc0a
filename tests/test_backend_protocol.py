"""The three target backends (real ranks, in-memory toy, simulator) against
the one declared protocol (ggpipe.backend): every member is there, every
method takes the protocol's parameters under the same names and in the same
order. A backend that drifts (a verb renamed, a parameter dropped) fails
here instead of deep inside a decoding loop."""

from __future__ import annotations

import inspect

import pytest

from ggpipe.backend import DecodeBackend, TargetBackend
from ggpipe.pipeline.driver import Pipeline
from ggpipe.sim.backend import SimClock, SimPipeline, SimStage
from ggpipe.sim.profile import LinkProfile
from ggpipe.sim.toy import FakePipeline, ToyLM


def _members(proto) -> tuple[dict, set]:
    """(methods by name, data attribute and property names) the protocol and its bases declare."""
    methods, data = {}, set()
    for klass in reversed(proto.__mro__):
        if klass in (object,) or not getattr(klass, "_is_protocol", False):
            continue
        data |= set(getattr(klass, "__annotations__", {}))
        for name, v in vars(klass).items():
            if inspect.isfunction(v) and not name.startswith("_"):
                methods[name] = v
            elif isinstance(v, property):
                data.add(name)
    return methods, data


def _backends():
    toy = FakePipeline(ToyLM())
    sim = SimPipeline(ToyLM(), SimClock(), [SimStage(rank=0, cost=lambda n, kv, out: 1e-3)],
                      link=lambda a, b: LinkProfile(a, b, 0.0, 1e9), n_embd=8, n_vocab_real=48)
    real = Pipeline(stage=None, transport=None, ranks=[1], n_vocab=48)
    return {"Pipeline": real, "ToyPipeline": toy, "SimPipeline": sim}


@pytest.mark.parametrize("proto", [DecodeBackend, TargetBackend], ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", ["Pipeline", "ToyPipeline", "SimPipeline"])
def test_backend_implements_the_protocol(proto, name):
    backend = _backends()[name]
    methods, data = _members(proto)
    assert methods and data
    for attr in sorted(data):
        assert hasattr(backend, attr), f"{name} lacks the attribute {attr!r} of {proto.__name__}"
    for meth, decl in sorted(methods.items()):
        impl = getattr(backend, meth, None)
        assert callable(impl), f"{name} lacks the method {meth}() of {proto.__name__}"
        want = [p for p in inspect.signature(decl).parameters.values() if p.name != "self"]
        got = list(inspect.signature(impl).parameters.values())
        got_names = [p.name for p in got if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]
        assert got_names[:len(want)] == [p.name for p in want], \
            f"{name}.{meth}{inspect.signature(impl)} does not take {proto.__name__}.{meth}{inspect.signature(decl)}"
        for p in got[len(want):]:
            assert p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD), \
                f"{name}.{meth} needs {p.name!r}, which {proto.__name__} callers do not pass"
        for w, g in zip(want, got):
            assert (w.default is w.empty) or (g.default is not g.empty), \
                f"{name}.{meth}: {g.name!r} must be optional, as {proto.__name__} declares it"


def test_a_drifting_backend_is_caught():
    """The check itself: a toy backend whose wait() lost its time-out fails it."""

    class Drifted(FakePipeline):
        def wait(self):  # noqa: D102
            return super().wait()

    methods, _ = _members(TargetBackend)
    want = [p.name for p in inspect.signature(methods["wait"]).parameters.values() if p.name != "self"]
    got = [p.name for p in inspect.signature(Drifted(ToyLM()).wait).parameters.values()]
    assert got[:len(want)] != want
