"""Size: the lines of code of fsdp2's engine and of each file, without comments, docstrings or
blank lines (issue 41's measure).

    python benchmarks/size.py                 # the engine (fsdp2/engine/)
    python benchmarks/size.py fsdp2           # any folders or files
    python benchmarks/size.py --impl torch    # torch's fully_shard package, for comparison

A line counts when it holds a token of code: not a comment, not only part of a docstring (a
string that is a statement of its own: a module's, class's or function's first, or any other),
not blank. A statement spread over several lines counts each line it spans. Printed: each file's
total lines and code lines, largest first, then the sums.
"""

from __future__ import annotations

import argparse
import ast
import io
import os
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = [ROOT / "fsdp2" / "engine"]
_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


def code_lines(source: str) -> int:
    """The lines of ``source`` that hold code (see the module's docstring)."""
    strings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            end = node.end_lineno or node.lineno
            strings.update(range(node.lineno, end + 1))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in _NOT_CODE:
            continue
        for line in range(token.start[0], token.end[0] + 1):
            if line not in strings:
                lines.add(line)
    return len(lines)


def files_of(paths: list[Path]) -> list[Path]:
    found: list[Path] = []
    for path in paths:
        found.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return found


def measure(paths: list[Path]) -> dict[Path, tuple[int, int]]:
    """Each file's (lines, code lines)."""
    sizes = {}
    for path in files_of(paths):
        source = path.read_text()
        sizes[path] = (len(source.splitlines()), code_lines(source))
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", type=Path)
    parser.add_argument("--impl", choices=["fsdp2", "torch"], default="fsdp2")
    args = parser.parse_args()
    if args.impl == "torch":
        import torch.distributed.fsdp._fully_shard as torch_fsdp

        paths = [Path(torch_fsdp.__file__).parent]
    else:
        paths = args.paths or ENGINE
    sizes = measure(paths)
    base = paths[0] if len(paths) == 1 and paths[0].is_dir() else Path.cwd()
    for path, (lines, code) in sorted(sizes.items(), key=lambda kv: -kv[1][0]):
        print(f"{lines:6d} {code:6d}  {os.path.relpath(path, base)}")
    total = sum(lines for lines, _ in sizes.values())
    code = sum(code for _, code in sizes.values())
    print(f"{total:6d} {code:6d}  in {len(sizes)} files (lines, code lines)")


if __name__ == "__main__":
    main()
