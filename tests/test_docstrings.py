"""Every public function, class and method of the package has a docstring.

Imports every module under ``ggpipe/`` (``ggpipe/__main__.py`` runs the CLI
on import and is skipped; the modules that use MPI import mpi4py inside
functions, so every module imports without an MPI launcher), and checks
each public (no leading ``_``) function and class defined in its module,
and each public method, property and nested class in such a class's own
``__dict__``. Methods are checked with :func:`inspect.getdoc`, which
inherits a base class's docstring: an override of a documented base method
(click's, asyncio's, uvicorn's, a ggpipe protocol's or base class's) needs
none of its own. A class needs its own: a base class's (pydantic's
``BaseModel``) or the signature :mod:`dataclasses` writes does not count.
Pure imports, no MPI: the fast tier.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil

import ggpipe

#: Modules not imported: ``__main__`` runs the CLI.
SKIPPED = {"ggpipe.__main__"}


def _modules() -> list:
    names = ["ggpipe"] + [m.name for m in pkgutil.walk_packages(ggpipe.__path__, "ggpipe.")]
    return [importlib.import_module(n) for n in sorted(names) if n not in SKIPPED]


def _members(cls: type):
    """(name, object whose docstring counts) of the public methods and
    properties in ``cls``'s own ``__dict__``. A dataclass field whose default
    is a function (``on_done: Callable = lambda job: None``) is a value, not
    a method, and so is any function stored under another name."""
    fields = getattr(cls, "__dataclass_fields__", {})
    for name, raw in vars(cls).items():
        if name.startswith("_") or name in fields:
            continue
        if isinstance(raw, (staticmethod, classmethod)):
            # getattr gives the plain or bound function, whose __qualname__
            # lets getdoc find a base class's docstring
            yield name, getattr(cls, name)
        elif isinstance(raw, property):
            yield name, raw
        elif isinstance(raw, functools.cached_property):
            yield name, raw.func
        elif inspect.isfunction(raw) and raw.__name__ == name:
            yield name, raw


def _own_class_doc(cls: type) -> str | None:
    """``cls``'s own docstring: a base class's (pydantic's ``BaseModel``,
    an error's base) says nothing of the subclass, and the signature that
    :mod:`dataclasses` writes where a dataclass has none is not one."""
    doc = vars(cls).get("__doc__")
    if not doc or not doc.strip():
        return None
    if dataclasses.is_dataclass(cls) and doc.startswith(cls.__name__ + "("):
        return None
    return doc


def _missing_in_class(module: str, cls: type) -> list[str]:
    """``module:qualname`` of ``cls``'s public methods and properties
    without a docstring, and of its public nested classes (``Options``)
    without one of their own, and theirs."""
    missing = [f"{module}:{cls.__qualname__}.{member}" for member, target in _members(cls)
               if not inspect.getdoc(target)]
    for name, inner in vars(cls).items():
        if not name.startswith("_") and inspect.isclass(inner) and inner.__qualname__ == f"{cls.__qualname__}.{name}":
            if not _own_class_doc(inner):
                missing.append(f"{module}:{inner.__qualname__}")
            missing += _missing_in_class(module, inner)
    return missing


def missing_docstrings() -> list[str]:
    """``module:qualname`` of every public function, class, method and
    property without a docstring (a class's own; a function's own or, for a
    method, inherited)."""
    missing: list[str] = []
    for module in _modules():
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isfunction(obj):
                if not inspect.getdoc(obj):
                    missing.append(f"{module.__name__}:{obj.__qualname__}")
            elif inspect.isclass(obj):
                if not _own_class_doc(obj):
                    missing.append(f"{module.__name__}:{obj.__qualname__}")
                missing += _missing_in_class(module.__name__, obj)
    return sorted(set(missing))


def test_every_module_imports_without_an_mpi_launcher():
    assert len(_modules()) > 100


def test_every_public_function_class_and_method_has_a_docstring():
    missing = missing_docstrings()
    assert not missing, f"{len(missing)} public names without a docstring:\n" + "\n".join(missing)



# -- the check's own cases (module level: getdoc finds a method's class by its qualified name) --


@dataclasses.dataclass
class _Bare:
    x: int = 0
    on_done: object = lambda: None  # a field's value, not a method

    def method(self):
        pass

    @property
    def prop(self):
        return 1

    class Inner:
        pass


class _Base:
    """A base."""

    def method(self):
        """Documented here."""


class _Override(_Base):
    """An override."""

    def method(self):
        pass


def test_the_check_finds_what_it_should_and_nothing_else():
    assert _own_class_doc(_Bare) is None and _own_class_doc(_Override)
    assert sorted(_missing_in_class("m", _Bare)) == ["m:_Bare.Inner", "m:_Bare.method", "m:_Bare.prop"]
    assert _missing_in_class("m", _Override) == []
