#!/usr/bin/env bash
# The declared dependency range, tested: the fast tests (-m "not slow") in fresh virtualenvs on
# the NEWEST releases pyproject.toml admits (what a new machine installs today) and on the OLDEST
# (every direct dependency at its lower bound). Not part of the suite:
# run it before raising or lowering a bound (README, "Dependencies"), and record the result in
# docs/dependencies.md.
#
#   bash benchmarks/dependency_range.sh [newest|oldest|both] [extra pytest args]
#   PYTHON=python3.12 bash benchmarks/dependency_range.sh newest
#
# Each side prints the versions it installed and ends in "PASS <side>" or "FAIL <side>"; the exit
# status is 0 only when every side passed. Virtualenvs live in a temporary directory (KEEP=1 keeps it).
set -uo pipefail
cd "$(dirname "$0")/.."
sides=${1:-both}; shift || true
[ "$sides" = both ] && sides="newest oldest"
python=${PYTHON:-python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/flashdraft-range.XXXXXX")
[ -n "${KEEP:-}" ] || trap 'rm -rf "$work"' EXIT

# Every direct dependency (and dev tool) pinned at its declared lower bound.
"$python" - pyproject.toml > "$work/oldest.txt" <<'PY'
import re, sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
for spec in project["dependencies"] + project["optional-dependencies"]["dev"]:
    name, lower = re.match(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*(?:>=|==)\s*([^,;\s]+)", spec).groups()
    print(f"{name}=={lower}")
PY

status=0
for side in $sides; do
    echo "== $side: $("$python" --version)"
    venv="$work/$side"
    "$python" -m venv "$venv"
    constraint=()
    [ "$side" = oldest ] && constraint=(-c "$work/oldest.txt")
    if ! "$venv/bin/pip" install --quiet -e ".[dev]" "${constraint[@]}"; then
        echo "FAIL $side (install)"; status=1; continue
    fi
    "$venv/bin/python" - <<'PY'
from importlib.metadata import version
names = ["torch", "transformers", "tokenizers", "datasets", "pyarrow", "accelerate", "safetensors", "numpy",
         "huggingface_hub", "pyyaml", "tqdm", "psutil", "matplotlib", "pytest", "pytest-xdist", "hypothesis", "ruff"]
print("   " + ", ".join(f"{n} {version(n)}" for n in names))
PY
    if "$venv/bin/python" -m pytest -m "not slow" -p no:cacheprovider "$@"; then
        echo "PASS $side"
    else
        echo "FAIL $side"; status=1
    fi
done
exit $status
