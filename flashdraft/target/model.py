"""TargetModel: the frozen Hugging Face target and the taps the drafter is conditioned on.

Layer-id convention (DFLASH.md): tap ``i`` is the OUTPUT of decoder layer ``i``, i.e.
``hidden_states[i + 1]`` of a Hugging Face ``output_hidden_states`` forward. Hugging Face
returns the LAST entry after the final norm, so a tap on the last layer is normed too; every
tap therefore equals ``hidden_states[i + 1]`` exactly.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import threading
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from flashdraft.config import check_model_sizes

log = logging.getLogger(__name__)


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """DFlash's default spread: [L // 2] for one tap, else round(1 + i * (L - 4) / (n - 1)).

    Qwen3-8B (L = 36, n = 5) -> [1, 9, 17, 25, 33]. Shallow targets make the formula repeat ids
    (L = 4, n = 3 -> [1, 1, 1]); duplicate taps carry no information, so that is refused.
    """
    if num_taps == 1:
        return [num_target_layers // 2]
    ids = [round(1 + i * (num_target_layers - 4) / (num_taps - 1)) for i in range(num_taps)]
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= num_target_layers:
        raise ValueError(
            f"the default spread of {num_taps} taps over a {num_target_layers}-layer target gives {ids}, "
            f"which repeats or leaves the model; set target.layer_ids explicitly "
            f"(distinct ids in [0, {num_target_layers - 1}]) or lower target.num_taps"
        )
    return ids


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' is bf16 on GPU and fp32 on CPU (bf16 matmuls are ~100x slower on CPUs without AMX)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


class _StopForward(Exception):
    """Raised by the hook on the last tapped layer: nothing after it runs."""


def _layer_output(output) -> torch.Tensor:
    return output if torch.is_tensor(output) else output[0]


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: not a decoder-only causal LM flashdraft can tap (no decoder layers "
                         "at model.layers); give a causal LM target such as Qwen3 or Llama")
    return layers


def _final_norm(model: nn.Module) -> nn.Module:
    base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return base.norm


def _model_dir(path: str | os.PathLike, trust_remote_code: bool = False) -> Path:
    """``path`` as a target directory whose config.json passed ``read_model_config``: every
    reader of a target (train, eval, plan) goes through here before anything is built."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path}: no config.json; target.path must be a local Hugging Face model directory "
            "(download it first, e.g. `huggingface-cli download ORG/NAME --local-dir DIR`)"
        )
    read_model_config(path, trust_remote_code)
    return path


def read_model_config(path: Path, trust_remote_code: bool = False) -> dict:
    """The target directory's config.json as a dict, refused in one line naming the file (and
    the field) when it is not a JSON object, when a size is out of bounds (config.check_model_sizes:
    before transformers builds anything from it), or when it names Python code of its own
    (``auto_map``) and ``trust_remote_code`` is off (transformers' refusal shows a hub URL made
    of the local path)."""
    file = path / "config.json"
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else getattr(exc, "strerror", None) or exc
        raise ValueError(f"{file}: not a readable JSON model config ({why}); give a Hugging Face model directory "
                         "whose config.json is the model's own") from None
    if not isinstance(values, dict):
        raise ValueError(f"{file}: a model config is a JSON object of fields, not {type(values).__name__}; give a "
                         "Hugging Face model directory whose config.json is the model's own")
    check_model_sizes(values, str(file))
    if values.get("auto_map") and not trust_remote_code:
        raise ValueError(f"{file}: this target's architecture is Python code in its own directory (auto_map "
                         f"{_abridged(values['auto_map'])}), which runs only with target.trust_remote_code=true: "
                         "read that code first, or use a model transformers implements")
    return values


def _abridged(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_weights(path: Path) -> None:
    """Every safetensors file the target directory's weights are in (model.safetensors, or the
    shards model.safetensors.index.json names) has a readable header that fits the file: a
    truncated or corrupt file is one line naming it, before any weight loads (transformers
    raises a bare SafetensorError mid-load)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc}); download the model again") from None
    else:
        files = ["model.safetensors"] if (path / "model.safetensors").is_file() else []
    for name in files:
        try:
            with safe_open(path / name, framework="pt") as f:
                f.keys()
        except Exception as exc:  # safetensors' own errors name no file
            raise ValueError(f"{path / name}: cannot read the target's weights ({str(exc).splitlines()[0][:200]}); "
                             "the file is damaged or incomplete: download the model again") from None


def check_layer_ids(ids: list[int], num_layers: int) -> None:
    """Refuse taps that are not distinct layers of a ``num_layers``-layer target (train and plan)."""
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad or len(set(ids)) != len(ids):
        raise ValueError(
            f"target.layer_ids={ids} is invalid for this {num_layers}-layer target: "
            f"use distinct ids in [0, {num_layers - 1}] (layer i is the output of decoder layer i)"
        )


def _heads_only_model(path: Path, device: torch.device, dtype: torch.dtype,
                      trust_remote_code: bool) -> nn.Module | None:
    """The causal LM of ``path`` with every decoder layer on the meta device (no memory) and only
    its input embedding and LM head loaded, read from the files Hugging Face itself loads
    (``model.safetensors``, or the shards ``model.safetensors.index.json`` names); tied heads
    share the embedding. None where that cannot be done exactly: no safetensors checkpoint, or
    tensor names that differ from the module names (transformers may rename while loading)."""
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    names = {module: name for name, module in model.named_modules()}
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    wanted = {f"{names[embed]}.weight": embed}
    if head is not None and not tied:
        wanted[f"{names[head]}.weight"] = head
    if (path / "model.safetensors.index.json").is_file():
        weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
        files = {key: path / weight_map[key] for key in wanted if key in weight_map}
    elif (path / "model.safetensors").is_file():
        with safe_open(path / "model.safetensors", framework="pt") as f:
            files = {key: path / "model.safetensors" for key in wanted.keys() & set(f.keys())}
    else:
        return None
    if files.keys() != wanted.keys():
        log.warning("%s: tensors %s not found under these names; loading the whole target instead",
                    path, sorted(wanted.keys() - files.keys()))
        return None
    for key, module in wanted.items():
        with safe_open(files[key], framework="pt", device=str(device)) as f:
            module.load_state_dict({"weight": f.get_tensor(key).to(embed.weight.dtype)}, assign=True)
    if tied:
        model.tie_weights()
    return model


def _load_sharded(path: Path, device: torch.device, dtype: torch.dtype, attn_implementation: str,
                  trust_remote_code: bool, tensor_parallel: int, expert_parallel: bool) -> nn.Module:
    """The target of ``path`` sharded over this rank's target group by transformers' own
    tensor- (and expert-) parallel plan of the architecture: each rank loads only its shards
    (DTensors over distributed.target_mesh()). transformers builds its mesh over the whole world;
    here the world holds several target groups side by side (data x tensor), so the model class
    is handed flashdraft's mesh instead (the one hook from_pretrained calls for it)."""
    try:
        from transformers.distributed import DistributedConfig
        from transformers.distributed.utils import TransformersDeviceMesh
    except ImportError:
        raise ValueError("target.tensor_parallel > 1 needs transformers' distributed loading (DistributedConfig with "
                         "expert parallelism, 5.24 or newer): pip install -U transformers") from None

    from flashdraft import distributed

    meshes = distributed.target_mesh()
    if meshes is None:
        raise RuntimeError("a tensor-parallel target needs distributed.init_distributed(tensor_parallel=T) first")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model_class = check_tensor_parallel(path, config, tensor_parallel, expert_parallel)

    class Sharded(model_class):
        @classmethod
        def prepare_distribute_model(cls, distributed_config, device_map=None):
            return distributed_config, device, TransformersDeviceMesh(*meshes)

    Sharded.__name__ = Sharded.__qualname__ = model_class.__name__
    settings = DistributedConfig(tp_size=tensor_parallel, ep_size=tensor_parallel if expert_parallel else None)
    model = Sharded.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                    trust_remote_code=trust_remote_code, distributed_config=settings)
    # Each rank read its shards from shared storage at its own pace: meet host-side, on the
    # start-up clock, before the mesh's first collective (the embedding and head's gather).
    distributed.host_barrier("loading the sharded target", "startup")
    return model


def check_tensor_parallel(path, config, tensor_parallel: int, expert_parallel: bool) -> type:
    """Refuse a target that ``target.tensor_parallel`` cannot shard (no transformers class or
    plan, no expert plan, counts the group size does not divide), naming the fix; its causal LM
    class. Train's loading and the memory plan both ask this."""
    try:
        model_class = AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        raise ValueError(f"{path}: target.tensor_parallel needs a causal LM architecture transformers itself "
                         f"implements (this one, {type(config).__name__}, is not among them: remote code?); use "
                         "target.tensor_parallel=1") from None
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"{path}: transformers has no tensor-parallel plan for {model_class.__name__} "
                         f"(config.base_model_tp_plan is empty), so target.tensor_parallel={tensor_parallel} cannot "
                         "shard it; use target.tensor_parallel=1 on a device that holds the whole target")
    if expert_parallel and not getattr(config, "base_model_ep_plan", None):
        raise ValueError(f"{path}: {model_class.__name__} has no expert-parallel plan (not a mixture-of-experts "
                         "model, or none in transformers); use target.expert_parallel=false")
    _check_divisible(path, config, tensor_parallel, expert_parallel)
    return model_class


# Head and expert counts a tensor-parallel plan splits over the group (transformers' plans split
# them evenly and do not replicate KV heads, so a count the group size does not divide would fail
# mid-forward with a shape error).
_SPLIT_COUNTS = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads")
_EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts")


def _check_divisible(path: Path, config, tensor_parallel: int, expert_parallel: bool) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    keys = _SPLIT_COUNTS + (_EXPERT_COUNTS if expert_parallel else ())
    counts = {k: getattr(text, k) for k in keys if isinstance(getattr(text, k, None), int)}
    bad = {k: v for k, v in counts.items() if v % tensor_parallel}
    if bad:
        fits = [t for t in range(2, max(counts.values()) + 1) if all(v % t == 0 for v in counts.values())]
        raise ValueError(
            f"{path}: target.tensor_parallel={tensor_parallel} must divide the target's "
            f"{', '.join(f'{k}={v}' for k, v in bad.items())} (its plan splits them evenly over the group); use "
            f"{' or '.join(map(str, fits)) if fits else 'target.tensor_parallel=1'}, with more data-parallel groups "
            "for the other GPUs")


def _replicated(module: nn.Module, kind: type) -> nn.Module:
    """A frozen plain copy of an embedding or head whose weight may be sharded (the whole table on
    every rank); the module itself when it is not."""
    weight = module.weight
    if not hasattr(weight, "full_tensor"):
        return module
    full = weight.full_tensor().detach()
    copy = kind(*full.shape[::-1], bias=False, device="meta") if kind is nn.Linear else kind(*full.shape,
                                                                                              device="meta")
    copy.weight = nn.Parameter(full, requires_grad=False)
    return copy


class TargetModel(nn.Module):
    """A frozen causal LM with tapped layers.

    ``features(input_ids, attention_mask)`` returns [B, S, K*H] for training: it runs the
    decoder only up to the last tapped layer (a hook stops the forward there), never the later
    layers, the final norm (unless the last layer is tapped) or the LM head. ``embed`` and
    ``lm_head`` are the target's frozen input embedding and output head, shared with the drafter.
    """

    def __init__(self, model: nn.Module, target_layer_ids: list[int] | None = None, num_taps: int = 5,
                 sharded: bool = False, final_state: bool = False):
        """``sharded``: ``model`` is this rank's shard of a tensor-parallel target (_load_sharded).
        ``final_state``: ``features`` also returns the final normed hidden state after the taps (soft
        labels: the target's distribution is its LM head over it); the forward then runs every layer."""
        super().__init__()
        model.eval()
        model.requires_grad_(False)
        self.model = model
        self.config = model.config
        self.layers = _decoder_layers(model)
        self.num_layers = len(self.layers)
        ids = (list(target_layer_ids) if target_layer_ids is not None
               else default_target_layer_ids(self.num_layers, num_taps))
        check_layer_ids(ids, self.num_layers)
        self.layer_ids = ids
        self.final_state = final_state
        self.hidden_size = int(self.config.hidden_size)
        self.embed = model.get_input_embeddings()
        self.lm_head = model.get_output_embeddings()
        self.sharded = sharded
        if sharded:  # the drafter embeds and scores with whole tables: gathered once (V x H each)
            self.embed = _replicated(self.embed, nn.Embedding)
            self.lm_head = _replicated(self.lm_head, nn.Linear)
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        # Held around every forward run from more than one thread (the feed's target thread, the
        # eval on the main thread): forward hooks are per module, and Triton autotuners (fla) are
        # not thread-safe.
        self.lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        target_layer_ids: list[int] | None = None,
        num_taps: int = 5,
        device: str | torch.device = "cpu",
        dtype: str = "auto",
        attn_implementation: str = "sdpa",
        trust_remote_code: bool = False,
        heads_only: bool = False,
        tensor_parallel: int = 1,
        expert_parallel: bool = False,
        final_state: bool = False,
    ) -> TargetModel:
        """Load a local Hugging Face causal LM directory, frozen, in eval mode.

        ``heads_only``: only the input embedding and the LM head, for a rank that never runs the
        target's forward (a drafter rank of a disaggregated job: it embeds block tokens and
        scores with the head; the features come from a target rank). See _heads_only_model; where
        that cannot be done exactly, the whole model is loaded instead.

        ``tensor_parallel`` > 1: this rank holds 1/T of the target, sharded by the model's own
        transformers plan over this rank's target group (distributed.target_mesh(), which
        init_distributed(tensor_parallel=T) built); ``expert_parallel``: its experts split over
        the group instead (a MoE target with an expert plan). See _load_sharded. ``final_state``:
        the training features end in the final normed hidden state (soft labels; TargetModel)."""
        path = _model_dir(path, trust_remote_code)
        check_weights(path)
        device = torch.device(device)
        torch_dtype = resolve_dtype(dtype, device)
        if tensor_parallel > 1:
            model = _load_sharded(path, device, torch_dtype, attn_implementation, trust_remote_code, tensor_parallel,
                                  expert_parallel)
            return cls(model, target_layer_ids, num_taps, sharded=True, final_state=final_state)
        model = _heads_only_model(path, device, torch_dtype, trust_remote_code) if heads_only else None
        if model is not None:
            target = cls(model, target_layer_ids, num_taps, final_state=final_state)
            target.heads_only = True
            return target
        # Each tensor straight from the (memory-mapped) files onto this rank's device: no whole
        # host copy per local rank first (the files' pages are the node's shared page cache).
        model = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch_dtype,
            attn_implementation=attn_implementation,
            trust_remote_code=trust_remote_code,
            device_map=device,
        )
        return cls(model, target_layer_ids, num_taps, final_state=final_state)

    heads_only = False  # True: only embed / lm_head hold weights (from_pretrained(heads_only=True))

    def weight_bytes(self) -> tuple[int, int]:
        """(bytes of the target's weights this rank holds, bytes of the whole target's): equal
        unless it is sharded (from_pretrained(tensor_parallel=T))."""
        local = whole = 0
        for p in self.model.parameters():
            local += (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
            whole += p.numel() * p.element_size()
        return local, whole

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def feature_size(self) -> int:
        """Width of ``features``: K taps of H, and H more for the final state (``final_state``)."""
        return (len(self.layer_ids) + self.final_state) * self.hidden_size

    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Packed taps [B, S, K*H] in tap order, stopping after the last tapped layer; with
        ``final_state``, [B, S, (K+1)*H]: the final normed hidden state appended, after every layer.

        Exactly ``cat([hidden_states[i + 1] for i in layer_ids] (+ [hidden_states[-1]]), -1)`` of a
        full forward.
        """
        if self.heads_only:
            raise RuntimeError("this TargetModel holds only the target's embedding and LM head (heads_only): "
                               "its forward runs on the target ranks")
        taps: dict[int, torch.Tensor] = {}
        last = max(self.layer_ids)
        stop_after = None if self.final_state else last

        def hook(index: int):
            def capture(module, args, output):
                taps[index] = _layer_output(output)
                if index == stop_after:
                    raise _StopForward

            return capture

        handles = [self.layers[i].register_forward_hook(hook(i)) for i in self.layer_ids]
        out = None
        try:
            out = self.model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        if last == self.num_layers - 1:  # HF's last hidden_states entry is after the final norm
            taps[last] = _final_norm(self.model)(taps[last])
        final = [out.last_hidden_state] if self.final_state else []  # the decoder's output is normed
        return torch.cat([taps[i] for i in self.layer_ids] + final, dim=-1)

    def pack_hidden_states(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Taps [B, S, K*H] from a full ``output_hidden_states`` forward (used when decoding)."""
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    @torch.no_grad()
    def forward_with_cache(self, input_ids: torch.Tensor, cache: DynamicCache, start: int):
        """One cached forward at positions start.. : (logits [B, T, V], taps [B, T, K*H])."""
        positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        out = self.model(
            input_ids=input_ids,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=True,
            **{self._cache_kw: cache},
        )
        return out.logits, self.pack_hidden_states(out.hidden_states)

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)
