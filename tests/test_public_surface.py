"""The public surface is ``fsdp2.__all__`` and ``fsdp2.optim.__all__`` (CONTRIBUTING, "Public
surface"): every name there is in the README, reachable from its package, and documents each of
its arguments in an ``Args:`` section."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

import fsdp2
import fsdp2.optim

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = [(fsdp2, name) for name in fsdp2.__all__] + [
    (fsdp2.optim, name) for name in fsdp2.optim.__all__
]


def _documented_callable(obj: object) -> object | None:
    """What must carry the ``Args:`` section: a function itself, a class's own ``__init__``
    (exceptions and dataclasses, whose fields are documented where declared, excepted)."""
    if inspect.isfunction(obj):
        return obj
    if not isinstance(obj, type) or issubclass(obj, BaseException) or dataclasses.is_dataclass(obj):
        return None
    init = obj.__dict__.get("__init__")
    return obj if init is not None else None


@pytest.mark.parametrize(("package", "name"), PUBLIC, ids=[n for _, n in PUBLIC])
def test_public_name_is_in_the_readme(package: object, name: str) -> None:
    assert f"{name}`" in (ROOT / "README.md").read_text(), f"README.md never names {name}"


@pytest.mark.parametrize(("package", "name"), PUBLIC, ids=[n for _, n in PUBLIC])
def test_public_name_documents_its_arguments(package: object, name: str) -> None:
    obj = getattr(package, name)
    target = _documented_callable(obj)
    if target is None:
        return
    func = target.__dict__["__init__"] if isinstance(target, type) else target
    params = [
        p.name
        for p in inspect.signature(func).parameters.values()
        if p.name not in ("self", "cls") and not p.name.startswith("_")
    ]
    if not params:
        return
    doc = inspect.getdoc(target) or ""
    assert "Args:" in doc, f"{name}'s docstring has no Args: section"
    section = doc[doc.index("Args:") :]
    missing = [p for p in params if f"{p}:" not in section]
    assert not missing, f"{name}'s Args: section misses {missing}"


def test_paths_documented_before_the_layout_still_work_with_a_warning() -> None:
    import subprocess
    import sys

    # A fresh interpreter: the deprecated modules warn once, at their first import.
    code = (
        "import warnings, fsdp2\n"
        "warnings.simplefilter('error')\n"
        "for path in ('fsdp2.collectives.record_collectives', 'fsdp2.traced.set_traced'):\n"
        "    try:\n"
        "        eval(path)\n"
        "    except DeprecationWarning as w:\n"
        "        print(w)\n"
        "warnings.simplefilter('ignore')\n"
        "assert fsdp2.collectives.record_collectives is fsdp2.record_collectives\n"
        "from fsdp2.traced import set_traced\n"
        "assert set_traced is fsdp2.set_traced\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    assert out.splitlines() == [
        "fsdp2.collectives is deprecated: use fsdp2.record_collectives and fsdp2.CollectiveRecord",
        "fsdp2.traced is deprecated: use fsdp2.set_traced",
    ]
