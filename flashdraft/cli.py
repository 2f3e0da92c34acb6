"""The `flashdraft` command: `flashdraft COMMAND [args]`.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args)``;
only the chosen command's module is imported, so `flashdraft --help` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Only commands that work are listed.
COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("flashdraft.quickstart", "the whole job on a built-in tiny default, in minutes on a CPU"),
    "prepare": ("flashdraft.data.prepare", "chats -> chat template + assistant loss mask -> token shard"),
    "regenerate": ("flashdraft.data.regenerate", "replace assistant turns by the target's own replies"),
    "config": ("flashdraft.config", "print the resolved training config as documented YAML (no arguments: defaults)"),
    "train": ("flashdraft.train.cli", "train a DFlash drafter online against a frozen target (torchrun for many GPUs)"),
    "plan": ("flashdraft.train.plan", "whether a run fits its GPU: the per-device peak memory, from config.json alone"),
    "export": ("flashdraft.export", "write the serving-format drafter of a checkpoint (newest by default), verified"),
    "eval": ("flashdraft.evaluate", "speculative decoding with a drafter: tau, per-position acceptance, losslessness"),
    "inspect": ("flashdraft.data.inspect", "summarise a training dataset: samples, tokens, lengths, padding, problems"),
    "bench": ("flashdraft.bench",
              "benchmarks: flashdraft bench {data,prepare,step,train,pipeline,soak,gpu-pipeline,gpu-check} [options]"),
    "env": ("flashdraft.cli", "the versions a bug report needs: Python, torch, the HF stack, the engine environment"),
}
# The packages `flashdraft env` reports, each against the range pyproject.toml declares for it.
REPORTED = ("torch", "transformers", "tokenizers", "datasets", "pyarrow", "accelerate", "safetensors", "numpy",
            "huggingface_hub")


def _usage() -> str:
    width = max((len(n) for n in COMMANDS), default=0)
    lines = ["usage: flashdraft COMMAND [options]   (flashdraft COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += ["", "A mistake in the input is reported as one line naming the fix; FLASHDRAFT_TRACEBACK=1 shows "
              "where it was raised."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        argv = ["env"]
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"flashdraft: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"flashdraft {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(rest)) or 0)


def entry(argv: list[str] | None = None) -> int:
    """The console script (and ``python -m flashdraft.cli``, which torchrun launches): ``main``
    with a user's mistake -- a bad config value, a missing file, a refused resume, whose
    messages name the fix -- printed as one line instead of a traceback (exit status 2), and a
    run stopped by SIGTERM / SIGINT reported as one line saying what was saved (exit status
    128 + the signal, as a shell reports a process the signal ended). FLASHDRAFT_TRACEBACK=1 shows
    the traceback of a mistake; anything else propagates as usual."""
    import os

    from flashdraft.signals import Stopped

    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else ""
    try:
        return main(argv)
    except Stopped as exc:
        return stopped(command, exc)
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (which turns it into Stopped)
        print(f"flashdraft {command}: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, NotADirectoryError, RuntimeError) as exc:
        # A RuntimeError is one line only where its class says it names the fix (``names_the_fix``:
        # CheckpointError, target.rewind.RewindError).
        if os.environ.get("FLASHDRAFT_TRACEBACK") or (isinstance(exc, RuntimeError)
                                                      and not getattr(exc, "names_the_fix", False)):
            raise
        print(f"flashdraft {command}: error: {exc}", file=sys.stderr)
        return 2


def add_arguments(parser: argparse.ArgumentParser) -> None:  # `flashdraft env` takes none
    parser.epilog = ("Paste its output into a bug report. A version outside the range flashdraft was tested on "
                     "(pyproject.toml, docs/dependencies.md) is marked.")


def run(args) -> int:
    """`flashdraft env` (and `--version`): flashdraft's version and where it runs from, Python,
    torch with its accelerator, each REPORTED package against its declared range, and the engine
    environment's state and versions (vllm_env.environment_versions)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    import torch

    import flashdraft
    from flashdraft.vllm_env import environment_versions

    declared = declared_ranges()
    print(f"flashdraft {flashdraft.__version__} ({Path(flashdraft.__file__).parent})")
    print(f"python {platform.python_version()} ({sys.executable}), {platform.system()} {platform.machine()}")
    cuda = (f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
            if torch.cuda.is_available() else f"CUDA {torch.version.cuda or 'none'}, no GPU visible")
    width = max(map(len, REPORTED))
    for name in REPORTED:
        try:
            have = version(name)
        except PackageNotFoundError:
            have = None
        mark = range_note(have, declared.get(name.lower()))
        print(f"{name:<{width}}  {have or 'not installed'}{mark}" + (f"  ({cuda})" if name == "torch" else ""))
    engine = environment_versions()
    state = engine["state"] + (f": {engine['reason']}" if "reason" in engine else "")
    print(f"engine environment (vLLM judge, its own pins): {engine['path']}: {state}")
    for name, have in engine.get("packages", {}).items():
        print(f"  {name:<{width}}  {have or 'not installed'}")
    return 0


def declared_ranges() -> dict:
    """Each dependency flashdraft declares (its installed metadata, i.e. pyproject.toml), by
    normalised name -> its SpecifierSet; extras' dependencies left out."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    ranges = {}
    for spec in requires("flashdraft") or []:
        req = Requirement(spec)
        if req.marker is None:
            ranges[req.name.lower().replace("-", "_")] = req.specifier
    return ranges


def range_note(have: str | None, wanted) -> str:
    """How ``flashdraft env`` marks an installed version against its declared range."""
    if wanted is None:
        return ""
    if have and wanted.contains(have, prereleases=True):
        return f"  (tested: {wanted})"
    return f"  OUTSIDE the tested range {wanted}"


def stopped(command: str, exc) -> int:
    """Report a signal-stopped run (a ``Stopped``) as one line; its exit status."""
    print(f"flashdraft {command}: {exc}", file=sys.stderr)
    return exc.exit_code


if __name__ == "__main__":
    sys.exit(entry())
