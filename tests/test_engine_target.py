"""The vLLM target backend (flashdraft.target.engine): features from vLLM's CPU build equal to the
transformers forward's, a planted tap off-by-one refused by the feature check, the capture's token
ids checked, and the refusals that need no engine (a last-layer tap, no vLLM, bad padding, config).

One engine start for the module (tens of seconds on 2 cores): it captures vLLM aux layers 1..3 of
a 4-layer Qwen3 (head_dim 32: vLLM's CPU attention takes it), and each EngineTarget below reads the
aux layers its taps map to from it."""

from __future__ import annotations

import os

import pytest
import torch

import flashdraft.target.engine as engine_module
from flashdraft.config import load_config
from flashdraft.target import TargetModel
from flashdraft.target.engine import (
    EngineError,
    EngineOptions,
    EngineTarget,
    FeatureEngine,
    _lengths,
    engine_interpreter,
    last_layer_refusal,
    read_capture,
)
from flashdraft.target.feature_check import EngineFeatureMismatch, check_engine_features
from flashdraft.toy import tiny_causal_lm

pytestmark = pytest.mark.xdist_group("engine_target")  # one worker starts the module's engine once

LENGTHS = (5, 40, 17, 64, 3, 29)  # batches of 4 (the check's): padding in both


def samples() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, 300, (n,), generator=gen).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-target")
    tiny_causal_lm(300, arch="qwen3", num_layers=4, hidden=64, num_heads=2, num_kv_heads=1, seed=1,
                   max_position_embeddings=512,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}).save_pretrained(root / "target")
    return root / "target"


@pytest.fixture(scope="module")
def engine(target_dir):
    """The module's engine (aux layers 1, 2, 3: taps 0, 1, 2), or a skip saying why vLLM's CPU build
    cannot be had here."""
    try:
        engine_interpreter(EngineOptions(), log_fn=print)
    except EngineError as exc:
        pytest.skip(str(exc))
    started = FeatureEngine(target_dir, [3, 1, 2], dtype="float32", max_model_len=128)
    yield started
    started.close()


def heads(target_dir, taps) -> TargetModel:
    return TargetModel.from_pretrained(target_dir, target_layer_ids=taps, dtype="float32", heads_only=True)


def reference(target_dir, taps) -> TargetModel:
    return TargetModel.from_pretrained(target_dir, target_layer_ids=taps, dtype="float32")


@pytest.mark.slow
@pytest.mark.parametrize("taps", [[1, 2], [2, 0]])  # [2, 0]: tap order is not layer order
def test_the_engine_features_equal_the_transformers_forward_with_padding(engine, target_dir, taps):
    target = EngineTarget(heads(target_dir, taps), engine)
    report = check_engine_features(target, reference(target_dir, taps), samples())
    assert [t["layer"] for t in report["taps"]] == taps and report["samples"] == len(LENGTHS)
    assert all(t["relative_error"] < 1e-5 and t["max_abs_error"] < 1e-5 for t in report["taps"]), report
    # the packed batch itself: taps in order, zeros where padded, the capture files gone
    batch = torch.zeros(2, 40, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for b, sample in enumerate(samples()[:2]):
        batch[b, :len(sample)], mask[b, :len(sample)] = torch.tensor(sample), 1
    got = target.features(batch, mask)
    want = reference(target_dir, taps).features(batch[1:], mask[1:])[0]
    assert got.shape == (2, 40, 2 * 64) and got.dtype == torch.float32
    torch.testing.assert_close(got[1], want, rtol=1e-5, atol=1e-5)
    assert got[0, 5:].abs().sum() == 0 and got[0, :5].abs().sum() > 0
    assert os.listdir(engine.storage) == []


@pytest.mark.slow
def test_a_planted_tap_off_by_one_is_refused_naming_the_tap_the_sample_and_the_error(engine, target_dir, monkeypatch):
    monkeypatch.setattr(engine_module, "vllm_aux_layer_id", lambda tap: tap)  # aux id i for tap i: one layer early
    planted = EngineTarget(heads(target_dir, [1, 2]), engine)
    with pytest.raises(EngineFeatureMismatch) as refused:
        check_engine_features(planted, reference(target_dir, [1, 2]), samples())
    error = refused.value
    assert error.tap in (0, 1) and error.layer in (1, 2) and 0 <= error.sample < len(LENGTHS)
    assert error.relative_error > 0.1 and error.max_abs_error > 0.01 and error.aux_layer == error.layer
    assert f"at tap {error.tap} (target layer {error.layer}, read from vLLM aux layer {error.layer})" in str(error)
    assert f"sample {error.sample}: relative error {error.relative_error:.2e}" in str(error)


@pytest.mark.slow
def test_a_capture_of_other_tokens_is_refused_and_removed(engine):
    (path,) = engine.prefill([[7, 8, 9, 10]])
    out = torch.empty(4, 3 * 64)
    with pytest.raises(EngineError, match="first difference at position 2"):
        read_capture(path, [7, 8, 11, 10], torch.tensor([0, 1, 2]), out)
    assert os.listdir(engine.storage) == []


@pytest.mark.slow
def test_a_batch_whose_captures_would_not_fit_is_refused_before_it_is_sent(engine, monkeypatch):
    batch = [list(range(1, 101))]  # 100 tokens x 3 aux layers x 64 x 4 bytes = 76,800 bytes of captures
    real = engine_module.shutil.disk_usage
    monkeypatch.setattr(engine_module.shutil, "disk_usage", lambda path: real(path)._replace(free=50_000))
    with pytest.raises(EngineError, match="FLASHDRAFT_ENGINE_STORAGE"):
        engine.prefill(batch)
    monkeypatch.setattr(engine_module.shutil, "disk_usage", lambda path: real(path)._replace(free=80_000))
    (path,) = engine.prefill(batch)  # the engine took nothing of the refused one: the next request is answered
    read_capture(path, batch[0], torch.tensor([0]), torch.empty(100, 64))


def test_a_last_layer_tap_is_refused_before_any_engine_starts(target_dir):
    assert last_layer_refusal([1, 2], 4) is None
    with pytest.raises(ValueError, match=r"taps the target's last layer \(3\).*before it"):
        EngineTarget.from_pretrained(target_dir, target_layer_ids=[1, 3], dtype="float32", max_model_len=64)


def test_without_vllm_the_backend_is_refused_with_the_reason_and_nothing_is_installed(monkeypatch, tmp_path):
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")  # what a CUDA machine's training environment has
    monkeypatch.setenv("FLASHDRAFT_ENGINE_DIR", str(tmp_path / "engine"))
    with pytest.raises(EngineError, match="cannot start its engine: .*target.vllm_python") as refused:
        engine_interpreter(EngineOptions())
    # the reason is the torch it would replace (elsewhere than Linux x86-64: the platform)
    assert "this environment has torch 2.13.0+cu130" in str(refused.value) or "Linux x86-64" in str(refused.value)
    assert not (tmp_path / "engine").exists()
    with pytest.raises(EngineError, match=r"interpreter .*python \(target.vllm_python\) does not exist: name the "
                                          "python of an environment where vLLM is installed"):
        engine_interpreter(EngineOptions(python=str(tmp_path / "python")))


def test_the_engine_arguments_pass_through_from_the_config():
    model = load_config(overrides=["target.backend=vllm", "target.vllm_tensor_parallel=4",
                                   "target.vllm_expert_parallel=true", "target.vllm_quantization=fp8",
                                   "target.vllm_gpu_memory_utilization=0.5", "target.vllm_max_model_len=8192",
                                   "target.vllm_devices=0,1,2,3", "target.vllm_python=/opt/vllm/bin/python"]).target
    options = EngineOptions.of(model)
    assert options.engine_args() == {"tensor_parallel_size": 4, "enable_expert_parallel": True, "quantization": "fp8",
                                     "gpu_memory_utilization": 0.5}
    assert (options.max_model_len, options.devices, options.python) == (8192, "0,1,2,3", "/opt/vllm/bin/python")


def test_the_engine_target_takes_right_padded_batches_only():
    assert _lengths(torch.tensor([[1, 1, 0], [1, 1, 1]]), 2, 3) == [2, 3]
    with pytest.raises(ValueError, match="right-padded"):
        _lengths(torch.tensor([[0, 1, 1]]), 1, 3)
    with pytest.raises(ValueError, match="non-empty"):
        _lengths(torch.tensor([[0, 0, 0]]), 1, 3)


def test_the_config_refuses_what_the_vllm_backend_cannot_do_and_knobs_it_would_ignore():
    assert load_config(overrides=["target.backend=vllm", "target.vllm_tensor_parallel=8"]).target.backend
    with pytest.raises(ValueError, match="target.vllm_quantization=fp8 is ignored.*target.backend=vllm"):
        load_config(overrides=["target.vllm_quantization=fp8"])
    with pytest.raises(ValueError, match="use target.vllm_tensor_parallel"):
        load_config(overrides=["target.backend=vllm", "target.tensor_parallel=2"])
    with pytest.raises(ValueError, match="eval.num_prompts=0"):
        load_config(overrides=["target.backend=vllm", "eval.data_path=heldout"])
    load_config(overrides=["target.backend=vllm", "eval.data_path=heldout", "eval.num_prompts=0"])
    with pytest.raises(ValueError, match=r"objective.kd_weight=0.5 .*final normed state, which the vLLM engine "
                                         r"cannot capture.*objective.kd_weight=0"):
        load_config(overrides=["target.backend=vllm", "objective.kd_weight=0.5"])


@pytest.mark.slow
def test_an_engine_that_died_is_reported_with_its_log_not_waited_for(engine, target_dir):
    """Last in the module: it ends the module's engine."""
    target = EngineTarget(heads(target_dir, [1, 2]), engine)
    engine.process.kill()
    with pytest.raises(EngineError, match="the vLLM engine exited with status -9") as refused:
        target.features(torch.ones(1, 4, dtype=torch.long))
    assert str(engine.log_path) in str(refused.value)
    engine.log_path.unlink()  # kept for the user after a failure; this one was planted


def test_the_engine_runs_on_the_ranks_own_gpu_unless_the_config_names_others(monkeypatch):
    """target.vllm_devices empty: the engine's CUDA_VISIBLE_DEVICES is the rank's own GPU (its
    physical index under the caller's CUDA_VISIBLE_DEVICES), where the memory plan counts its
    share; named devices stand; a CPU rank changes nothing."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert EngineOptions().on_device(torch.device("cuda", 2)).devices == "2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert EngineOptions().on_device(torch.device("cuda", 2)).devices == "6"
    assert EngineOptions(devices="0,1").on_device(torch.device("cuda", 2)).devices == "0,1"
    assert EngineOptions().on_device(torch.device("cpu")) == EngineOptions()
