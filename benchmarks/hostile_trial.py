"""The hostile trial of issue 41, re-runnable: probes of `plan`, `train`, `eval` (`--output`,
`--engine`), `export`, the engine environment, the feature cache's disk tier, config validation
and the quickstart, each judged held or not. Not part of the suite (minutes, and vLLM's CPU
build for the engine probes).

    python benchmarks/hostile_trial.py --json after.json                 # this checkout
    PYTHONPATH=/tmp/base python benchmarks/hostile_trial.py --json before.json   # another one
    python benchmarks/hostile_trial.py --table after.json --base before.json     # the table

A probe HOLDS when the command does what it should: succeeds where it should, or refuses in one
line (exit status 2, `flashdraft CMD: error: ...`, no traceback) naming what the probe expects,
and every protected file is unchanged. With the results of the code before (``--base``), a probe
that holds now and did not then counts as FIXED; one that does not hold now is OPEN. Probes that
may hang or take all memory on the code before (a FIFO, 10^6 layers, a 128 GB allocation, a
10^9-length plan, signals to the engine worker) run in a process of their own, under a time
limit and a 12 GiB address-space cap. The engine environment probes never touch the shared
~/.cache/flashdraft environment except to run it (FLASHDRAFT_ENGINE_DIR points into the
workspace when a probe builds or breaks one).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

PROBES: dict[str, tuple[str, str, object, bool, float]] = {}  # id -> (family, item, fn, isolate, timeout)


def probe(pid: str, family: str, item: str = "-", isolate: bool = False, timeout: float = 300):
    """Register ``fn(ws) -> (held, detail)`` as probe ``pid`` of ``family`` (issue 41's item, or
    "-" for a probe of behaviour that held before)."""
    def register(fn):
        assert pid not in PROBES, pid
        PROBES[pid] = (family, item, fn, isolate, timeout)
        return fn
    return register


# ---- running a command in this process ------------------------------------------------------


@dataclass
class Outcome:
    code: int | None
    out: str
    err: str
    exc: str | None  # a traceback: an exception that escaped the command line

    def refused(self, pattern: str) -> tuple[bool, str]:
        """One line naming the mistake (exit 2, no traceback) that matches ``pattern``."""
        line = self.err.strip().splitlines()[-1] if self.err.strip() else ""
        ok = self.exc is None and self.code == 2 and ": error: " in line and re.search(pattern, line) is not None
        return ok, self.brief()

    def ok(self, code: int = 0) -> tuple[bool, str]:
        return self.exc is None and self.code == code, self.brief()

    def brief(self) -> str:
        if self.exc:
            return "traceback: " + self.exc.strip().splitlines()[-1][:300]
        line = self.err.strip().splitlines()[-1] if self.err.strip() else ""
        return f"exit {self.code}: {line[:300]}"


def cli(*argv, env: dict | None = None, cwd: Path | None = None) -> Outcome:
    """``flashdraft ARGV`` in this process (the console script's entry: mistakes as one line)."""
    from flashdraft.cli import entry

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    try:
        os.environ.update(env or {})
        if cwd:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = entry([str(a) for a in argv])
        return Outcome(code, out.getvalue(), err.getvalue(), None)
    except SystemExit as exc:  # argparse's usage errors
        return Outcome(int(exc.code or 0), out.getvalue(), err.getvalue(), None)
    except BaseException:  # a traceback is what the probe reports
        return Outcome(None, out.getvalue(), err.getvalue(), traceback.format_exc())
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)


def call(fn, *args, **kwargs):
    """(the exception fn raised or None, its message)."""
    try:
        fn(*args, **kwargs)
        return None, ""
    except BaseException as exc:
        return exc, str(exc)


def files_of(path: Path) -> dict:
    """Every file under ``path`` (or the file itself): its bytes, to compare before and after."""
    path = Path(path)
    if path.is_file():
        return {str(path): path.read_bytes()}
    return {str(p): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()}


# ---- the workspace: tiny real models, data, a finished run --------------------------------------


class Workspace:
    """Fixtures every probe may read (never write: a probe that writes copies them first)."""

    def __init__(self, root: Path):
        self.root = root

    def fresh(self, name: str, src: Path | None = None) -> Path:
        """A new directory of the probe's own (a copy of ``src`` when given)."""
        (self.root / "probes").mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.root / "probes"))
        if src is not None:
            path.rmdir()
            shutil.copytree(src, path, symlinks=True)
        return path

    def build(self) -> None:
        """The target (4 layers, hidden 32), a head_dim-32 target for vLLM, data, prompts, a
        finished 4-step run (checkpoints at 2 and 4), its export, a Hugging Face cache layout."""
        import numpy as np
        import torch

        from flashdraft.cli import main
        from flashdraft.data.shards import write_token_shard
        from flashdraft.evaluate import write_prompts
        from flashdraft.toy import tiny_causal_lm

        if (self.root / "ready").is_file():
            return
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        for name, kw in (("target", dict(hidden=32)), ("target64", dict(hidden=64, num_heads=2, num_kv_heads=1))):
            model = tiny_causal_lm(300, arch="qwen3", num_layers=4, seed=1, max_position_embeddings=512,
                                   rope_parameters=rope, **kw)
            with torch.no_grad():
                model.lm_head.weight.mul_(30)
            model.save_pretrained(self.root / name)
        prompts = torch.randint(0, 298, (40, 6), generator=torch.Generator().manual_seed(0))
        model = tiny_causal_lm(300, arch="qwen3", num_layers=4, seed=1, max_position_embeddings=512,
                               rope_parameters=rope, hidden=32)
        model.load_state_dict(type(model).from_pretrained(self.root / "target").state_dict())
        with torch.no_grad():
            out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=34, do_sample=False)
        mask = np.r_[np.zeros(6), np.ones(34)]
        write_token_shard(self.root / "data", [(row.numpy(), mask) for row in out[:32]], vocab_size=300)
        write_prompts(self.root / "prompts.jsonl", prompts[32:].tolist())
        assert main(["train", *self.overrides(self.root / "run", train__max_steps=4, checkpoint__save_every=2)]) == 0
        hub = self.root / "hub" / "models--org--tiny"
        (hub / "blobs").mkdir(parents=True)
        (hub / "snapshots" / "rev").mkdir(parents=True)
        for i, f in enumerate(sorted((self.root / "target").iterdir())):
            shutil.copy(f, hub / "blobs" / f"sha{i}")
            (hub / "snapshots" / "rev" / f.name).symlink_to(f"../../blobs/sha{i}")
        (self.root / "ready").write_text("")

    def overrides(self, out: Path, target: Path | None = None, **extra) -> list[str]:
        base = {"target.path": target or self.root / "target", "drafter.mask_token_id": 299,
                "drafter.num_layers": 1, "drafter.block_size": 4, "target.layer_ids": "[1,2]",
                "data.path": self.root / "data", "data.token_budget": 160, "data.max_batch_size": 4,
                "objective.num_anchors": 8, "optim.lr": "2e-3", "train.max_steps": 4, "train.log_every": 1,
                "checkpoint.save_every": 0, "train.output_dir": out, "train.device": "cpu"}
        base.update({k.replace("__", "."): v for k, v in extra.items()})
        return [f"{k}={v}" for k, v in base.items()]

    @property
    def target(self) -> Path:
        return self.root / "target"

    @property
    def prompts(self) -> Path:
        return self.root / "prompts.jsonl"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def snapshot(self) -> Path:
        return self.root / "hub" / "models--org--tiny" / "snapshots" / "rev"


def ngram(ws: Workspace, output, target=None, *extra, prompts=None) -> Outcome:
    return cli("eval", "--target", target or ws.target, "--baseline", "ngram", "--prompts", prompts or ws.prompts,
               "--block-size", "4", "--max-new-tokens", "4", "--device", "cpu", "--output", output, *extra)


def with_drafter(ws: Workspace, *extra, target=None, drafter=None, prompts=None, env=None, cwd=None) -> Outcome:
    return cli("eval", "--target", target or ws.target, "--drafter", drafter or ws.run / "drafter", "--prompts",
               prompts or ws.prompts, "--max-new-tokens", "4", "--device", "cpu", *extra, env=env, cwd=cwd)


# ---- 1, 12: the engine environment's directory ----------------------------------------------------

OFFLINE = {"PIP_NO_INDEX": "1"}  # a build that starts fails fast


def _engine_dir_refused(ws, make) -> tuple[bool, str]:
    from flashdraft.vllm_env import EngineUnavailable, engine_python

    root = ws.fresh("engine-dir")
    given = make(root)
    before = files_of(root)
    saved = dict(os.environ)
    os.environ.update({"FLASHDRAFT_ENGINE_DIR": str(given), **OFFLINE})
    try:
        exc, msg = call(engine_python, log=lambda m: None)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    held = isinstance(exc, EngineUnavailable) and "was not made by flashdraft" in msg and files_of(root) == before
    return held, f"{type(exc).__name__}: {msg[:200]}"


def _home(root: Path) -> Path:
    (root / "home" / ".ssh").mkdir(parents=True)
    (root / "home" / ".bashrc").write_text("export PS1=x\n")
    (root / "home" / ".ssh" / "id_ed25519").write_text("secret\n")
    return root / "home"


def _venv_like(root: Path) -> Path:  # somebody's own vLLM environment, without flashdraft's markers
    (root / "venv" / "bin").mkdir(parents=True)
    (root / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (root / "venv" / "bin" / "python").symlink_to(sys.executable)
    return root / "venv"


def _linked(root: Path) -> Path:
    _home(root)
    (root / "link").symlink_to(root / "home")
    return root / "link"


def _a_file(root: Path) -> Path:
    (root / "file").write_text("mine\n")
    return root / "file"


def _one_file(root: Path) -> Path:
    (root / "dir").mkdir()
    (root / "dir" / "notes.txt").write_text("keep\n")
    return root / "dir"


for _name, _make in (("home", _home), ("vllm_venv", _venv_like), ("link", _linked), ("file", _a_file),
                     ("one_file", _one_file)):
    probe(f"engine_dir_{_name}", "engine environment", "1")(lambda ws, make=_make: _engine_dir_refused(ws, make))


@probe("engine_dir_empty_is_built_in", "engine environment", "1", timeout=600)
def _(ws):
    from flashdraft.vllm_env import EngineUnavailable, engine_python

    root = ws.fresh("engine-empty") / "env"
    root.mkdir()
    saved = dict(os.environ)
    os.environ.update({"FLASHDRAFT_ENGINE_DIR": str(root), **OFFLINE})
    try:
        exc, msg = call(engine_python, log=lambda m: None)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    # built in, offline: pip fails; flashdraft's marker says it is its own now
    held = isinstance(exc, EngineUnavailable) and "pip install" in msg and (root / ".flashdraft-engine").is_file()
    return held, msg[:200]


def _broken_env(ws, kind: str) -> tuple[bool, str]:
    from flashdraft.vllm_env import ENGINE_PINS

    root = ws.fresh(f"engine-{kind}")
    env = root / "env"
    (env / "bin").mkdir(parents=True)
    (env / ".flashdraft-ready").write_text(json.dumps({"pins": list(ENGINE_PINS)}))
    if kind == "not_executable":
        (env / "bin" / "python").write_text("#!/bin/sh\n")
    elif kind == "directory":
        (env / "bin" / "python").mkdir()
    elif kind == "relative":
        (env / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    given = "env" if kind == "relative" else str(env)
    done = with_drafter(ws, "--engine", "vllm", target=ws.root / "target64", drafter=_drafter64(ws),
                        env={"FLASHDRAFT_ENGINE_DIR": given}, cwd=root)
    try:
        report = json.loads(done.out[done.out.index("{"):])
    except ValueError:
        return False, done.brief()
    error = (report.get("engine") or {}).get("engine_error", "")
    wanted = "No module named 'vllm'" if kind == "relative" else "is broken: its interpreter"
    return done.exc is None and done.code == 1 and report.get("num_prompts") == 8 and wanted in error, error[:200]


for _kind in ("missing", "not_executable", "directory", "relative"):
    probe(f"engine_env_{_kind}", "engine environment", "12")(lambda ws, k=_kind: _broken_env(ws, k))


@probe("flashdraft_env_with_a_broken_engine_environment", "engine environment", "12")
def _(ws):
    from flashdraft.vllm_env import ENGINE_PINS

    env = ws.fresh("env-cmd") / "env"
    env.mkdir()
    (env / ".flashdraft-ready").write_text(json.dumps({"pins": list(ENGINE_PINS)}))
    done = cli("env", env={"FLASHDRAFT_ENGINE_DIR": str(env)})
    return done.exc is None and done.code == 0 and "broken" in done.out, done.brief() + done.out[-200:]


def _drafter64(ws) -> Path:
    """An untrained drafter of the head_dim-32 target (what vLLM's CPU attention takes), cached."""
    path = ws.root / "drafter64"
    if not (path / "config.json").is_file():
        from flashdraft.drafter import DFlashDrafter
        from flashdraft.target import TargetModel

        target = TargetModel.from_pretrained(ws.root / "target64", target_layer_ids=[1, 2])
        drafter = DFlashDrafter.for_target(target, num_layers=1, block_size=4, mask_token_id=299)
        drafter.save_pretrained(path)
    return path


# ---- 2, 14, 18: eval --output ------------------------------------------------------------------


def _output_refused(ws, output: Path, pattern: str, protected: list[Path], target=None) -> tuple[bool, str]:
    before = {str(p): files_of(p) for p in protected}
    done = ngram(ws, output, target)
    held, detail = done.refused(pattern)
    return held and {str(p): files_of(p) for p in protected} == before, detail


@probe("eval_output_hf_snapshot_config", "eval --output", "2")
def _(ws):
    hub = ws.fresh("hub", ws.root / "hub")
    snap = hub / "models--org--tiny" / "snapshots" / "rev"
    return _output_refused(ws, snap / "config.json", "lies inside .*an input", [hub], target=snap)


@probe("eval_output_hf_snapshot_weights", "eval --output", "2")
def _(ws):
    hub = ws.fresh("hub", ws.root / "hub")
    snap = hub / "models--org--tiny" / "snapshots" / "rev"
    return _output_refused(ws, snap / "model.safetensors", "lies inside .*an input", [hub], target=snap)


@probe("eval_output_link_elsewhere_to_a_blob", "eval --output", "2")
def _(ws):
    hub = ws.fresh("hub", ws.root / "hub")
    snap = hub / "models--org--tiny" / "snapshots" / "rev"
    link = ws.fresh("link") / "report.json"
    link.symlink_to(hub / "models--org--tiny" / "blobs" / "sha0")
    return _output_refused(ws, link, "is the file .*(a symbolic link of it)", [hub], target=snap)


@probe("eval_output_hard_link_of_prompts", "eval --output", "2")
def _(ws):
    d = ws.fresh("hardlink")
    shutil.copy(ws.prompts, d / "prompts.jsonl")
    os.link(d / "prompts.jsonl", d / "report.json")
    done = ngram(ws, d / "report.json", prompts=d / "prompts.jsonl")
    held, detail = done.refused(r"is the file .*prompts.jsonl \(a hard link of it\)")
    return held and (d / "prompts.jsonl").read_bytes() == ws.prompts.read_bytes(), detail


@probe("eval_output_hard_link_of_target_weights", "eval --output", "2")
def _(ws):
    t = ws.fresh("t", ws.target)
    out = ws.fresh("out") / "report.json"
    os.link(t / "model.safetensors", out)
    return _output_refused(ws, out, r"is the file .*model.safetensors \(a hard link of it\)", [t], target=t)


@probe("eval_output_symlink_to_prompts", "eval --output", "2")
def _(ws):
    d = ws.fresh("symlink-prompts")
    shutil.copy(ws.prompts, d / "prompts.jsonl")
    (d / "report.json").symlink_to(d / "prompts.jsonl")
    done = ngram(ws, d / "report.json", prompts=d / "prompts.jsonl")
    held, detail = done.refused(r"is (the file )?.*prompts.jsonl")
    return held and (d / "prompts.jsonl").read_bytes() == ws.prompts.read_bytes(), detail


@probe("eval_output_relative_link_into_the_target", "eval --output", "2")
def _(ws):
    t = ws.fresh("t", ws.target)
    d = ws.fresh("rel")
    (d / "r.json").symlink_to(os.path.relpath(t / "config.json", d))
    return _output_refused(ws, d / "r.json", "(is the file .*config.json|lies inside .*an input)", [t], target=t)


@probe("eval_output_dangling_link", "eval --output", "2")
def _(ws):
    d = ws.fresh("dangling")
    (d / "r.json").symlink_to(d / "nowhere.json")
    held, detail = _output_refused(ws, d / "r.json", "symbolic link", [])
    return held and not (d / "nowhere.json").exists(), detail


@probe("eval_output_link_to_a_plain_file", "eval --output", "2")
def _(ws):
    d = ws.fresh("plainlink")
    (d / "notes.txt").write_text("mine\n")
    (d / "r.json").symlink_to(d / "notes.txt")
    return _output_refused(ws, d / "r.json", "symbolic link .*never through a link", [d / "notes.txt"])


def _target_victim(ws, victim):
    t = ws.fresh("t", ws.target)
    return _output_refused(ws, t / victim, "lies inside .*an input", [t], target=t)


for _victim in ("config.json", "model.safetensors", "generation_config.json"):
    probe(f"eval_output_target_{_victim}", "eval --output", "-")(lambda ws, v=_victim: _target_victim(ws, v))


@probe("eval_output_the_prompts_file", "eval --output", "-")
def _(ws):
    d = ws.fresh("p")
    shutil.copy(ws.prompts, d / "p.jsonl")
    done = cli("eval", "--target", ws.target, "--baseline", "ngram", "--prompts", d / "p.jsonl", "--block-size", "4",
               "--device", "cpu", "--output", d / "p.jsonl")
    held, detail = done.refused(r"is .*p.jsonl, an input")
    return held and (d / "p.jsonl").read_bytes() == ws.prompts.read_bytes(), detail


@probe("eval_output_the_target_directory", "eval --output", "-")
def _(ws):
    t = ws.fresh("t", ws.target)
    return _output_refused(ws, t, "is .*an input", [t], target=t)


@probe("eval_output_the_drafters_weights", "eval --output", "-")
def _(ws):
    d = ws.fresh("d", ws.run / "drafter")
    before = files_of(d)
    done = with_drafter(ws, "--output", d / "model.safetensors", drafter=d)
    held, detail = done.refused("lies inside .*an input")
    return held and files_of(d) == before, detail


def _runs_own(ws, own):
    run = ws.fresh("run", ws.run)
    before = files_of(run / "checkpoints")
    keep = files_of(run / own) if (run / own).exists() else {}
    done = ngram(ws, run / own)
    held, detail = done.refused("training run|run's checkpoints")
    after = files_of(run / own) if (run / own).exists() else {}
    return held and files_of(run / "checkpoints") == before and after == keep, detail


for _own in ("metrics.jsonl", "config.yaml", "drafter/config.json", "drafter/model.safetensors", "drafter", ".lock",
             "checkpoints/step_00000004"):
    probe(f"eval_output_a_runs_own_{_own.replace('/', '_').strip('.')}", "eval --output",
          "-" if _own.startswith("checkpoints") else "18")(lambda ws, own=_own: _runs_own(ws, own))


@probe("eval_output_a_new_file_in_a_run_directory", "eval --output", "18")
def _(ws):
    run = ws.fresh("run", ws.run)
    done = ngram(ws, run / "eval-report.json")
    ok, detail = done.ok()
    return ok and json.loads((run / "eval-report.json").read_text())["num_prompts"] == 8, detail


@probe("eval_output_a_new_nested_path", "eval --output", "-")
def _(ws):
    out = ws.fresh("nested") / "a" / "b" / "r.json"
    ok, detail = ngram(ws, out).ok()
    mode = out.stat().st_mode & 0o777 if out.exists() else 0
    return ok and mode == 0o666 & ~_umask(), f"{detail} mode {oct(mode)}"


@probe("eval_output_replaces_an_earlier_report", "eval --output", "2")
def _(ws):
    d = ws.fresh("again")
    (d / "r.json").write_text("old\n")
    os.link(d / "r.json", d / "keep.json")  # another name of the old report: keeps the old bytes
    ok, detail = ngram(ws, d / "r.json").ok()
    return ok and (d / "keep.json").read_text() == "old\n" and "num_prompts" in (d / "r.json").read_text(), detail


@probe("eval_output_a_directory", "eval --output", "-")
def _(ws):
    return ngram(ws, ws.fresh("dir")).refused(r"(is a directory|cannot write)")


@probe("eval_output_dev_null", "eval --output", "14")
def _(ws):
    return ngram(ws, "/dev/null").ok()


@probe("eval_output_dev_full", "eval --output", "-")
def _(ws):
    done = ngram(ws, "/dev/full")
    held, detail = done.refused(r"/dev/full: cannot write the report \(No space left on device\); it is printed above")
    return held and '"num_prompts": 8' in done.out, detail


@probe("eval_output_a_socket", "eval --output", "14")
def _(ws):
    import socket

    path = ws.fresh("sock") / "s"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        return ngram(ws, path).refused(r"(is a socket|cannot write)")


@probe("eval_output_fifo_with_a_reader", "eval --output", "14", isolate=True, timeout=180)
def _(ws):
    fifo = ws.fresh("fifo") / "r.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()), daemon=True)
    reader.start()
    done = []
    writer = threading.Thread(target=lambda: done.append(ngram(ws, fifo)), daemon=True)
    writer.start()
    writer.join(120)
    if writer.is_alive():
        return False, "hung (120 s)"
    reader.join(10)
    return done[0].exc is None and done[0].code == 0 and got and '"num_prompts": 8' in got[0], done[0].brief()


@probe("eval_output_fifo_without_a_reader_never_blocks_the_start", "eval --output", "14", isolate=True, timeout=180)
def _(ws):
    """The probe at the start (before the decode) used to block on a pipe nobody reads; the
    report is written at the end, when a reader comes."""
    fifo = ws.fresh("fifo2") / "r.fifo"
    os.mkfifo(fifo)
    done = []
    writer = threading.Thread(target=lambda: done.append(ngram(ws, fifo)), daemon=True)
    writer.start()
    time.sleep(20)  # the decode is over by now; only the final write may wait for a reader
    got = fifo.read_text()  # a reader comes late
    writer.join(60)
    return bool(done) and done[0].code == 0 and '"num_prompts": 8' in got, done[0].brief() if done else "hung"


# ---- 3: a finished run's budget raised -------------------------------------------------------------


def _raised(ws, **extra) -> tuple[bool, str]:
    run = ws.fresh("finished", ws.run)
    before = files_of(run / "checkpoints")
    done = cli("train", *ws.overrides(run, **extra))
    held, detail = done.refused(r"ended its learning-rate schedule at step 4 .*learning rate 0")
    return held and files_of(run / "checkpoints") == before, detail


probe("finished_run_max_steps_raised", "resume", "3")(lambda ws: _raised(ws, train__max_steps=8))
probe("finished_run_max_steps_raised_by_one", "resume", "3")(lambda ws: _raised(ws, train__max_steps=5))
probe("finished_run_epochs_given_instead", "resume", "3")(
    lambda ws: _raised(ws, train__max_steps="null", train__epochs=3))


@probe("finished_run_same_budget_is_a_no_op", "resume", "-")
def _(ws):
    run = ws.fresh("finished", ws.run)
    before = files_of(run / "checkpoints")
    ok, detail = cli("train", *ws.overrides(run)).ok()
    return ok and files_of(run / "checkpoints") == before, detail


@probe("a_stopped_run_resumed_with_a_larger_budget_trains_on", "resume", "-")
def _(ws):
    """A run stopped mid-way (its schedule not at its end) may be given more steps."""
    from flashdraft.checkpoint import CheckpointManager

    run = ws.fresh("partial")
    first = cli("train", *ws.overrides(run, train__max_steps=8, checkpoint__save_every=2))
    for step in (run / "checkpoints").glob("step_*"):  # as if stopped after step 4: its schedule is mid-way
        if step.name in ("step_00000006", "step_00000008"):
            shutil.rmtree(step)
    (run / "checkpoints" / "latest").unlink(missing_ok=True)
    resumed = cli("train", *ws.overrides(run, train__max_steps=10, checkpoint__save_every=2))
    ok, detail = resumed.ok()
    return first.code == 0 and ok and CheckpointManager(run / "checkpoints").load_latest().step == 10, detail


# ---- 4, 5, 16: export --out ---------------------------------------------------------------------


def export(ws, out, *extra, source=None) -> Outcome:
    return cli("export", source or ws.run, "--out", out, *extra)


@probe("export_into_a_cloned_repository", "export --out", "4")
def _(ws):
    repo = ws.fresh("repo")
    assert export(ws, repo / "x").code == 0
    repo = repo / "x"
    for name, text in {".git/HEAD": "ref\n", "README.md": "# card\n", ".gitattributes": "*.safetensors lfs\n",
                       "LICENSE": "MIT\n", "tokenizer.json": "{}\n"}.items():
        (repo / name).parent.mkdir(exist_ok=True)
        (repo / name).write_text(text)
    others = {k: v for k, v in files_of(repo).items() if not k.endswith(("config.json", "model.safetensors"))}
    ok, detail = export(ws, repo, "--step", "2").ok()
    kept = {k: v for k, v in files_of(repo).items() if not k.endswith(("config.json", "model.safetensors"))}
    return ok and kept == others, detail


@probe("export_into_an_empty_directory", "export --out", "-")
def _(ws):
    out = ws.fresh("empty")
    ok, detail = export(ws, out).ok()
    return ok and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"], detail


@probe("export_replaces_an_earlier_export_and_leaves_nothing_beside_it", "export --out", "-")
def _(ws):
    parent = ws.fresh("again")
    export(ws, parent / "e", "--step", "2")
    ok, detail = export(ws, parent / "e").ok()
    return ok and [p.name for p in parent.iterdir()] == ["e"], detail


def _planted(ws, names) -> tuple[bool, str]:
    victim = ws.fresh("victim")
    (victim / "precious.txt").write_text("mine\n")
    parent = ws.fresh("shared")
    for name in names:
        (parent / name.format(pid=os.getpid())).symlink_to(victim)
    ok, detail = export(ws, parent / "out").ok()
    return ok and sorted(p.name for p in victim.iterdir()) == ["precious.txt"], detail


probe("export_link_planted_at_tmp_pid", "export --out", "5")(lambda ws: _planted(ws, [".out.tmp-{pid}"]))
probe("export_link_planted_at_old_pid", "export --out", "5")(lambda ws: _planted(ws, [".out.old-{pid}"]))
probe("export_links_planted_at_both", "export --out", "5")(
    lambda ws: _planted(ws, [".out.tmp-{pid}", ".out.old-{pid}"]))


@probe("export_links_planted_at_the_serving_writers_names", "export --out", "5")
def _(ws):
    from flashdraft.drafter import DFlashDrafter
    from flashdraft.drafter.serving import write_export

    victim = ws.fresh("victim")
    (victim / "w").write_bytes(b"not yours")
    out = ws.fresh("e", ws.run / "drafter")
    for name in ("model.safetensors", "config.json"):
        (out / f".{name}.tmp-{os.getpid()}").symlink_to(victim / "w")
    drafter = DFlashDrafter.from_pretrained(out)
    exc, msg = call(write_export, out, {k: v.contiguous() for k, v in drafter.state_dict().items()}, drafter.config)
    return exc is None and (victim / "w").read_bytes() == b"not yours", msg[:200]


@probe("export_old_export_moved_aside_is_gone", "export --out", "-")
def _(ws):
    parent = ws.fresh("aside")
    export(ws, parent / "e", "--step", "2")
    export(ws, parent / "e")
    return [p.name for p in parent.iterdir()] == ["e"], str([p.name for p in parent.iterdir()])


@probe("export_out_a_link_to_an_export", "export --out", "16")
def _(ws):
    d = ws.fresh("l")
    export(ws, d / "real", "--step", "2")
    (d / "link").symlink_to(d / "real")
    before = files_of(d / "real")
    held, detail = export(ws, d / "link").refused(r"is a symbolic link")
    return held and (d / "link").is_symlink() and files_of(d / "real") == before and \
        sorted(p.name for p in d.iterdir()) == ["link", "real"], detail


@probe("export_out_a_link_to_a_directory_of_other_content", "export --out", "16")
def _(ws):
    d = ws.fresh("l2")
    (d / "mine").mkdir()
    (d / "mine" / "a.txt").write_text("a")
    (d / "link").symlink_to(d / "mine")
    held, detail = export(ws, d / "link").refused(r"(is a symbolic link|is not a drafter export)")
    return held and (d / "mine" / "a.txt").read_text() == "a", detail


@probe("export_out_a_dangling_link", "export --out", "16")
def _(ws):
    d = ws.fresh("l3")
    (d / "link").symlink_to(d / "nowhere")
    held, detail = export(ws, d / "link").refused(r"symbolic link")
    return held and (d / "link").is_symlink() and not (d / "nowhere").exists(), detail


@probe("export_out_a_runs_own_drafter", "export --out", "18")
def _(ws):
    run = ws.fresh("run", ws.run)
    before = files_of(run / "drafter")
    held, detail = export(ws, run / "drafter", "--step", "2", source=run).refused(r"an output of the training run")
    return held and files_of(run / "drafter") == before, detail


for _where, _pattern in (("checkpoints", r"a training run's checkpoints"),
                         ("checkpoints/step_00000004/export", r"a training run's checkpoints"),
                         ("checkpoints/step_00000009", r"a training run's checkpoints")):
    probe(f"export_out_inside_{_where.replace('/', '_')}", "export --out", "-")(
        lambda ws, w=_where, p=_pattern: _export_refused_in_run(ws, w, p))


def _export_refused_in_run(ws, where, pattern):
    run = ws.fresh("run", ws.run)
    before = files_of(run / "checkpoints")
    held, detail = export(ws, run / where, source=run).refused(pattern)
    return held and files_of(run / "checkpoints") == before, detail


@probe("export_out_the_target_directory", "export --out", "-")
def _(ws):
    t = ws.fresh("t", ws.target)
    before = files_of(t)
    held, detail = export(ws, t).refused(r"is not a drafter export")
    return held and files_of(t) == before, detail


@probe("export_out_an_existing_file", "export --out", "-")
def _(ws):
    f = ws.fresh("f") / "x"
    f.write_text("mine")
    held, detail = export(ws, f).refused(r"is not a drafter export")
    return held and f.read_text() == "mine", detail


@probe("export_out_under_a_file", "export --out", "-")
def _(ws):
    f = ws.fresh("f") / "x"
    f.write_text("mine")
    return export(ws, f / "sub").refused(r"cannot write the export there")


@probe("export_files_follow_the_umask", "export --out", "-")
def _(ws):
    out = ws.fresh("mode") / "e"
    ok, detail = export(ws, out).ok()
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    wanted = 0o666 & ~_umask()
    return ok and set(modes.values()) == {wanted} and out.stat().st_mode & 0o777 == 0o777 & ~_umask(), str(modes)


# ---- 10: export --verify-engine prompts -------------------------------------------------------------


def _verify_prompts(ws, prompts, pattern) -> tuple[bool, str]:
    d = ws.fresh("verify")
    from flashdraft.evaluate import write_prompts

    if isinstance(prompts, list):
        write_prompts(d / "p.jsonl", prompts)
    else:
        (d / "p.jsonl").write_bytes(prompts)
    held, detail = export(ws, d / "out", "--verify-engine", "vllm", "--prompts", d / "p.jsonl").refused(pattern)
    return held and not (d / "out").exists(), detail


probe("verify_engine_out_of_vocabulary_id", "export --verify-engine", "10")(
    lambda ws: _verify_prompts(ws, [[1, 2, 400]], r"token id 400 outside the target's vocabulary"))
probe("verify_engine_prompt_beyond_positions", "export --verify-engine", "10")(
    lambda ws: _verify_prompts(ws, [[3] * 500], r"needs 568 positions, more than the target's max_position"))
probe("verify_engine_negative_id", "export --verify-engine", "10")(
    lambda ws: _verify_prompts(ws, [[1, -5]], r"token id -5 outside"))
probe("verify_engine_prompts_not_json", "export --verify-engine", "-")(
    lambda ws: _verify_prompts(ws, b"hello\n", r"expected a JSON object with an input_ids list"))
probe("verify_engine_prompts_empty", "export --verify-engine", "-")(
    lambda ws: _verify_prompts(ws, b"", r"no prompts"))
probe("verify_engine_boolean_ids", "export --verify-engine", "-")(
    lambda ws: _verify_prompts(ws, b'{"input_ids": [true, 2]}\n', r"input_ids must be a non-empty list"))


@probe("verify_engine_max_new_tokens_beyond_positions", "export --verify-engine", "10")
def _(ws):
    d = ws.fresh("verify")
    from flashdraft.evaluate import write_prompts

    write_prompts(d / "p.jsonl", [[1, 2, 3]])
    done = export(ws, d / "out", "--verify-engine", "vllm", "--prompts", d / "p.jsonl", "--max-new-tokens", "600")
    held, detail = done.refused(r"more than the target's max_position_embeddings=512")
    return held and not (d / "out").exists(), detail


@probe("verify_engine_prompts_missing", "export --verify-engine", "-")
def _(ws):
    d = ws.fresh("verify")
    held, detail = export(ws, d / "out", "--verify-engine", "vllm", "--prompts", d / "none.jsonl").refused(
        r"cannot read the prompts")
    return held and not (d / "out").exists(), detail


# ---- 6, 7: the engine worker and sampling ---------------------------------------------------------


@probe("eval_engine_sampled_temperature", "eval --engine", "7")
def _(ws):
    return with_drafter(ws, "--engine", "vllm", "--temperature", "0.8").refused(
        r"the engine check is greedy only \(sampled engine checks are not verified")


@probe("eval_engine_sampled_top_p_top_k", "eval --engine", "7")
def _(ws):
    return with_drafter(ws, "--engine", "vllm", "--temperature", "0.8", "--top-p", "0.95", "--top-k", "20").refused(
        r"greedy only")


@probe("eval_engine_sampled_temperature_1", "eval --engine", "7")
def _(ws):
    return with_drafter(ws, "--engine", "vllm", "--temperature", "1").refused(r"greedy only")


@probe("engine_checks_api_refuses_sampling", "eval --engine", "7")
def _(ws):
    from flashdraft.judge.engine import engine_checks
    from flashdraft.speculative import Sampling

    exc, msg = call(engine_checks, ws.target, [ws.run / "drafter"], [[1, 2, 3]], max_new_tokens=4,
                    sampling=Sampling(0.8, 1.0, 0, 0))
    return isinstance(exc, ValueError) and "not verified" in msg, f"{type(exc).__name__}: {msg[:200]}"


@probe("eval_engine_without_a_drafter", "eval --engine", "-")
def _(ws):
    return cli("eval", "--target", ws.target, "--baseline", "ngram", "--prompts", ws.prompts, "--engine",
               "vllm").refused(r"--engine: give --drafter DIR")


@probe("eval_engine_greedy_on_the_trained_export", "eval --engine", "-", timeout=900)
def _(ws):
    """The greedy engine check still runs: vLLM on a head_dim-32 target (an untrained drafter:
    outputs lossless, taus compared)."""
    done = with_drafter(ws, "--engine", "vllm", target=ws.root / "target64", drafter=_drafter64(ws))
    try:
        report = json.loads(done.out[done.out.index("{"):])["engine"]
    except (ValueError, KeyError):
        return False, done.brief()
    return done.exc is None and report.get("lossless") is True and report.get("same_outputs") is True, \
        json.dumps({k: report.get(k) for k in ("lossless", "same_outputs", "same_steps", "tau_agrees")})


def _signal_engine(ws, sig) -> tuple[bool, str]:
    import psutil

    scratch = ws.fresh("sig")
    report = scratch / "report.json"
    env = {**os.environ, "TMPDIR": str(scratch), "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, "-m", "flashdraft.cli", "eval", "--target", ws.root / "target64", "--drafter",
            _drafter64(ws), "--prompts", ws.prompts, "--max-new-tokens", "4", "--device", "cpu", "--engine", "vllm",
            "--output", report]
    proc = subprocess.Popen([str(a) for a in argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    worker = None
    deadline = time.monotonic() + 240
    while worker is None and proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            worker = next((p for p in psutil.Process(proc.pid).children(recursive=True)
                           if any("engine_worker.py" in part for part in p.cmdline())), None)
        time.sleep(0.2)
    if worker is None:
        proc.kill()
        return False, "no worker started"
    time.sleep(3)  # the worker is importing vLLM
    proc.send_signal(sig)
    try:
        code = proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = None
    err = proc.stderr.read()
    alive = worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE
    if alive:
        worker.kill()  # an orphan of the code before
    left = [p.name for p in scratch.iterdir() if p.name != "report.json"]
    held = code == 128 + sig and not alive and not left and not report.exists() and "Traceback" not in err
    return held, f"exit {code}, worker alive {alive}, left {left}, report {report.exists()}"


probe("sigterm_to_eval_engine", "signals", "6", isolate=True, timeout=400)(
    lambda ws: _signal_engine(ws, signal.SIGTERM))
probe("sigint_to_eval_engine", "signals", "6", isolate=True, timeout=400)(
    lambda ws: _signal_engine(ws, signal.SIGINT))


@probe("sigterm_to_eval_while_flashdraft_decodes", "signals", "-", isolate=True, timeout=300)
def _(ws):
    """No engine: SIGTERM ends the command at once (nothing to clean up) and leaves no report."""
    report = ws.fresh("sig") / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft.cli", "eval", "--target", str(ws.target),
                             "--baseline", "ngram", "--prompts", str(ws.prompts), "--block-size", "4",
                             "--max-new-tokens", "256", "--device", "cpu", "--output", str(report)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(8)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    whole = False  # a report written whole before the signal came (the decode can end within the 8 s)
    with contextlib.suppress(OSError, ValueError):
        whole = bool(json.loads(report.read_text()))
    return code in (-15, 143, 0) and (not report.exists() or whole), f"exit {code}, report {report.exists()}, " \
        f"whole {whole}"


# ---- 8: a target's config.json or weights nothing can be built from ---------------------------------

BAD_TARGETS = {
    "empty": (b"", r"not a readable JSON model config"),
    "binary": (b"\xff\xfe\x00\x01", r"not a readable JSON model config"),
    "null": (b"null", r"a model config is a JSON object"),
    "list": (b"[1, 2]", r"a model config is a JSON object"),
    "deep": (b"[" * 100_000 + b"]" * 100_000, r"nested too deeply"),
    "zero_heads": ({"num_attention_heads": 0}, r"num_attention_heads=0 is invalid"),
    "zero_hidden": ({"hidden_size": 0}, r"hidden_size=0 is invalid"),
    "negative_hidden": ({"hidden_size": -32}, r"hidden_size=-32 is invalid"),
    "string_hidden": ({"hidden_size": "32"}, r"hidden_size='32' is invalid"),
    "fractional_hidden": ({"hidden_size": 32.5}, r"hidden_size=32.5 is invalid"),
    "nan_hidden": ({"hidden_size": float("nan")}, r"hidden_size=nan is invalid"),
    "null_hidden": ({"hidden_size": None}, r"hidden_size=None is invalid"),
    "negative_layers": ({"num_hidden_layers": -4}, r"num_hidden_layers=-4 is invalid"),
    "zero_vocab": ({"vocab_size": 0}, r"vocab_size=0 is invalid"),
    "kv_heads_not_dividing": ({"num_key_value_heads": 3}, r"num_key_value_heads=3 does not divide"),
    "zero_intermediate": ({"intermediate_size": 0}, r"intermediate_size=0 is invalid"),
    "zero_positions": ({"max_position_embeddings": 0}, r"max_position_embeddings=0 is invalid"),
    "remote_code": ({"auto_map": {"AutoModelForCausalLM": "m.M"}}, r"Python code in its own directory"),
}
HEAVY_TARGETS = {  # isolated: the code before built or allocated these
    "million_layers": ({"num_hidden_layers": 1_000_000}, r"num_hidden_layers=1000000 is invalid"),
    "huge_hidden": ({"hidden_size": 10**12}, r"hidden_size=1000000000000 is invalid"),
    "huge_vocab": ({"vocab_size": 10**11}, r"vocab_size=100000000000 is invalid"),
}


def _bad_target(ws, change) -> Path:
    t = ws.fresh("bad-target", ws.target)
    if isinstance(change, dict):
        config = json.loads((t / "config.json").read_text())
        config.update(change)
        config.pop("layer_types", None)  # transformers refuses a length mismatch first, as it may
        (t / "config.json").write_text(json.dumps(config))
    else:
        (t / "config.json").write_bytes(change)
    return t


def _bad_target_command(ws, name, command, table) -> tuple[bool, str]:
    change, pattern = table[name]
    t = _bad_target(ws, change)
    if command == "eval":
        done = cli("eval", "--target", t, "--baseline", "ngram", "--prompts", ws.prompts, "--block-size", "4",
                   "--max-new-tokens", "2", "--device", "cpu")
    else:
        done = cli(command, *ws.overrides(ws.fresh("run"), target=t))
    return done.refused(re.escape(str(t / "config.json")) + ": .*" + pattern)


for _name in BAD_TARGETS:
    for _command in ("plan", "train", "eval"):
        probe(f"bad_target_{_name}_{_command}", "target config.json", "13" if _name == "remote_code" else "8")(
            lambda ws, n=_name, c=_command: _bad_target_command(ws, n, c, BAD_TARGETS))
for _name in HEAVY_TARGETS:
    for _command in ("plan", "train", "eval"):
        probe(f"bad_target_{_name}_{_command}", "target config.json", "8", isolate=True, timeout=240)(
            lambda ws, n=_name, c=_command: _bad_target_command(ws, n, c, HEAVY_TARGETS))


def _corrupt_weights(ws, command, data: bytes) -> tuple[bool, str]:
    t = ws.fresh("bad-weights", ws.target)
    (t / "model.safetensors").write_bytes(data)
    if command == "eval":
        done = cli("eval", "--target", t, "--baseline", "ngram", "--prompts", ws.prompts, "--block-size", "4",
                   "--max-new-tokens", "2", "--device", "cpu")
    else:
        done = cli("train", *ws.overrides(ws.fresh("run"), target=t))
    return done.refused(re.escape(str(t / "model.safetensors")) + r": cannot read the target's weights")


for _command in ("train", "eval"):
    probe(f"corrupt_target_weights_header_{_command}", "target config.json", "8")(
        lambda ws, c=_command: _corrupt_weights(ws, c, b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage"))
    probe(f"truncated_target_weights_{_command}", "target config.json", "8")(
        lambda ws, c=_command: _corrupt_weights(ws, c, (ws.target / "model.safetensors").read_bytes()[:5000]))
    probe(f"empty_target_weights_{_command}", "target config.json", "8")(
        lambda ws, c=_command: _corrupt_weights(ws, c, b""))


@probe("plan_of_a_target_with_damaged_weights_reads_only_its_config", "target config.json", "-")
def _(ws):
    t = ws.fresh("w", ws.target)
    (t / "model.safetensors").write_bytes(b"garbage")
    return cli("plan", *ws.overrides(ws.fresh("run"), target=t)).ok()


# ---- 9: plan answers only what train would run ------------------------------------------------------


def _plan(ws, *extra, target=None) -> Outcome:
    t = target or ws.target
    flags = [e for i, e in enumerate(extra) if e.startswith("--") or (i and extra[i - 1].startswith("--"))]
    return cli("plan", f"target.path={t}", "drafter.mask_token_id=1", "target.layer_ids=[1,2]",
               "train.device=cpu", *[e for e in extra if e not in flags], *flags)


PLAN_REFUSALS = {
    "taps_outside": (["target.layer_ids=[1,9]"], r"target.layer_ids=\[1, 9\] is invalid for this 4-layer"),
    "tensor_parallel_3": (["target.tensor_parallel=3"], r"target.tensor_parallel=3 must divide"),
    "row_budget_1": (["data.row_budget=1"], r"raise data.row_budget to at least"),
    "row_budget_below_block": (["data.row_budget=15"], r"no num_anchors fits"),
    "seq_len_beyond_positions": (["--seq-len", "600", "data.max_length=1024", "data.token_budget=1024"],
                                 r"--seq-len 600: give a padded length in \[2, 512\]"),
    "seq_len_1": (["--seq-len", "1"], r"--seq-len 1: give a padded length"),
    "device_memory_nan": (["--device-memory", "nan"], r"--device-memory nan: give the device's memory"),
    "device_memory_inf": (["--device-memory", "inf"], r"--device-memory inf: give the device's memory"),
    "device_memory_negative": (["--device-memory", "-3"], r"--device-memory -3.0: give"),
    "device_memory_zero": (["--device-memory", "0"], r"--device-memory 0.0: give"),
    "mask_outside_vocab": (["drafter.mask_token_id=300"], r"drafter.mask_token_id=300 is outside"),
    "dflash2_groups": (["drafter.family=dflash2", "drafter.conv_group_size=5"],
                       r"drafter.conv_group_size=5 must divide"),
    "default_taps_repeat": (["target.layer_ids=null", "target.num_taps=3"], r"repeats or leaves the model"),
}


for _name, (_extra, _pattern) in PLAN_REFUSALS.items():
    probe(f"plan_{_name}", "plan", "9" if _name not in ("seq_len_1", "device_memory_negative", "device_memory_zero",
                                                        "mask_outside_vocab", "default_taps_repeat") else "-")(
        lambda ws, e=_extra, p=_pattern: _plan(ws, *e).refused(p))


@probe("plan_experts_per_token_beyond_experts", "plan", "9")
def _(ws):
    t = ws.fresh("moe")
    (t / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 4, "vocab_size": 300, "num_experts": 4, "num_experts_per_tok": 8,
        "max_position_embeddings": 512}))
    return _plan(ws, target=t).refused(r"num_experts_per_tok=8 routes each token to more experts than the 4")


@probe("plan_zero_layers", "plan", "9")
def _(ws):
    return _plan(ws, target=_bad_target(ws, {"num_hidden_layers": 0})).refused(r"num_hidden_layers=0 is invalid")


@probe("plan_not_a_causal_lm", "plan", "9")
def _(ws):
    t = _bad_target(ws, {"model_type": "bert", "architectures": ["BertForMaskedLM"], "num_hidden_layers": 2})
    return _plan(ws, target=t).refused(r"not a decoder-only causal LM")


@probe("plan_a_length_beyond_positions_is_planned_up_to_them", "plan", "9")
def _(ws):
    done = _plan(ws, "data.max_length=4096", "data.token_budget=4096", "data.row_budget=65536")
    ok, detail = done.ok()
    worst = int(re.search(r"S=(\d+)", done.out).group(1)) if "S=" in done.out else 10**9
    return ok and worst <= 512 and "max_position_embeddings=512" in done.out, f"{detail} S={worst}"


@probe("plan_a_million_lengths", "plan", "9", isolate=True, timeout=120)
def _(ws):
    t = _bad_target(ws, {"max_position_embeddings": 2**30})
    begin = time.monotonic()
    done = _plan(ws, "data.max_length=1000000", "data.token_budget=1000000", target=t)
    ok, detail = done.ok()
    took = time.monotonic() - begin
    return ok and took < 30, f"{detail} {took:.1f} s"


@probe("plan_a_billion_lengths", "plan", "9", isolate=True, timeout=150)
def _(ws):
    t = _bad_target(ws, {"max_position_embeddings": 2**30})
    begin = time.monotonic()
    done = _plan(ws, "data.max_length=1000000000", "data.token_budget=1000000000", target=t)
    ok, detail = done.ok()
    return ok, f"{detail} {time.monotonic() - begin:.1f} s"


for _extra in ([], ["--seq-len", "64"], ["--device-memory", "0.001"], ["pipeline.enabled=false"],
               ["pipeline.placement=disaggregated", "--world-size", "2"], ["drafter.activation_checkpointing=true"]):
    _named = _extra[:1] if "--world-size" in _extra else _extra  # a disaggregated plan needs the world size
    probe(f"plan_good_{'_'.join(e.strip('-').replace('.', '_').split('=')[0] for e in _named) or 'default'}",
          "plan", "-")(lambda ws, e=_extra: _plan(ws, *e).ok(1 if "0.001" in e else 0))


# ---- 11: a tampered drafter export --------------------------------------------------------------------


def _tampered(ws, change, pattern, command="eval") -> tuple[bool, str]:
    d = ws.fresh("tampered", ws.run / "drafter")
    config = json.loads((d / "config.json").read_text())
    config.update(change)
    (d / "config.json").write_text(json.dumps(config))
    return with_drafter(ws, drafter=d).refused(pattern)


TAMPERED = {
    "intermediate_1e9": ({"intermediate_size": 1_000_000_000}, r"intermediate_size=1000000000 is invalid", True),
    "intermediate_float": ({"intermediate_size": 1e9}, r"intermediate_size=1000000000.0 is invalid", True),
    "intermediate_within_bounds": ({"intermediate_size": 1 << 19}, r"size mismatch for layers.0.mlp", True),
    "hidden_doubled": ({"hidden_size": 64}, r"(size mismatch|trained for another target)", False),
    "layers_million": ({"num_hidden_layers": 1_000_000}, r"num_hidden_layers=1000000 is invalid", True),
    "heads_zero": ({"num_attention_heads": 0}, r"num_attention_heads=0 is invalid", False),
    "vocab_zero": ({"vocab_size": 0}, r"vocab_size=0 is invalid", False),
    "head_dim_string": ({"head_dim": "8"}, r"head_dim='8' is invalid", False),
    "two_layers": ({"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2},
                   r"missing weights \['layers.1", False),
}

for _name, (_change, _pattern, _heavy) in TAMPERED.items():
    probe(f"tampered_drafter_{_name}", "drafter export", "11", isolate=_heavy, timeout=240)(
        lambda ws, c=_change, p=_pattern: _tampered(ws, c, p))


@probe("drafter_weights_truncated", "drafter export", "-")
def _(ws):
    d = ws.fresh("trunc", ws.run / "drafter")
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:3000])
    return with_drafter(ws, drafter=d).refused(r"cannot read the drafter's weights")


@probe("drafter_config_not_json", "drafter export", "-")
def _(ws):
    d = ws.fresh("cfg", ws.run / "drafter")
    (d / "config.json").write_text("{")
    return with_drafter(ws, drafter=d).refused(r"cannot read the drafter's config")


@probe("drafter_mask_id_outside_vocabulary", "drafter export", "-")
def _(ws):
    d = ws.fresh("mask", ws.run / "drafter")
    config = json.loads((d / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 10**9
    (d / "config.json").write_text(json.dumps(config))
    return with_drafter(ws, drafter=d).refused(r"mask_token_id=1000000000 is no id of its vocabulary")


@probe("drafter_of_another_target", "drafter export", "-")
def _(ws):
    return with_drafter(ws, target=ws.root / "target64").refused(r"was trained for another target")


# ---- 13: messages ------------------------------------------------------------------------------------


@probe("row_budget_7_block_8_train", "messages", "13")
def _(ws):
    done = cli("train", *ws.overrides(ws.fresh("run"), data__row_budget=7, drafter__block_size=8,
                                     data__max_length=40))
    held, detail = done.refused(r"raise data.row_budget to at least \d+ \(one anchor's block alone is "
                                r"drafter.block_size=8 rows: no num_anchors fits\)")
    return held and "num_anchors to 1" not in done.err, detail


for _name, _change, _field in (("num_anchors", {"objective__num_anchors": 4}, "objective.num_anchors"),
                               ("row_budget", {"data__row_budget": 64}, "data.row_budget")):
    probe(f"resume_refused_by_the_cursor_{_name}", "messages", "13")(
        lambda ws, c=_change, f=_field: _resume_named(ws, c, f))


def _resume_named(ws, change, field):
    run = ws.fresh("run", ws.run)
    (run / "checkpoints" / "step_00000004").rename(run / "checkpoints" / "gone")  # resume from step 2
    shutil.rmtree(run / "checkpoints" / "gone")
    (run / "checkpoints" / "latest").unlink(missing_ok=True)
    done = cli("train", *ws.overrides(run, **change))
    return done.refused(rf"cannot resume from {re.escape(str(run / 'checkpoints'))} \(step 2\): the data cursor was "
                        rf"saved with {re.escape(field)} \d+ .*restore {re.escape(field)}=")


@probe("resume_refused_by_the_config_names_section_and_directory", "messages", "-")
def _(ws):
    run = ws.fresh("run", ws.run)
    (run / "checkpoints" / "step_00000004").rename(run / "gone")
    done = cli("train", *ws.overrides(run, drafter__block_size=8))
    return done.refused(rf"cannot resume from {re.escape(str(run / 'checkpoints'))}: the config changed "
                        r"\(drafter.block_size: checkpoint 4 vs now 8\)")


for _name, _given, _field in (("disaggregated_disk", ["pipeline.placement=disaggregated",
                                                       "pipeline.feature_cache_disk_bytes=1e9"],
                               "pipeline.feature_cache_disk_bytes=1000000000"),
                              ("disaggregated_ram", ["pipeline.placement=disaggregated",
                                                     "pipeline.feature_cache_bytes=1e9"],
                               "pipeline.feature_cache_bytes=1000000000"),
                              ("tensor_parallel_disk", ["target.tensor_parallel=2",
                                                        "pipeline.feature_cache_disk_bytes=1e9"],
                               "pipeline.feature_cache_disk_bytes=1000000000")):
    probe(f"cache_knob_named_{_name}", "messages", "13" if "disk" in _name else "-")(
        lambda ws, g=_given, f=_field: cli("config", *g).refused(rf"config {re.escape(f)} is invalid"))


@probe("remote_code_target_message_has_no_url", "messages", "13")
def _(ws):
    t = _bad_target(ws, {"auto_map": {"AutoModelForCausalLM": "modeling.M"}, "model_type": "custom"})
    done = cli("eval", "--target", t, "--baseline", "ngram", "--prompts", ws.prompts, "--device", "cpu")
    held, detail = done.refused(r"Python code in its own directory")
    return held and "https://" not in done.err, detail


@probe("a_peer_that_never_joins", "messages", "13", isolate=True, timeout=120)
def _(ws):
    from flashdraft import distributed

    port = _free_port()
    os.environ.update({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    exc, msg = call(distributed.init_distributed, "cpu", timeout_s=3)
    held = type(exc).__name__ == "StartupError" and "could not join the job" in msg and \
        getattr(exc, "names_the_fix", False)
    return held, f"{type(exc).__name__}: {msg[:250]}"


@probe("a_rank_killed_at_start_up", "messages", "13", isolate=True, timeout=300)
def _(ws):
    """Rank 1 joins the job, then dies before the start-up barrier; rank 0 runs `flashdraft
    train`: its error says a rank died, not that the (3600 s) start-up timeout passed."""
    port = _free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    rank1 = subprocess.Popen([sys.executable, "-c", "import os, time; from flashdraft import distributed as d; "
                              "d.init_distributed('cpu', timeout_s=60); time.sleep(1); os._exit(9)"],
                             env={**env, "RANK": "1", "LOCAL_RANK": "1"})
    rank0 = subprocess.run([sys.executable, "-m", "flashdraft.cli", "train",
                            *ws.overrides(ws.fresh("run"), train__collective_timeout_s=60)],
                           env={**env, "RANK": "0", "LOCAL_RANK": "0"}, capture_output=True, text=True, timeout=240)
    rank1.wait(30)
    line = rank0.stderr.strip().splitlines()[-1] if rank0.stderr.strip() else ""
    held = rank0.returncode == 2 and "a rank died during start-up" in line and "Traceback" not in rank0.stderr
    return held, f"exit {rank0.returncode}: {line[:300]}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- 15: the feature cache's disk tier --------------------------------------------------------------


@contextlib.contextmanager
def _flashdraft_log():
    """The flashdraft logger's records while the block runs (a list filled in place)."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("flashdraft").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("flashdraft").removeHandler(handler)


@probe("cache_disk_full_is_said", "feature cache", "15")
def _(ws):
    import torch

    from flashdraft.feed.cache import FeatureCache

    d = ws.fresh("cache")
    cache = FeatureCache(feature_size=16, dtype=torch.float32, ram_bytes=0, disk_bytes=10**6, directory=d,
                         pin_memory=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 * 4 * 16 * 4, hard))
    try:
        with _flashdraft_log() as records:
            kept = [cache.put(i, torch.randn(4, 16)) for i in range(10)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)
    said = [r.getMessage() for r in records if "could not grow" in r.getMessage()]
    cache.close()
    return kept == [True] * 4 + [False] * 6 and bool(said), (said or ["no warning"])[0][:200]


@probe("cache_disk_budget_beyond_free_space_is_said", "feature cache", "15")
def _(ws):
    import torch

    from flashdraft.feed.cache import FeatureCache

    d = ws.fresh("cache")
    with _flashdraft_log() as records:
        cache = FeatureCache(feature_size=16, dtype=torch.float32, ram_bytes=0, disk_bytes=10**18, directory=d,
                             pin_memory=False)
    said = [r.getMessage() for r in records if "free" in r.getMessage()]
    budget = cache.disk_budget
    cache.close()
    return bool(said) and budget <= shutil.disk_usage(d).free + 2**20, (said or [f"budget {budget}"])[0][:200]


@probe("cache_directory_a_file", "feature cache", "-")
def _(ws):
    f = ws.fresh("c") / "file"
    f.write_text("x")
    done = cli("train", *ws.overrides(ws.fresh("run"), pipeline__feature_cache_disk_bytes=10**6,
                                     pipeline__feature_cache_dir=f))
    return done.refused(r"pipeline.feature_cache_dir=.*cannot create the disk tier's scratch file")


# ---- 17: integers and timeouts beyond their consumers ------------------------------------------------

BIG = "1" + "0" * 30
OUT_OF_RANGE = {
    "num_anchors_31_digits": (f"objective.num_anchors={BIG}", "17"),
    "collective_timeout_1e308": ("train.collective_timeout_s=1e308", "17"),
    "startup_timeout_1e308": ("train.startup_timeout_s=1e308", "17"),
    "join_timeout_1e308": ("pipeline.join_timeout_s=1e308", "17"),
    "seed_2_64": ("train.seed=18446744073709551616", "17"),
    "max_batch_size_31_digits": (f"data.max_batch_size={BIG}", "17"),
    "row_budget_31_digits": (f"data.row_budget={BIG}", "17"),
    "token_budget_1e30": ("data.token_budget=1e30", "17"),
    "max_steps_31_digits": (f"train.max_steps={BIG}", "17"),
    "negative_31_digits": (f"train.log_every=-{BIG}", "17"),
    "selector_rank_31_digits": (f"drafter.selector_rank={BIG}", "17"),
    "feature_cache_bytes_1e30": ("pipeline.feature_cache_bytes=1e30", "17"),
}
for _name, (_override, _item) in OUT_OF_RANGE.items():
    probe(f"config_{_name}", "config values", _item)(
        lambda ws, o=_override: cli("config", o).refused(rf"config {re.escape(o.split('=')[0])}=.* is invalid"))


@probe("train_collective_timeout_1e308_two_ranks", "config values", "17")
def _(ws):
    return cli("train", *ws.overrides(ws.fresh("run"), train__collective_timeout_s="1e308")).refused(
        r"train.collective_timeout_s=.* is invalid")


# config knobs that held before (regressions would show here)
HELD_CONFIG = {
    "block_size_1": "drafter.block_size=1", "negative_lr": "optim.lr=-1", "nan_lr": "optim.lr=.nan",
    "inf_gamma": "objective.gamma=.inf", "betas_above_1": "optim.betas=[0.9, 1.5]", "bad_dtype": "target.dtype=fp8",
    "bad_device": "train.device=tpu", "resume_typo": "checkpoint.resume=nevr",
    "negative_save_every": "checkpoint.save_every=-5",
    "keep_last_0": "checkpoint.keep_last=0", "grad_accum_0": "train.grad_accum=0", "bad_metrics": "train.metrics=[csv]",
    "bool_for_int": "drafter.num_layers=true", "string_for_int": "drafter.num_layers=five",
    "list_for_float": "optim.lr=[1]", "unknown_key": "train.unknown=1", "unknown_section": "nothing.x=1",
    "negative_seed": "train.seed=-1", "empty_output_dir": "train.output_dir=", "tp_0": "target.tensor_parallel=0",
    "ep_without_tp": "target.expert_parallel=true", "capacity_0": "pipeline.capacity=0",
    "placement_typo": "pipeline.placement=split", "negative_cache": "pipeline.feature_cache_bytes=-1",
    "cache_dir_without_disk": "pipeline.feature_cache_dir=/x", "temperature_tiny": "eval.temperature=1e-40",
    "top_p_0": "eval.top_p=0", "top_k_negative": "eval.top_k=-1",
    "window_0": "drafter.sliding_window=0",
    "dpace_alpha_without_dpace": "objective.dpace_alpha=0.3", "selector_without_dflash2": "drafter.selector_rank=8",
    "max_length_1": "data.max_length=1", "token_budget_0": "data.token_budget=0", "row_budget_0": "data.row_budget=0",
    "min_supervised_negative": "data.min_supervised=-2", "on_invalid_typo": "data.on_invalid=skip",
    "join_timeout_0": "pipeline.join_timeout_s=0", "startup_timeout_negative": "train.startup_timeout_s=-1",
    "warmup_1": "optim.warmup_frac=1", "mask_negative": "drafter.mask_token_id=-1",
}
for _name, _override in HELD_CONFIG.items():
    probe(f"config_{_name}", "config values", "-")(
        lambda ws, o=_override: cli("config", *([o] if "=" in o else [])).refused(r"(is invalid|unknown key|"
                                                                                    r"is not of the form|ignored)"))


@probe("config_a_yaml_alias_bomb", "config values", "-")
def _(ws):
    f = ws.fresh("yaml") / "bomb.yaml"
    f.write_text("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(8)) + "target: {path: *i}\n")
    return cli("config", "--config", f).refused(r"(is invalid|unknown key|must be a mapping)")


# ---- 19: modes of what the commands write --------------------------------------------------------------


def _umask() -> int:
    from flashdraft.checkpoint import _umask as umask

    return umask()


@probe("quickstart_files_follow_the_umask", "quickstart", "19", isolate=True, timeout=900)
def _(ws):
    out = ws.fresh("qs") / "out"
    done = subprocess.run([sys.executable, "-m", "flashdraft.cli", "quickstart", "--smoke", "--output", str(out)],
                          capture_output=True, text=True, timeout=850,
                          env={**os.environ, "HOME": str(ws.fresh("home"))})  # no cached target: it is trained
    wanted = 0o666 & ~_umask()
    modes = {str(p.relative_to(out)): oct(p.stat().st_mode & 0o777) for p in out.rglob("*")
             if p.is_file() and p.suffix in (".safetensors", ".json", ".md")}
    bad = {k: v for k, v in modes.items() if int(v, 8) != wanted}
    return done.returncode == 0 and "target/model.safetensors" in modes and not bad, \
        f"exit {done.returncode}, off-mode files {bad}" + (done.stderr[-300:] if done.returncode else "")


@probe("checkpoints_and_exports_follow_the_umask", "quickstart", "-")
def _(ws):
    wanted = 0o666 & ~_umask()
    files = [p for p in ws.run.rglob("*.safetensors")]
    return bool(files) and all(p.stat().st_mode & 0o777 == wanted for p in files), str(len(files))


# ---- prompts and flags of eval that held before -------------------------------------------------------


def _eval_prompts(ws, data: bytes, pattern) -> tuple[bool, str]:
    f = ws.fresh("prompts") / "p.jsonl"
    f.write_bytes(data)
    return cli("eval", "--target", ws.target, "--baseline", "ngram", "--prompts", f, "--device", "cpu",
               "--block-size", "4").refused(pattern)


for _name, _data, _pattern in (
        ("empty", b"", r"no prompts"), ("not_json", b"x\n", r"expected a JSON object"),
        ("negative_id", b'{"input_ids": [1, -2]}\n', r"token id -2 outside"),
        ("oov_id", b'{"input_ids": [1, 300]}\n', r"token id 300 outside"),
        ("float_id", b'{"input_ids": [1.5]}\n', r"input_ids must be a non-empty list"),
        ("bool_id", b'{"input_ids": [true]}\n', r"input_ids must be a non-empty list"),
        ("nested", b'{"input_ids": [[1]]}\n', r"input_ids must be a non-empty list"),
        ("empty_list", b'{"input_ids": []}\n', r"input_ids must be a non-empty list"),
        ("binary", b"\xff\xfe\x00", r"cannot read the prompts"), ("no_key", b'{"ids": [1]}\n', r"expected a JSON")):
    probe(f"eval_prompts_{_name}", "eval flags and prompts", "-")(
        lambda ws, d=_data, p=_pattern: _eval_prompts(ws, d, p))

for _name, _extra, _pattern in (
        ("device_tpu", ["--device", "tpu"], r"not a device torch knows"),
        ("max_new_tokens_0", ["--max-new-tokens", "0"], r"use 1 or more"),
        ("block_size_1", ["--block-size", "1"], r"use 2 or more"),
        ("dtype_bf", ["--dtype", "bf"], r"--dtype 'bf'"),
        ("top_p_without_temperature", ["--top-p", "0.9"], r"give a --temperature above 0"),
        ("temperature_tiny", ["--temperature", "1e-40"], r"use 0 \(greedy\) or a finite temperature"),
        ("tensor_parallel_without_torchrun", ["--tensor-parallel", "2"], r"launch exactly that many ranks"),
        ("prompts_a_directory", ["--prompts", "/"], r"cannot read the prompts"),
        ("target_missing", ["--target", "/nonexistent"], r"no config.json")):
    probe(f"eval_flag_{_name}", "eval flags and prompts", "-")(
        lambda ws, e=_extra, p=_pattern: _eval_flag(ws, e, p))


def _eval_flag(ws, extra, pattern):
    base = {"--target": str(ws.target), "--prompts": str(ws.prompts)}
    pairs = dict(zip(extra[::2], extra[1::2]))
    base.update({k: v for k, v in pairs.items() if k in base})
    rest = [x for k, v in pairs.items() if k not in base for x in (k, v)]
    done = cli("eval", "--target", base["--target"], "--baseline", "ngram", "--prompts", base["--prompts"],
               *(["--block-size", "4"] if "--block-size" not in pairs else []), *rest)
    if done.code == 2 and done.exc is None and re.search(pattern, done.err):
        return True, done.brief()  # argparse's usage errors are two lines, still no traceback
    return done.refused(pattern)


@probe("eval_a_good_run", "eval flags and prompts", "-")
def _(ws):
    done = with_drafter(ws)
    ok, detail = done.ok()
    return ok and '"lossless": true' in done.out, detail


@probe("eval_a_good_sampled_run", "eval flags and prompts", "-")
def _(ws):
    return with_drafter(ws, "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20").ok()


# ---- running -------------------------------------------------------------------------------------------


def run_probe(ws: Workspace, pid: str) -> dict:
    family, item, fn, _, _ = PROBES[pid]
    begin = time.monotonic()
    try:
        held, detail = fn(ws)
    except BaseException as exc:  # the probe's own failure is a verdict too
        held, detail = False, f"probe raised {type(exc).__name__}: {str(exc)[:300]}"
    return {"id": pid, "family": family, "item": item, "held": bool(held), "detail": detail,
            "seconds": round(time.monotonic() - begin, 1)}


def run_isolated(ws: Workspace, pid: str) -> dict:
    family, item, _, _, timeout = PROBES[pid]

    def cap():  # a 12 GiB address space: an allocation of terabytes fails instead of the machine
        resource.setrlimit(resource.RLIMIT_AS, (12 * 2**30, 12 * 2**30))
        os.setsid()

    begin = time.monotonic()
    proc = subprocess.Popen([sys.executable, __file__, "--one", pid, "--workspace", str(ws.root)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=cap)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"id": pid, "family": family, "item": item, "held": False, "detail": f"timed out after {timeout:.0f} s",
                "seconds": round(time.monotonic() - begin, 1)}
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("PROBE ")), None)
    if line is None:
        return {"id": pid, "family": family, "item": item, "held": False,
                "detail": f"exit {proc.returncode}: {(err.strip().splitlines() or [''])[-1][:300]}",
                "seconds": round(time.monotonic() - begin, 1)}
    return json.loads(line[len("PROBE "):])


def table(results: list[dict], base: dict[str, dict] | None) -> str:
    """Markdown: per family, probes tried, held, fixed (held now, not on the code before), open."""
    rows = {}
    for r in results:
        row = rows.setdefault(r["family"], Counter())
        row["tried"] += 1
        row["held"] += r["held"]
        row["fixed"] += bool(base and r["held"] and r["id"] in base and not base[r["id"]]["held"])
        row["open"] += not r["held"]
    total = sum(rows.values(), Counter())
    lines = ["| family | tried | held | of them fixed | open |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {c['tried']} | {c['held']} | {c['fixed'] if base else '-'} | {c['open']} |"
              for name, c in rows.items()]
    lines.append(f"| **all** | **{total['tried']}** | **{total['held']}** | "
                 f"**{total['fixed'] if base else '-'}** | **{total['open']}** |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write each probe's verdict here")
    parser.add_argument("--workspace", help="reuse this workspace (default: a new temporary directory)")
    parser.add_argument("--only", help="a regular expression: the probes whose id matches")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--table", help="print the table of these results (with --base: of the code before)")
    parser.add_argument("--base", help="the results of the code before, for the fixed column")
    args = parser.parse_args()
    if args.table:
        base = {r["id"]: r for r in json.loads(Path(args.base).read_text())} if args.base else None
        print(table(json.loads(Path(args.table).read_text()), base))
        return 0
    ws = Workspace(Path(args.workspace or tempfile.mkdtemp(prefix="hostile-trial-")))
    if args.one:
        print("PROBE " + json.dumps(run_probe(ws, args.one)), flush=True)
        os._exit(0)  # threads a probe left blocked (a FIFO of the code before) must not hold the exit
    import flashdraft

    print(f"flashdraft from {Path(flashdraft.__file__).parent}; workspace {ws.root}", flush=True)
    ws.build()
    ids = [pid for pid in PROBES if not args.only or re.search(args.only, pid)]
    results = []
    for pid in ids:
        result = run_isolated(ws, pid) if PROBES[pid][3] else run_probe(ws, pid)
        results.append(result)
        print(f"{'HELD' if result['held'] else 'NOT HELD':8} {pid} ({result['seconds']} s): {result['detail']}",
              flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results, None))
    print(f"{sum(r['held'] for r in results)} of {len(results)} held")
    return 0


if __name__ == "__main__":
    sys.exit(main())
