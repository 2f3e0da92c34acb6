"""EngineTarget: the target's features computed by a serving engine (vLLM) in its own process.

The frozen target's forward is the costliest part of online training, and for the targets users
most want drafters for (large MoE, FP8 checkpoints, hybrid linear attention) a transformers
forward is also the weakest: no fused MoE kernels, no FP8 path, no paged batching. With
``target.backend=vllm`` the features come from a vLLM engine instead: each training batch's
samples are prefilled whole (one request each, ``max_tokens=1``), vLLM's ``extract_hidden_states``
method captures the tapped layers, and flashdraft's connector hands each request's states over
(engine_env/hidden_states_connector.py). flashdraft never imports vLLM: the engine runs in
engine_env/feature_worker.py under the engine environment's interpreter (flashdraft.vllm_env: the
one the user names in target.vllm_python or FLASHDRAFT_ENGINE_PYTHON, else flashdraft's cached CPU
build), driven over a pipe.

The hand-over: the connector writes one file per request to a tmpfs (``/dev/shm``; the pages never
reach a disk), holding the file's lock until it is complete; this process takes the lock shared,
maps the file, checks that its ``token_ids`` are the ids it sent, copies the rows once into the
batch's feature tensor (in tap order) and removes the file. Bytes moved per sample: the engine's
one write of ``T x n_aux x H`` values and this process's one read of them, plus the ids as JSON.

The tap mapping lives here alone (``vllm_aux_layer_id``): flashdraft's tap i is the output of
decoder layer i, transformers' ``hidden_states[i + 1]``; vLLM records the stream entering layer L
(``hidden + residual`` after layer L - 1) as aux layer L. A tap on the last layer is refused:
flashdraft takes it after the final norm (transformers' last ``hidden_states`` entry), vLLM
before it (``last_layer_refusal``).

``EngineTarget`` has the face of ``TargetModel`` that training uses (``features``, ``lock``,
``dtype``, ``device``, ``feature_size``, ``layer_ids``, ``num_layers``, ``hidden_size``,
``config``, ``embed``, ``lm_head``); its embedding and head are loaded heads-only from the same
directory. It does not decode (``forward_with_cache``): the tau eval needs the target in-process.
An engine's features are checked, never trusted: flashdraft.target.feature_check compares them
tap by tap with the transformers forward.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import mmap
import os
import select
import shutil
import struct
import subprocess
import tempfile
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashdraft.config import TargetConfig
from flashdraft.target.model import TargetModel, resolve_dtype

log = logging.getLogger(__name__)

ENGINE_ENV = Path(__file__).with_name("engine_env")  # the files that run under the engine's interpreter
WORKER = ENGINE_ENV / "feature_worker.py"
TMPFS = Path("/dev/shm")  # where the connector's files go when it is a writable directory
STORAGE_ENV = "FLASHDRAFT_ENGINE_STORAGE"  # overrides it (a directory; a tmpfs keeps the files off disks)


class EngineError(RuntimeError):
    """The engine cannot be started or used, or its output cannot be trusted; the message says
    why and what to do."""

    names_the_fix = True  # the CLI prints it as one line (cli.entry)


def vllm_aux_layer_id(tap: int) -> int:
    """vLLM's aux hidden-state layer id of flashdraft tap ``tap``: the one place that maps them.

    flashdraft's tap i is decoder layer i's output, transformers' ``hidden_states[i + 1]``; vLLM
    (``_maybe_add_hidden_state``) records ``hidden + residual`` after layer L - 1 as aux id L,
    which equals transformers' ``hidden_states[L]`` for every layer but the last."""
    return tap + 1


def last_layer_refusal(layer_ids, num_layers: int) -> str | None:
    """Why the engine cannot give these taps (None: it can): the last layer's tap is taken after
    the target's final norm by flashdraft and before it by vLLM."""
    if num_layers - 1 not in list(layer_ids):
        return None
    return (f"target.layer_ids {list(layer_ids)} taps the target's last layer ({num_layers - 1}), which "
            "flashdraft takes after the final norm (transformers' last hidden_states entry) and vLLM captures "
            "before it: the engine's features would not be the ones the drafter is served with elsewhere; tap "
            f"layers below {num_layers - 1}, or use target.backend=transformers")


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


@dataclass(frozen=True)
class EngineOptions:
    """How the engine is started: its interpreter and the vLLM arguments users set (the rest are
    flashdraft's: no prefix caching, eager mode, the capture and the connector)."""

    python: str = ""  # an interpreter with vLLM; "": flashdraft's cached CPU build (created on first use)
    tensor_parallel: int = 1  # vLLM tensor_parallel_size
    expert_parallel: bool = False  # vLLM enable_expert_parallel
    quantization: str = ""  # vLLM quantization ("": the checkpoint's own)
    gpu_memory_utilization: float = 0.9  # vLLM gpu_memory_utilization
    max_model_len: int = 0  # vLLM max_model_len (0: what the caller needs, see FeatureEngine)
    devices: str = ""  # the engine's CUDA_VISIBLE_DEVICES ("": the caller's device, see on_device)
    extra: dict = field(default_factory=dict)  # further vLLM LLM(...) keyword arguments
    env: dict = field(default_factory=dict)  # further environment variables of the engine's process

    @classmethod
    def of(cls, target: TargetConfig) -> EngineOptions:
        """The options a run's ``target`` config section gives."""
        return cls(target.vllm_python, target.vllm_tensor_parallel, target.vllm_expert_parallel,
                   target.vllm_quantization, target.vllm_gpu_memory_utilization, target.vllm_max_model_len,
                   target.vllm_devices)

    def on_device(self, device: torch.device) -> EngineOptions:
        """These options with the engine on ``device`` (the rank's own GPU: the memory plan counts
        the engine's share there) unless ``devices`` names others; the device's physical index
        under the caller's CUDA_VISIBLE_DEVICES. Unchanged on a CPU."""
        if self.devices or device.type != "cuda":
            return self
        index = device.index if device.index is not None else torch.cuda.current_device()
        visible = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        return dataclasses.replace(self, devices=visible[index] if index < len(visible) else str(index))

    def engine_args(self) -> dict:
        args = {"tensor_parallel_size": self.tensor_parallel, "gpu_memory_utilization": self.gpu_memory_utilization}
        if self.expert_parallel:
            args["enable_expert_parallel"] = True
        if self.quantization:
            args["quantization"] = self.quantization
        return {**args, **self.extra}


def engine_interpreter(options: EngineOptions, log_fn=log.info) -> str:
    """The interpreter the engine runs under (flashdraft.vllm_env.engine_python, the judge's too):
    target.vllm_python or FLASHDRAFT_ENGINE_PYTHON where named, else flashdraft's cached CPU build
    (created the first time); an EngineError with the reason where neither can be had (a CUDA
    torch is never replaced by the CPU build)."""
    from flashdraft.vllm_env import EngineUnavailable, engine_python

    try:
        return str(engine_python(options.python or None, named_by="target.vllm_python", log=log_fn))
    except EngineUnavailable as exc:
        raise EngineError(f"target.backend=vllm cannot start its engine: {exc}; or use "
                          "target.backend=transformers") from None


def _storage_root() -> Path:
    named = os.environ.get(STORAGE_ENV)
    if named:
        return Path(named)
    return TMPFS if TMPFS.is_dir() and os.access(TMPFS, os.W_OK) else Path(tempfile.gettempdir())


# safetensors' dtype names (the connector writes the engine's dtype and int64 token ids)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}


def _tensors(buffer: mmap.mmap) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, as views of its mapping (no copy)."""
    (size,) = struct.unpack("<Q", buffer[:8])
    header = json.loads(buffer[8:8 + size])
    found = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES[meta["dtype"]]
        begin, end = meta["data_offsets"]
        count = (end - begin) // dtype.itemsize
        found[name] = torch.frombuffer(buffer, dtype=dtype, count=count, offset=8 + size + begin).view(meta["shape"])
    return found


def read_capture(path: str, sent: list[int], rows: torch.Tensor, out: torch.Tensor) -> int:
    """Copy one request's captured states into ``out`` and remove its file; the bytes read.

    ``out``: [T, K*H] contiguous rows of the batch's feature tensor (T = len(sent)); ``rows``: the
    K indices into the file's aux dimension, in tap order. Waits on the lock the connector holds
    until the file is complete; refuses a file whose ``token_ids`` are not ``sent`` (another
    request's states, or a truncated prompt)."""
    lock = path + ".lock"
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_SH)  # sleeps while the connector writes
        with open(path, "rb") as f:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable views, no copy
    try:
        nbytes = _copy_rows(buffer, path, sent, rows, out)
    finally:
        buffer.close()  # after _copy_rows: its views of the mapping are gone
        os.unlink(path)
        os.unlink(lock)
    return nbytes


def _copy_rows(buffer: mmap.mmap, path: str, sent: list[int], rows: torch.Tensor, out: torch.Tensor) -> int:
    tensors = _tensors(buffer)
    states, tokens = tensors["hidden_states"], tensors["token_ids"]  # [T, n_aux, H], [T]
    if tokens.tolist() != sent:
        raise EngineError(f"the engine's capture {path} holds {tokens.numel()} tokens that are not the "
                          f"{len(sent)} sent (first difference at position "
                          f"{next((i for i, (a, b) in enumerate(zip(tokens.tolist(), sent)) if a != b), len(sent))}): "
                          "its features cannot be trusted; report it with the engine log")
    torch.index_select(states, 1, rows, out=out.view(len(sent), len(rows), states.shape[2]))
    return states.numel() * states.element_size()


def _lengths(attention_mask: torch.Tensor | None, batch: int, seq: int) -> list[int]:
    """Each row's length; the mask must be right padding (ones, then zeros), as pad_batch makes it."""
    if attention_mask is None:
        return [seq] * batch
    mask = attention_mask.to("cpu", torch.bool)
    lengths = mask.sum(1)
    if not torch.equal(mask, torch.arange(seq) < lengths[:, None]) or int(lengths.min()) < 1:
        raise ValueError("the engine target takes right-padded batches of non-empty samples (attention_mask ones, "
                         "then zeros), as data.collate.pad_batch makes them")
    return lengths.tolist()


@dataclass
class EngineStats:
    """What the engine did for this process: requests, tokens, seconds waiting on its prefills,
    seconds reading the captures, and the bytes moved each way."""

    requests: int = 0
    tokens: int = 0
    prefill_s: float = 0.0
    read_s: float = 0.0
    feature_bytes: int = 0  # read from the captures (written once by the engine, read once here)
    id_bytes: int = 0  # the requests' JSON sent to the engine


class FeatureEngine:
    """A vLLM engine in its own process (engine_env/feature_worker.py), capturing the aux layers
    ``aux_layer_ids`` (vLLM's ids, ascending) of the Hugging Face model in ``model_dir``.

    Starts it and waits until it is ready (``start_timeout_s``); ``prefill(samples)`` returns one
    capture path per sample (read them with ``read_capture``); ``close()`` ends it (also when
    this object is collected or the interpreter exits). The engine's output goes to ``log_path``.
    Not thread-safe on its own: EngineTarget serialises its calls."""

    def __init__(self, model_dir: str | os.PathLike, aux_layer_ids: list[int], *, dtype: str, max_model_len: int,
                 options: EngineOptions | None = None, seed: int = 0, start_timeout_s: float = 1800,
                 request_timeout_s: float = 1800):
        self.aux_layer_ids = sorted(aux_layer_ids)  # vLLM captures in layer order, whatever the order asked
        self.request_timeout_s = request_timeout_s
        self.stats = EngineStats()
        options = options or EngineOptions()
        python = engine_interpreter(options)
        self.storage = Path(tempfile.mkdtemp(prefix="flashdraft-engine-", dir=_storage_root()))
        handle, log_path = tempfile.mkstemp(prefix="flashdraft-vllm-", suffix=".log")
        os.close(handle)
        self.log_path = Path(log_path)
        start = {"model": str(Path(model_dir).resolve()), "aux_layer_ids": self.aux_layer_ids,
                 "storage": str(self.storage), "dtype": dtype, "seed": seed,
                 "max_model_len": options.max_model_len or max_model_len, "engine_args": options.engine_args()}
        # The engine core in the worker's process (the worker steps it to hand files over); its
        # own processes (tensor parallel) find the connector on PYTHONPATH; vLLM's CPU build caps
        # its KV cache at 1 GiB unless told otherwise (the judge's setting).
        env = {**os.environ, "PYTHONPATH": str(ENGINE_ENV), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **options.env}
        if options.devices:
            env["CUDA_VISIBLE_DEVICES"] = options.devices
        begin = time.perf_counter()
        with open(self.log_path, "w") as engine_log:
            # its own session: a Ctrl-C meant for the trainer (a graceful stop) does not kill the engine
            self.process = subprocess.Popen([python, str(WORKER), json.dumps(start)], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, stderr=engine_log, env=env, text=True,
                                            cwd=self.storage, start_new_session=True)
        self._finalizer = weakref.finalize(self, _stop, self.process, self.storage, self.log_path)
        try:
            self.ready = self._reply(start_timeout_s, "starting")["ready"]
        except BaseException:
            self.close()
            raise
        self.start_s = time.perf_counter() - begin
        log.info("vLLM %s engine ready in %.0f s (aux layers %s, %s; log %s, captures in %s)",
                 self.ready["vllm_version"], self.start_s, self.aux_layer_ids, self.ready["dtype"], self.log_path,
                 self.storage)

    def prefill(self, samples: list[list[int]]) -> list[str]:
        """One prefill request per sample (token ids); their capture paths, in order. Refused
        before it is sent when the capture directory cannot hold the batch's captures (a
        container's /dev/shm is often 64 MB)."""
        need = sum(map(len, samples)) * len(self.aux_layer_ids) * self.ready["hidden_size"] * \
            getattr(torch, self.ready["dtype"]).itemsize
        free = shutil.disk_usage(self.storage).free
        if need > free:
            raise EngineError(f"the engine's captures of this batch take {need / 2**20:.1f} MiB, and {self.storage} "
                              f"has {free / 2**20:.1f} MiB free: point {STORAGE_ENV} at a directory with room (a tmpfs "
                              "keeps them off the disk), or lower data.token_budget")
        request = json.dumps({"prefill": samples}) + "\n"
        begin = time.perf_counter()
        try:
            self.process.stdin.write(request)
            self.process.stdin.flush()
        except (BrokenPipeError, ValueError):  # ValueError: closed
            raise EngineError(self._ended("while taking a request")) from None
        paths = self._reply(self.request_timeout_s, f"prefilling {len(samples)} samples")["paths"]
        self.stats.prefill_s += time.perf_counter() - begin
        self.stats.requests += len(samples)
        self.stats.tokens += sum(map(len, samples))
        self.stats.id_bytes += len(request)
        return paths

    def _reply(self, timeout_s: float, doing: str) -> dict:
        readable, _, _ = select.select([self.process.stdout], [], [], timeout_s)
        line = self.process.stdout.readline() if readable else None
        if line is None:
            self.close()
            raise EngineError(f"the vLLM engine did not answer in {timeout_s:.0f} s while {doing}; its log: "
                              f"{self.log_path}")
        if not line:
            raise EngineError(self._ended(f"while {doing}"))
        message = json.loads(line)
        if "error" in message:
            raise EngineError(f"the vLLM engine failed while {doing}: {message['error']} (log: {self.log_path})")
        return message

    def _ended(self, when: str) -> str:
        try:
            code = self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # its output closed, but it lingers: it is of no use any more
            self.close()
            code = self.process.returncode
        tail = "\n".join(self.log_path.read_text(errors="replace").strip().splitlines()[-12:])
        return f"the vLLM engine exited with status {code} {when} (log: {self.log_path}):\n{tail}"

    def close(self) -> None:
        """End the engine (its input closes, it shuts down) and remove its capture directory (and
        its log, when it ended cleanly)."""
        self._finalizer()


def _stop(process: subprocess.Popen, storage: Path, log_path: Path) -> None:
    """End the worker: its input closes (it shuts vLLM down and exits); killed if it lingers. Its
    log is kept unless it ended cleanly."""
    try:
        process.stdin.close()
    except OSError:
        pass
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    shutil.rmtree(storage, ignore_errors=True)
    if process.returncode == 0:
        log_path.unlink(missing_ok=True)


class EngineTarget:
    """The target whose features come from a vLLM engine (module doc), with TargetModel's face
    for training. ``heads``: the target loaded heads-only (its config, taps, embedding and head);
    ``engine``: a FeatureEngine capturing at least every tap's aux layer (vllm_aux_layer_id)."""

    backend = "vllm"
    sharded = False  # the engine's own parallelism is not flashdraft's (target.tensor_parallel)

    def __init__(self, heads: TargetModel, engine: FeatureEngine):
        self.heads, self.engine = heads, engine
        self.config, self.layer_ids, self.num_layers = heads.config, heads.layer_ids, heads.num_layers
        self.hidden_size, self.embed, self.lm_head = heads.hidden_size, heads.embed, heads.lm_head
        reason = last_layer_refusal(self.layer_ids, self.num_layers)
        if reason:
            raise ValueError(reason)
        if engine.ready["hidden_size"] != self.hidden_size or engine.ready["num_layers"] != self.num_layers:
            raise EngineError(f"the engine's model has {engine.ready['num_layers']} layers of size "
                              f"{engine.ready['hidden_size']}, the target {self.num_layers} of {self.hidden_size}: "
                              "start both from the same model directory")
        if engine.ready["dtype"] != str(self.dtype).removeprefix("torch."):
            raise EngineError(f"the engine computes in {engine.ready['dtype']}, the target's features are "
                              f"{self.dtype}: start the engine with the run's dtype")
        self.aux_layer_ids = [vllm_aux_layer_id(i) for i in self.layer_ids]  # vLLM's id of each tap, tap order
        missing = sorted(set(self.aux_layer_ids) - set(engine.aux_layer_ids))
        if missing:
            raise EngineError(f"the engine captures aux layers {engine.aux_layer_ids}, the taps {self.layer_ids} need "
                              f"{self.aux_layer_ids} ({missing} missing): start it for these taps")
        self._rows = torch.tensor([engine.aux_layer_ids.index(a) for a in self.aux_layer_ids])  # the file's index
        self.lock = threading.Lock()  # held by the feed around every features call (feed.stages)
        self._channel = threading.Lock()  # one request at a time on the engine's pipe, whoever calls

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, target_layer_ids: list[int] | None = None,
                        num_taps: int = 5, device: str | torch.device = "cpu", dtype: str = "auto",
                        max_model_len: int, options: EngineOptions | None = None,
                        trust_remote_code: bool = False) -> EngineTarget:
        """The heads loaded from ``path`` (TargetModel.from_pretrained(heads_only=True)), the taps
        checked (a last-layer tap refused before anything starts), then the engine started on the
        same directory in the same dtype, capturing the taps' aux layers. ``max_model_len``: the
        longest sample plus one (the engine's one generated token), at most the model's positions,
        unless ``options`` sets it."""
        heads = TargetModel.from_pretrained(path, target_layer_ids=target_layer_ids, num_taps=num_taps, device=device,
                                            dtype=dtype, trust_remote_code=trust_remote_code, heads_only=True)
        reason = last_layer_refusal(heads.layer_ids, heads.num_layers)
        if reason:
            raise ValueError(reason)
        # vLLM refuses a max_model_len beyond the model's positions (samples are held to them: train.checks)
        text = heads.config.get_text_config() if hasattr(heads.config, "get_text_config") else heads.config
        positions = getattr(text, "max_position_embeddings", None) or max_model_len
        engine = FeatureEngine(path, [vllm_aux_layer_id(i) for i in heads.layer_ids],
                               dtype=str(resolve_dtype(dtype, torch.device(device))).removeprefix("torch."),
                               max_model_len=min(max_model_len, positions),
                               options=(options or EngineOptions()).on_device(heads.device))
        try:
            return cls(heads, engine)
        except BaseException:
            engine.close()
            raise

    @property
    def device(self) -> torch.device:
        return self.heads.device

    @property
    def dtype(self) -> torch.dtype:
        return self.heads.dtype

    @property
    def feature_size(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Packed taps [B, S, K*H] in tap order and the target's dtype, on its device; zeros at
        padded positions. ``input_ids`` [B, S]; ``attention_mask`` [B, S], right padding. One
        prefill request per sample; syncs (the ids go to the host, the features come back)."""
        batch, seq = input_ids.shape
        lengths = _lengths(attention_mask, batch, seq)
        ids = input_ids.cpu()
        samples = [ids[b, :n].tolist() for b, n in enumerate(lengths)]
        out = torch.empty(batch, seq, self.feature_size, dtype=self.dtype)
        with self._channel:
            paths = self.engine.prefill(samples)
            begin = time.perf_counter()
            for b, (path, sent) in enumerate(zip(paths, samples)):
                self.engine.stats.feature_bytes += read_capture(path, sent, self._rows, out[b, :len(sent)])
                out[b, len(sent):] = 0
            self.engine.stats.read_s += time.perf_counter() - begin
        return out.to(self.device)

    def forward_with_cache(self, *args, **kwargs):
        raise EngineError("the vLLM target computes training features only; decoding (the tau eval, flashdraft eval) "
                          "runs the target in-process: set eval.num_prompts=0 and judge the export with "
                          "`flashdraft eval --engine vllm`")

    new_cache = forward_with_cache

    def close(self) -> None:
        """End the engine (also done when this object is collected or the interpreter exits)."""
        self.engine.close()

    def __enter__(self) -> EngineTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
