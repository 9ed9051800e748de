"""``python -m fsdp2.plan`` answers each user mistake with one line, exit code 2 (as argparse
does), and an error inside the user's own code with their frames only, never the planner's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from expecttest import assert_expected_inline

pytestmark = pytest.mark.usefixtures("fsdp2_only")

USER_MODULE = """\
import torch.nn as nn


def build():
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))


def build_raises():
    raise RuntimeError("config file missing: model_config.json")


def shard_raises(model, mesh):
    raise RuntimeError("my shard function broke")


def batch():
    return ()
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan_cli")
    (path / "planmod.py").write_text(USER_MODULE)
    (path / "needs_dep.py").write_text("import no_such_dependency_xyz\n\n\ndef build(): ...\n")
    (path / "broken.py").write_text("def build(:\n    pass\n")
    return path


def _cli(workdir: Path, *args: str) -> tuple[int, str]:
    """The exit code and stderr (the working directory shown as <dir>)."""
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp2.plan", *args],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stderr.replace(str(workdir), "<dir>").rstrip()


def test_mistakes_get_one_line(workdir: Path) -> None:
    cases = {
        "no_such_module_xyz:build": (),
        "planmod:no_such_function": (),
        "planmod": (),
        "missing.py:build": (),
        "planmod:build": ("--batch", "8xq"),
        "planmod:batch": ("--batch", "planmod:nothing"),
        "planmod:build ": ("--device", "gpu"),
        "planmod:build  ": ("--optimizer", "-3"),
    }
    lines = []
    for build, extra in cases.items():
        code, err = _cli(workdir, build.strip(), *extra)
        assert code == 2 and "\n" not in err, err
        lines.append(err)
    assert_expected_inline(
        "\n".join(lines),
        """\
error: no module named 'no_such_module_xyz' (from 'no_such_module_xyz:build'); run from the directory that holds it, add that directory to PYTHONPATH, or name a file: path/to/no_such_module_xyz.py:build
error: planmod has no 'no_such_function' (from 'planmod:no_such_function'); it defines batch, build, build_raises, shard_raises
error: expected MODULE:FUNCTION (e.g. mypkg.model:build, or a file: path/to/model.py:build), got 'planmod'
error: no file 'missing.py' (from 'missing.py:build') in <dir>; give its path, or MODULE:FUNCTION for an importable module
error: --batch: expected shapes such as 8x64 or 8x3x224x224:fp32,8:int64 (comma-separated, a dtype after a colon), or MODULE:FUNCTION returning the inputs; got '8xq'
error: --batch: planmod has no 'nothing' (from 'planmod:nothing'); it defines batch, build, build_raises, shard_raises
error: --device: expected a device type such as cuda, cpu or xpu, got 'gpu'
error: optimizer state bytes per element must be >= 0, got -3.0""",
    )


def test_errors_in_the_users_code_show_their_frames(workdir: Path) -> None:
    code, err = _cli(workdir, "planmod:build_raises")
    assert code == 2
    assert_expected_inline(
        err,
        """\
Traceback (your code's frames):
  File "<dir>/planmod.py", line 9, in build_raises
    raise RuntimeError("config file missing: model_config.json")
RuntimeError: config file missing: model_config.json
error: build_raises (<dir>/planmod.py, line 9) raised RuntimeError: config file missing: model_config.json""",
    )
    code, err = _cli(
        workdir, "planmod:build", "--shard", "planmod:shard_raises", "--world-size", "2"
    )
    assert code == 2
    assert_expected_inline(
        err,
        """\
Traceback (your code's frames):
  File "<dir>/planmod.py", line 13, in shard_raises
    raise RuntimeError("my shard function broke")
RuntimeError: my shard function broke
error: shard_raises (<dir>/planmod.py, line 13) raised RuntimeError: my shard function broke""",
    )
    code, err = _cli(workdir, "needs_dep:build")  # their import of a missing package
    assert code == 2
    assert_expected_inline(
        err,
        """\
Traceback (your code's frames):
  File "<dir>/needs_dep.py", line 1, in <module>
    import no_such_dependency_xyz
ModuleNotFoundError: No module named 'no_such_dependency_xyz'
error: <module> (<dir>/needs_dep.py, line 1) raised ModuleNotFoundError: No module named 'no_such_dependency_xyz'""",
    )
    code, err = _cli(workdir, "broken:build")
    assert code == 2
    assert_expected_inline(
        err,
        """\
  File "<dir>/broken.py", line 1
    def build(:
              ^
SyntaxError: invalid syntax
error: <dir>/broken.py, line 1: invalid syntax""",
    )
