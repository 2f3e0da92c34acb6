"""The code passes the project's linter (ruff; rules in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


def test_ruff_finds_nothing():
    # beside this interpreter first: `.venv/bin/python -m pytest` runs without the virtualenv activated
    ruff = shutil.which("ruff", path=Path(sys.executable).parent) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]' installs it)")
    proc = subprocess.run([ruff, "check", "flashdraft", "tests", "benchmarks"], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
