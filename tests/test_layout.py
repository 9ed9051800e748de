"""The folder tree is the architecture: no import cycle inside ``fsdp2/``, and nothing imports upward.

Layers, lowest first (README, "Layout"): ``debug/`` < ``engine/`` < ``api.py`` < ``tools/``,
``optim/`` < the package's ``__init__.py`` and ``plan.py``. A file may import its own layer or a
lower one. Every import counts, including the ones under ``TYPE_CHECKING`` and inside functions:
a cycle there still means two files that cannot be read apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fsdp2"

# The first dotted part under fsdp2 -> its layer.
LAYERS = {
    "debug": 0,
    "engine": 1,
    "api": 2,
    "tools": 3,
    "optim": 3,
    "plan": 4,
    "collectives": 4,
    "traced": 4,
    "": 4,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, name: str) -> set[str]:
    """The fsdp2 modules ``path`` imports (``from fsdp2.x import y`` counts ``fsdp2.x.y`` when
    that is a module, else ``fsdp2.x``)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "fsdp2")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "fsdp2":
                continue
            for alias in node.names:
                found.add(f"{base}.{alias.name}")
                found.add(base)
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        # Keep only real modules; a package's __init__ counts only when nothing deeper matched.
        targets = {t for t in imports_of(path, name) if t in files}
        deeper = {t.rpartition(".")[0] for t in targets}
        edges[name] = {t for t in targets if t not in deeper and t != name}
    return edges


def layer(module: str) -> int:
    parts = module.split(".")[1:]
    return LAYERS[parts[0] if parts else ""]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_file_has_a_layer() -> None:
    unknown = sorted(m for m in graph() if m.split(".")[1:2] and m.split(".")[1] not in LAYERS)
    assert not unknown, f"add these to LAYERS (and to the README's layout): {unknown}"


def test_readme_layout_has_a_line_per_file() -> None:
    readme = (PACKAGE.parent / "README.md").read_text()
    tree = readme[readme.index("## Layout") :].split("```")[1]
    names = {line.split()[0] for line in tree.splitlines() if line.strip()}
    missing = sorted(
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*.py")
        if p.name not in names and not (p.name == "__init__.py" and p.parent != PACKAGE)
    )
    assert not missing, f"the README's Layout has no line for: {missing}"


def test_no_import_cycle() -> None:
    found = cycles(graph())
    assert not found, "import cycles inside fsdp2/:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_nothing_imports_upward() -> None:
    upward = sorted(
        f"{src} imports {dst}"
        for src, targets in graph().items()
        for dst in targets
        if layer(dst) > layer(src)
    )
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_the_check_sees_a_cycle_and_an_upward_import() -> None:
    edges = {
        "fsdp2.engine.a": {"fsdp2.engine.b"},
        "fsdp2.engine.b": {"fsdp2.engine.a", "fsdp2.api"},
    }
    edges["fsdp2.api"] = set()
    assert cycles(edges) == [["fsdp2.engine.a", "fsdp2.engine.b"]]
    assert layer("fsdp2.api") > layer("fsdp2.engine.b")


def _fields_of(path: Path, class_name: str) -> set[str]:
    """The attributes a class's own methods assign on ``self``."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {
        target.attr
        for node in ast.walk(cls)
        for target in _targets(node)
        if isinstance(target.value, ast.Name) and target.value.id == "self"
    }


def _targets(node: ast.AST) -> list[ast.Attribute]:
    targets: list[ast.expr] = []
    if isinstance(node, ast.Assign):  # a, b.c = ...: each element of a tuple target
        targets = [
            t
            for tgt in node.targets
            for t in (tgt.elts if isinstance(tgt, (ast.Tuple, ast.List)) else [tgt])
        ]
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    return [t for t in targets if isinstance(t, ast.Attribute)]


def assignments_in(source: str, fields: set[str], var_names: set[str]) -> list[int]:
    """The lines of ``source`` that assign one of ``fields`` on a variable named as the class's
    objects are (``fsdp_param``, ``p``, ...)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(source))
        for target in _targets(node)
        if isinstance(target.value, ast.Name)
        and target.value.id in var_names
        and target.attr in fields
    ]


FSDP_PARAM_NAMES = {"fsdp_param", "p", "param", "fp"}


def test_fsdp_param_fields_assigned_only_in_param_py() -> None:
    """``FSDPParam`` owns its fields: other files call its methods (``adopt``, ``rename``,
    ``set_param_dtype``, ...) instead of writing them, so that each field has one writer. Its
    records (``place``: the layout's; ``ext``: packing's) are written by their owners."""
    owner = PACKAGE / "engine" / "param.py"
    fields = _fields_of(owner, "FSDPParam")
    assert {"sharded_param", "fqn", "param_dtype", "dtype", "place"} <= fields
    found = [
        f"{path.relative_to(PACKAGE)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != owner
        for line in assignments_in(path.read_text(), fields, FSDP_PARAM_NAMES)
    ]
    assert found == []
    # The check sees one (the assignment adopt() replaced in changes.py).
    assert assignments_in("fsdp_param.sharded_param = new\n", fields, FSDP_PARAM_NAMES) == [1]
