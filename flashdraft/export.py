"""`flashdraft export`: the serving-format drafter of any complete training checkpoint.

    flashdraft export runs/q3-8b --out exports/q3-8b                  # the newest complete checkpoint
    flashdraft export runs/q3-8b --out exports/q3-8b-3000 --step 3000 --dtype float32

The source is a run directory (``train.output_dir``), its ``checkpoints/`` directory, or one
checkpoint (``step_XXXXXXXX``). The checkpoint is verified first (every file against its
manifest's sha256); the drafter's fp32 master weights are cast to ``--dtype`` and written
with the checkpoint's serving config into a temporary directory beside ``--out``, loaded back
and checked (weights and the outputs of a forward equal the checkpoint's weights cast the same
way), then renamed onto ``--out``: a crash leaves any earlier export there whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path

import torch

from flashdraft.checkpoint import MANIFEST, CheckpointError, CheckpointManager, follow_umask, step_dir_name
from flashdraft.config import upgrade_saved
from flashdraft.judge.engine import ENGINES
from flashdraft.outputs import check_output
from flashdraft.target.engine import warn_last_layer

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def find_checkpoint(path: str | os.PathLike, step: int | None = None) -> Path:
    """The checkpoint directory ``path`` names: itself when it is one, else the newest complete
    checkpoint (or the one of ``step``) of the run or checkpoints directory it is."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}; give a run "
                         "directory (train.output_dir), its checkpoints/ or one checkpoint step_XXXXXXXX")
    if (path / MANIFEST).is_file() or path.name.startswith("step_"):
        if step is not None and _manifest_step(path) != step:
            raise ValueError(f"{path} is the checkpoint of step {_manifest_step(path)}, not --step {step}; drop "
                             "--step or give the run directory")
        return path
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    manager = CheckpointManager(root)
    found = manager.checkpoints()
    if not found:
        raise ValueError(f"{path}: no checkpoints (no step_XXXXXXXX directories in {root}); give a run directory "
                         "(train.output_dir) whose run saved one")
    if step is not None:
        wanted = root / step_dir_name(step)
        if not wanted.is_dir():
            steps = ", ".join(str(int(p.name.removeprefix("step_"))) for p in found)
            raise ValueError(f"{root} has no checkpoint of step {step}; it has steps {steps}")
        return wanted
    newest = manager.latest_complete()
    if newest is None:
        raise CheckpointError(f"{root}: none of its {len(found)} checkpoints is complete (each failed its manifest "
                              "check; see the warnings above)")
    return newest


def _manifest_step(path: Path) -> int | None:
    try:
        return int(json.loads((path / MANIFEST).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def export_checkpoint(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str = "bfloat16") -> dict:
    """Write the serving-format drafter of ``checkpoint`` to ``out`` (see module doc); returns
    what it exported: step, target directory, block size, dtype, path."""
    from flashdraft.drafter import DFlashDrafter

    checkpoint, out = Path(checkpoint), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype} is not supported: use one of {', '.join(DTYPES)}")
    _check_out(out, checkpoint)
    with _snapshot(checkpoint, out) as snap:  # a training run may prune the checkpoint meanwhile
        loaded = CheckpointManager(snap.parent).load(snap)  # verified first: raises naming a damaged file
        if "drafter" not in loaded.parts or not (snap / "export" / "config.json").is_file():
            raise CheckpointError(f"{checkpoint}: not a flashdraft training checkpoint (no drafter weights or "
                                  "serving config in it)")
        config = json.loads((snap / "export" / "config.json").read_text())
    warn_last_layer(config["dflash_config"]["target_layer_ids"], int(config.get("num_target_layers") or 0))
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(loaded.parts["drafter"])
    tmp = None
    try:  # a new directory of its own (mkdtemp): never a predictable name a link could be planted at
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        follow_umask(tmp)  # mkdtemp makes it 0700: the export, once renamed, is read by serving processes
        drafter.save_pretrained(tmp, dtype=DTYPES[dtype])
        verify_export(tmp, drafter, DTYPES[dtype])
        _replace(tmp, out)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write the export there ({exc.strerror or exc}); choose a writable "
                         "directory with room for it") from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    target = _target_dir(loaded.config or {}, checkpoint)
    return {"step": loaded.step, "target": target, "block_size": drafter.block_size, "dtype": dtype, "path": out,
            "v2_runner": len({m.window is None for m in drafter.layer_masks}) > 1 or drafter.convolved}


class CheckpointGone(CheckpointError):
    """The checkpoint was removed (pruned by its training run) before it could be snapshotted."""


@contextlib.contextmanager
def _snapshot(checkpoint: Path, out: Path):
    """A private copy of ``checkpoint`` to read, so that a training run pruning it meanwhile (it
    renames the directory away, then deletes it) cannot pull files from under the reader: every
    file hard-linked (copied across file systems) into a temporary directory beside ``out``, which
    is removed afterwards. Raises CheckpointGone when the checkpoint vanished first."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        snap = Path(tempfile.mkdtemp(prefix=f".{checkpoint.name}.snapshot-", dir=out.parent)) / checkpoint.name
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write the export there ({exc.strerror or exc}); choose a writable "
                         "directory with room for it") from None
    try:
        try:
            shutil.copytree(checkpoint, snap, copy_function=_link_or_copy)
        except (FileNotFoundError, shutil.Error) as exc:
            if not checkpoint.is_dir():
                raise CheckpointGone(f"{checkpoint}: removed while it was read (pruned by its training run)") from None
            raise CheckpointError(f"{checkpoint}: cannot read it ({exc})") from None
        yield snap
    finally:
        shutil.rmtree(snap.parent, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed: a copy
        shutil.copy2(src, dst)


def _target_dir(config: dict, checkpoint: Path) -> str:
    """The run's target.path as an absolute path (an engine reads a relative one as a hub model id)."""
    return _run_path(config.get("target", {}).get("path") or "TARGET", config, checkpoint)


def _run_path(value: str, config: dict, checkpoint: Path) -> str:
    """A path of the run's config as an absolute path. A relative one is relative to where
    training ran: the run directory (train.output_dir, the checkpoint's grandparent) with its own
    relative path taken off; else to here."""
    if Path(value).is_absolute():
        return value
    run, output = checkpoint.resolve().parent.parent, Path(config.get("train", {}).get("output_dir") or "")
    if not output.is_absolute() and output.parts and run.parts[-len(output.parts):] == output.parts:
        started_in = Path(*run.parts[:-len(output.parts)])
        if (started_in / value).exists():
            return str(started_in / value)
    return str(Path(value).resolve())


def verify_export(path: Path, drafter, dtype: torch.dtype) -> None:
    """Load the export in ``path`` back and compare it with ``drafter``'s weights cast to
    ``dtype``: every tensor, and a forward on fixed random inputs, bit for bit."""
    from flashdraft.drafter import DFlashDrafter

    expected = DFlashDrafter(drafter.config)
    expected.load_state_dict({k: v.to(dtype).float() for k, v in drafter.state_dict().items()})
    loaded = DFlashDrafter.from_pretrained(path)  # as a user loads it, in fp32
    for name, value in expected.state_dict().items():
        if not torch.equal(loaded.state_dict()[name], value):
            raise RuntimeError(f"{path}: the exported {name} differs from the checkpoint's; the export is not written")
    g = torch.Generator().manual_seed(0)
    hidden, bs, taps = drafter.config["hidden_size"], drafter.block_size, len(drafter.target_layer_ids)
    features = torch.randn(1, 3 * bs, taps * hidden, generator=g)
    blocks = torch.randn(1, 2, bs, hidden, generator=g)
    anchors, valid = torch.tensor([[bs, 2 * bs - 1]]), torch.tensor([[True, True]])
    with torch.no_grad():
        outputs = [m.eval()(features, blocks, anchors, valid, attention="dense") for m in (expected, loaded)]
    if not torch.equal(*outputs):
        raise RuntimeError(f"{path}: the exported drafter's outputs differ from the checkpoint's; the export is "
                           "not written")


def _check_out(out: Path, checkpoint: Path) -> None:
    """``--out`` may be new, empty, or an earlier drafter export (replaced); never inside any run's
    checkpoints (writing there would damage one, or plant a fake step directory): the rule of
    flashdraft.outputs, shared with ``prepare --out`` and ``eval --output``."""
    check_output(out, flag="--out", inputs=[checkpoint], kind="a drafter export", is_kind=_is_export)


def _is_export(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return any("DFlash" in arch for arch in config.get("architectures", []))


def _replace(tmp: Path, out: Path) -> None:
    """Put the export in ``tmp`` at ``out``: renamed there whole when ``out`` is new; into an
    existing directory (an earlier export, perhaps a cloned model repository with its .git/,
    README.md, ...) each of the export's own files is renamed onto its name, and nothing else
    there is touched (a crash between two renames leaves each file whole: the earlier export's or
    the new one's)."""
    if not out.exists():
        os.rename(tmp, out)
        return
    for name in sorted(p.name for p in tmp.iterdir()):  # config.json before model.safetensors
        os.replace(tmp / name, out / name)


def serving_commands(target: str, path, block_size: int, v2_runner: bool = False) -> list[str]:
    """SGLang and vLLM command lines for the export, quoted for a POSIX shell. vLLM needs the
    method spelled out: it detects DFlash from the draft path only when the path contains "dflash";
    a drafter mixing sliding-window and full layers, and DFlash2's selector, need its V2 model
    runner (``v2_runner``). DFlash2's conv spans 1 + num_speculative_tokens slots in vLLM, so
    block_size - 1 is the only value that serves what was trained."""
    spec = json.dumps({"method": "dflash", "model": str(path), "num_speculative_tokens": block_size - 1})
    target, draft = shlex.quote(str(target)), shlex.quote(str(path))
    runner = "VLLM_USE_V2_MODEL_RUNNER=1 " if v2_runner else ""
    return [f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {draft} --speculative-num-draft-tokens {block_size}",
            f"{runner}vllm serve {target} --speculative-config {shlex.quote(spec)}"]


# ---- `flashdraft export` --------------------------------------------------------------------


def add_arguments(parser) -> None:
    parser.add_argument("source", help="a run directory (train.output_dir), its checkpoints/, or one checkpoint")
    parser.add_argument("--out", required=True, help="directory to write the serving-format drafter to")
    parser.add_argument("--step", type=int, help="export this step's checkpoint (default: the newest complete one)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="weights' dtype (default bf16)")
    parser.add_argument("--verify-engine", choices=ENGINES,
                        help="then decode prompts with the export in this serving engine and compare with flashdraft's "
                             "own decode (flashdraft eval --engine; CPU: vLLM's CPU build in a cached environment)")
    parser.add_argument("--prompts", help="with --verify-engine: JSONL prompts (default: the run's eval.prompts_path)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="with --verify-engine: tokens per prompt")
    parser.add_argument("--engine-python", metavar="PATH",
                        help="with --verify-engine: the python of an environment where vLLM is installed (default: "
                             "$FLASHDRAFT_ENGINE_PYTHON, else flashdraft's CPU build); flashdraft installs nothing "
                             "there")


def run(args) -> int:
    if not args.verify_engine and (args.prompts or args.max_new_tokens != 64 or args.engine_python):  # the default
        raise ValueError("--prompts / --max-new-tokens / --engine-python set how --verify-engine decodes: add "
                         "--verify-engine vllm, or drop them")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens}: use 1 or more")
    checkpoint = find_checkpoint(args.source, args.step)
    if args.verify_engine:  # a missing prompts file is found before the export, not after
        from flashdraft.vllm_env import why_unavailable

        args.prompts = args.prompts or _run_eval_prompts(checkpoint)
        if not args.prompts:
            raise ValueError("--verify-engine: give --prompts FILE (JSONL of input_ids); the run has no "
                             "eval.prompts_path to use")
        prompts = _engine_prompts(checkpoint, args.prompts, args.max_new_tokens)
        reason = why_unavailable(args.engine_python)
        if reason:
            raise ValueError(f"--verify-engine {args.verify_engine}: cannot run here: {reason}")
    for attempt in range(3):  # a checkpoint pruned by a run still training: the next newest one
        try:
            done = export_checkpoint(checkpoint, args.out, args.dtype)
            break
        except CheckpointGone:
            if args.step is not None or attempt == 2:
                raise
            print(f"{checkpoint} was pruned by its training run while it was read; exporting the newest one now")
            checkpoint = find_checkpoint(args.source, args.step)
    print(f"exported step {done['step']} of {checkpoint} ({done['dtype']}) to {done['path']}: loaded back, its "
          "weights and outputs equal the checkpoint's")
    print("serve it with the target it was trained on:")
    # absolute paths, always: an engine reads a relative one (qs/target) as a hub model id
    target = Path(done["target"])
    if not target.is_dir():
        print(f"note: the run's target.path {done['target']} is not a directory here ({target}); give the "
              "engines the target's absolute path")
    for line in serving_commands(target, Path(done["path"]).resolve(), done["block_size"], done["v2_runner"]):
        print(f"  {line}")
    if args.verify_engine:
        return _verify_engine(target, done["path"], prompts, args.max_new_tokens, args.engine_python)
    return 0


def _engine_prompts(checkpoint: Path, path: str, max_new_tokens: int) -> list[list[int]]:
    """--verify-engine's prompts, read and checked as `flashdraft eval` checks them (token ids in
    the run's target's vocabulary; a prompt, its new tokens and a block within its positions),
    before the export is written rather than as a traceback after it."""
    from transformers import AutoConfig

    from flashdraft.evaluate import check_prompts_fit, read_prompts
    from flashdraft.target.model import _model_dir

    prompts = read_prompts(path)
    try:
        run_config = upgrade_saved(json.loads((checkpoint / "config.json").read_text()))
        export = json.loads((checkpoint / "export" / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{checkpoint}: not a flashdraft training checkpoint ({exc})") from None
    target = _model_dir(_target_dir(run_config, checkpoint))
    block_size = int((export.get("dflash_config") or {}).get("block_size") or export.get("block_size") or 0)
    check_prompts_fit(prompts, AutoConfig.from_pretrained(target), path, max_new_tokens=max_new_tokens,
                      block_size=block_size)
    return prompts


def _run_eval_prompts(checkpoint: Path) -> str | None:
    """The run's eval.prompts_path (absolute: a relative one is the run's), from the run config
    the checkpoint holds (None if none)."""
    try:
        config = upgrade_saved(json.loads((checkpoint / "config.json").read_text()))
        prompts = config.get("eval", {}).get("prompts_path")
    except (OSError, ValueError, AttributeError):
        return None
    return _run_path(prompts, config, checkpoint) if prompts else None


def _verify_engine(target, path, prompts: list[list[int]], max_new_tokens: int, python=None) -> int:
    """The engine check of the export just written (flashdraft.judge.engine.engine_check), greedy,
    vLLM under ``python`` (--engine-python; None: the default)."""
    from transformers import AutoConfig

    from flashdraft.evaluate import eos_ids_of
    from flashdraft.judge.engine import engine_check, format_check
    from flashdraft.vllm_env import EngineUnavailable

    try:
        report = engine_check(target, path, prompts, max_new_tokens=max_new_tokens,
                              eos_ids=eos_ids_of(target, AutoConfig.from_pretrained(target)), python=python)
    except EngineUnavailable as exc:  # the export stands; the check says why it could not run
        report = {"engine_error": str(exc)}
    print(format_check(report))
    return 0 if report.get("lossless") and report.get("tau_agrees") else 1
