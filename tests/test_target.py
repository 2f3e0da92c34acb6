"""Target taps: the layer-id convention, default ids, early stop, loading."""

import pytest
import torch

from conftest import VOCAB, tiny_llama, tiny_qwen3, tiny_qwen3_5, tiny_qwen3_next
from flashdraft.drafter import DFlashDrafter
from flashdraft.target import (
    RewindError,
    TargetModel,
    UnsupportedCacheLayer,
    cache_length,
    check_rewind,
    crop_cache,
    default_target_layer_ids,
    mark_cache,
    rewind_cache,
)


def test_default_tap_ids_follow_dflash():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(7, 1) == [3]


def test_default_taps_refuse_duplicates_on_shallow_targets():
    with pytest.raises(ValueError, match="target.layer_ids"):
        default_target_layer_ids(4, 3)  # the formula gives [1, 1, 1]


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_llama, tiny_qwen3_5, tiny_qwen3_next],
                         ids=["qwen3", "llama", "qwen3_5-hybrid", "qwen3_next-hybrid"])
def test_tap_i_is_hidden_states_i_plus_1_for_every_layer(build):
    model = build()
    ids = torch.randint(0, VOCAB, (2, 17))
    full = model(ids, output_hidden_states=True).hidden_states
    num_layers = model.config.num_hidden_layers
    for layer in range(num_layers):  # including the last layer, whose HF entry is normed
        target = TargetModel(model, [layer])
        assert torch.equal(target.features(ids), full[layer + 1]), layer


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_qwen3_5], ids=["qwen3", "qwen3_5-hybrid"])
def test_features_pack_taps_in_order_and_honour_padding(build):
    model = build()
    target = TargetModel(model, [3, 1, 2])
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    full = model(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    expected = torch.cat([full[4], full[2], full[3]], dim=-1)
    assert target.features(ids, mask).shape == (2, 12, 3 * 64)
    torch.testing.assert_close(target.features(ids, mask), expected, rtol=0, atol=0)


def test_training_forward_stops_after_last_tap_and_skips_lm_head():
    model = tiny_qwen3(num_layers=6)
    target = TargetModel(model, [1, 3])
    ran = []
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i))
    model.lm_head.register_forward_hook(lambda m, a, o: ran.append("lm_head"))
    model.model.norm.register_forward_hook(lambda m, a, o: ran.append("norm"))
    target.features(torch.randint(0, VOCAB, (1, 9)))
    assert ran == [0, 1, 2, 3]


def test_target_is_frozen(target):
    assert all(not p.requires_grad for p in target.parameters())
    assert not target.model.training


def test_from_pretrained_loads_a_local_directory(tmp_path):
    model = tiny_qwen3()
    model.save_pretrained(tmp_path / "target")
    target = TargetModel.from_pretrained(tmp_path / "target", target_layer_ids=[1, 3], dtype="auto")
    assert target.dtype == torch.float32  # auto -> fp32 on CPU
    ids = torch.randint(0, VOCAB, (1, 8))
    torch.testing.assert_close(target.features(ids), TargetModel(model, [1, 3]).features(ids))


@pytest.mark.parametrize("tied,shard", [(False, ""), (True, ""), (False, "40KB")], ids=["untied", "tied", "sharded"])
def test_heads_only_load_reads_just_the_embedding_and_lm_head(tmp_path, tied, shard):
    """A disaggregated drafter rank's target: embedding and head equal the full load's, tied
    heads stay tied, every decoder layer stays on the meta device, and the forward refuses."""
    tiny_qwen3(tie_word_embeddings=tied).save_pretrained(tmp_path / "target",
                                                         **({"max_shard_size": shard} if shard else {}))
    assert (tmp_path / "target" / "model.safetensors.index.json").is_file() == bool(shard)
    full = TargetModel.from_pretrained(tmp_path / "target", target_layer_ids=[1, 3])
    heads = TargetModel.from_pretrained(tmp_path / "target", target_layer_ids=[1, 3], heads_only=True)
    assert torch.equal(heads.embed.weight, full.embed.weight) and torch.equal(heads.lm_head.weight, full.lm_head.weight)
    assert (heads.lm_head.weight is heads.embed.weight) == tied
    assert all(p.is_meta for p in heads.layers.parameters())
    assert (heads.device, heads.dtype, heads.feature_size) == (full.device, full.dtype, full.feature_size)
    assert all(not p.requires_grad for p in heads.parameters())
    with pytest.raises(RuntimeError, match="target ranks"):
        heads.features(torch.zeros(1, 4, dtype=torch.long))


def test_heads_only_load_defers_to_a_full_load_without_safetensors(tmp_path):
    model = tiny_qwen3()
    model.save_pretrained(tmp_path / "target")
    for file in (tmp_path / "target").glob("*.safetensors"):  # an old-style .bin checkpoint instead
        file.unlink()
    torch.save(model.state_dict(), tmp_path / "target" / "pytorch_model.bin")
    target = TargetModel.from_pretrained(tmp_path / "target", target_layer_ids=[1, 3], heads_only=True)
    assert not target.heads_only and not any(p.is_meta for p in target.parameters())


def test_heads_only_load_defers_when_names_differ(tmp_path):
    """A checkpoint whose tensor names are not the module names (transformers may rename on
    load): no guessing, the whole target is loaded instead."""
    from safetensors.torch import load_file, save_file

    tiny_qwen3().save_pretrained(tmp_path / "target")
    file = tmp_path / "target" / "model.safetensors"
    tensors = load_file(file)
    tensors["output.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, file, metadata={"format": "pt"})
    target = TargetModel.from_pretrained(tmp_path / "target", target_layer_ids=[1, 3], heads_only=True)
    assert not target.heads_only and not any(p.is_meta for p in target.parameters())


def test_from_pretrained_names_the_fix_for_a_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="local Hugging Face model directory"):
        TargetModel.from_pretrained(tmp_path / "nope")


def test_bad_tap_ids_are_refused():
    with pytest.raises(ValueError, match=r"\[0, 5\]"):
        TargetModel(tiny_qwen3(num_layers=6), [1, 6])


def test_cache_crop_matches_a_fresh_forward(target):
    ids = torch.randint(0, VOCAB, (1, 20))
    cache = target.new_cache()
    target.forward_with_cache(ids, cache, 0)
    crop_cache(cache, 12)
    assert cache.get_seq_length() == 12
    cropped_logits, cropped_taps = target.forward_with_cache(ids[:, 12:15], cache, 12)
    fresh = target.new_cache()
    logits, taps = target.forward_with_cache(ids[:, :15], fresh, 0)
    torch.testing.assert_close(cropped_logits, logits[:, 12:15], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cropped_taps, taps[:, 12:15], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_qwen3_5, tiny_qwen3_next],
                         ids=["qwen3", "qwen3_5-hybrid", "qwen3_next-hybrid"])
@pytest.mark.parametrize("kept", [1, 3, 6])  # 6: the whole verified block is kept (nothing to undo)
def test_rewind_after_a_verification_equals_a_cache_that_never_saw_the_rejected_tokens(build, kept):
    """The draft / verify loop's rollback. A hybrid target's linear-attention layers keep one
    recurrent state that a forward overwrites, so cropping cannot undo it: rewind_cache restores
    the marked state and re-runs the kept tokens. Afterwards the cache must continue exactly
    like a fresh one that only ever saw prompt + kept."""
    target = TargetModel(build(seed=2), [1, 2])
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(kept))
    cache = target.new_cache()
    target.forward_with_cache(ids[:, :10], cache, 0)
    mark = mark_cache(cache)
    assert mark.length == 10 and bool(mark.states) == (build is not tiny_qwen3)
    target.forward_with_cache(ids[:, 10:16], cache, 10)  # the verification of a 6-token block
    rewind_cache(target, cache, mark, ids[0, 10:10 + kept].tolist())
    assert cache.get_seq_length() == 10 + kept
    logits, taps = target.forward_with_cache(ids[:, 10 + kept:20], cache, 10 + kept)
    fresh_logits, fresh_taps = target.forward_with_cache(
        torch.cat([ids[:, :10 + kept], ids[:, 10 + kept:20]], 1), target.new_cache(), 0)
    torch.testing.assert_close(logits, fresh_logits[:, 10 + kept:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(taps, fresh_taps[:, 10 + kept:], rtol=1e-5, atol=1e-5)


def test_hybrid_cache_cannot_be_cropped_so_rewinding_is_needed():
    """Guards the test above: without the restore + re-run, the hybrid cache is wrong (or
    transformers refuses to crop it)."""
    target = TargetModel(tiny_qwen3_5(seed=2), [1, 2])
    ids = torch.randint(0, VOCAB, (1, 16))
    cache = target.new_cache()
    target.forward_with_cache(ids, cache, 0)
    with pytest.raises(RuntimeError):
        crop_cache(cache, 12)


def test_a_cache_layer_of_an_unknown_kind_is_refused_by_name():
    """A layer class the rewind does not describe (here transformers' own StaticLayer) is refused,
    naming the layer and its class, instead of being restored the wrong way."""
    from transformers.cache_utils import StaticLayer

    target = TargetModel(tiny_qwen3_5(seed=2), [1, 2])
    cache = target.new_cache()
    target.forward_with_cache(torch.randint(0, VOCAB, (1, 8)), cache, 0)
    cache.layers[3] = StaticLayer(max_cache_len=32)
    with pytest.raises(UnsupportedCacheLayer, match=r"cache layer 3 is a StaticLayer.*refused rather than done"):
        mark_cache(cache)


def test_a_linear_layer_holding_state_the_rewind_does_not_know_is_refused_by_name():
    """transformers 5.25 added a field to LinearAttentionLayer (cumulative_length_linear) and the
    old rewind, which restored vars() wholesale, went wrong without a word. A field that neither
    LINEAR_STATE nor LINEAR_INERT names now stops the rewind, naming it and where to add it."""
    target = TargetModel(tiny_qwen3_next(seed=2), [1, 2])
    cache = target.new_cache()
    target.forward_with_cache(torch.randint(0, VOCAB, (1, 8)), cache, 0)
    cache.layers[0].positions_seen = torch.tensor(8)  # a future release's new state
    with pytest.raises(UnsupportedCacheLayer, match=r"cache layer 0 \(LinearAttentionLayer, transformers .*"
                                                   r"\['positions_seen'\].*LINEAR_STATE"):
        mark_cache(cache)


def test_the_cache_length_is_read_as_a_number_that_a_later_forward_cannot_move():
    """The 5.25 break itself: DynamicCache.get_seq_length() returned the linear layers' live
    counter, so a length kept at the mark grew with the verification forward."""
    target = TargetModel(tiny_qwen3_5(seed=2), [1, 2])
    cache = target.new_cache()
    target.forward_with_cache(torch.randint(0, VOCAB, (1, 8)), cache, 0)
    mark = mark_cache(cache)
    target.forward_with_cache(torch.randint(0, VOCAB, (1, 5)), cache, 8)
    assert (mark.length, cache_length(cache)) == (8, 13) and type(mark.length) is int


@pytest.mark.parametrize("build", [tiny_qwen3, tiny_qwen3_5, tiny_qwen3_next],
                         ids=["qwen3", "qwen3_5-hybrid", "qwen3_next-hybrid"])
def test_the_rewind_self_check_passes_once_per_target(build):
    target = TargetModel(build(seed=2), [1, 2])
    assert not getattr(target, "rewind_checked", False)
    check_rewind(target)
    assert target.rewind_checked


def test_a_rewind_broken_on_purpose_is_refused_before_anything_is_decoded(monkeypatch):
    """The self-check in front of every decode: a rewind that forgets the recurrent state (its
    field moved to the inert list, as a wrong description would) is refused by RewindError
    with the size of the error, and the drafter never runs."""
    from conftest import make_drafter
    from flashdraft.speculative import speculative_generate
    from flashdraft.target import rewind

    monkeypatch.setattr(rewind, "LINEAR_STATE", tuple(f for f in rewind.LINEAR_STATE if f != "recurrent_states"))
    monkeypatch.setattr(rewind, "LINEAR_INERT", rewind.LINEAR_INERT + ("recurrent_states",))
    target = TargetModel(tiny_qwen3_5(seed=2), [1, 2])
    drafter = make_drafter(target, num_layers=1, block_size=4)
    calls = []
    monkeypatch.setattr(drafter, "forward_block", lambda *a, **k: calls.append(a))
    with pytest.raises(RewindError, match=r"rewind is not exact on transformers .* differs from one that never saw "
                                          r"the rejected tokens \(layer 0 \(LinearAttentionLayer\) 'recurrent_states'"
                                          r"(\]\[0)?: off by \S+ \(allowed .*not be lossless"):
        speculative_generate(target, drafter, [1, 2, 3, 4, 5], 8)
    assert calls == [] and not getattr(target, "rewind_checked", False)


def test_drafter_of_a_hybrid_target_rotates_every_head_dim_as_its_config_says():
    """Qwen3.5 / Qwen3-Next rotate a quarter of each head (partial_rotary_factor 0.25) in their
    own attention. The drafter is plain Qwen3 attention and trains with full RoPE, so its
    config.json must not carry the target's partial factor: vLLM / SGLang read it and would
    rotate q / k unlike training."""
    target = TargetModel(tiny_qwen3_5(), [1, 2])
    assert target.config.to_dict()["rope_parameters"]["partial_rotary_factor"] == 0.25  # the premise
    drafter = DFlashDrafter.for_target(target, num_layers=1, block_size=4, mask_token_id=VOCAB - 1)
    rope = drafter.config["rope_parameters"]
    assert "partial_rotary_factor" not in rope and rope["rope_theta"] == target.config.rope_parameters["rope_theta"]
    x = torch.zeros(1, 3, drafter.config["hidden_size"])
    cos, sin = drafter.rope(torch.arange(1, 4).unsqueeze(0), x)
    head_dim = drafter.config["head_dim"]
    assert cos.shape[-1] == head_dim and bool((sin[..., head_dim // 2 - 1] != 0).all())  # the last pair rotates too


# ---- a target directory nothing can be built from: one line naming the file and field ------------


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory):
    """A tiny saved target, its prompts and a run's data (what plan, train and eval read)."""
    from conftest import make_job

    return make_job(tmp_path_factory.mktemp("bad-target"), tiny_qwen3(num_layers=4, hidden=32, seed=1))


# (what is written into config.json or model.safetensors, the message's file-and-field part)
BAD_TARGETS = {
    "empty": ("config.json", b"", r"not a readable JSON model config"),
    "binary": ("config.json", b"\xff\xfe\x00\x01", r"not a readable JSON model config"),
    "null": ("config.json", b"null", r"a model config is a JSON object of fields, not NoneType"),
    "deep": ("config.json", b"[" * 100_000 + b"]" * 100_000, r"not a readable JSON model config \(nested too deeply\)"),
    "zero_heads": ({"num_attention_heads": 0}, None, r"num_attention_heads=0 is invalid: a size is a whole number "
                                                     r"from 1 to 1,024"),
    "zero_hidden": ({"hidden_size": 0}, None, r"hidden_size=0 is invalid"),
    "negative_hidden": ({"hidden_size": -64}, None, r"hidden_size=-64 is invalid"),
    "huge_hidden": ({"hidden_size": 10**12}, None, r"hidden_size=1000000000000 is invalid.*to 65,536"),
    "string_hidden": ({"hidden_size": "32"}, None, r"hidden_size='32' is invalid"),
    "fractional_hidden": ({"hidden_size": 32.5}, None, r"hidden_size=32.5 is invalid"),
    "nan_hidden": ({"hidden_size": float("nan")}, None, r"hidden_size=nan is invalid"),
    "negative_layers": ({"num_hidden_layers": -4}, None, r"num_hidden_layers=-4 is invalid"),
    "million_layers": ({"num_hidden_layers": 1_000_000}, None, r"num_hidden_layers=1000000 is invalid.*to 1,024"),
    "zero_vocab": ({"vocab_size": 0}, None, r"vocab_size=0 is invalid"),
    "kv_heads": ({"num_key_value_heads": 3}, None, r"num_key_value_heads=3 does not divide num_attention_heads=4"),
    "corrupt_weights": ("model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage",
                        r"cannot read the target's weights"),
}


def _broken_target(saved_target, tmp_path, bad):
    import json
    import shutil

    target = tmp_path / "target"
    shutil.copytree(saved_target / "target", target)
    what, raw, _ = BAD_TARGETS[bad]
    if isinstance(what, dict):
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, **what}))
    else:
        (target / what).write_bytes(raw)
    return target


# Each mistake through one command (all three read a target through target.model.read_model_config),
# each command through several; 10^6 layers through plan (the minute of meta layers), damaged
# weights through both commands that load them.
BAD_TARGET_CASES = [(bad, ("plan", "train", "eval")[i % 3]) for i, bad in enumerate(BAD_TARGETS)
                    if bad not in ("million_layers", "corrupt_weights")]
BAD_TARGET_CASES += [("million_layers", "plan"), ("million_layers", "train"), ("corrupt_weights", "train"),
                     ("corrupt_weights", "eval"), ("corrupt_weights", "plan")]


@pytest.mark.parametrize(("bad", "command"), BAD_TARGET_CASES)
def test_a_target_config_or_weights_nothing_can_be_built_from_is_one_line_in_plan_train_and_eval(
        saved_target, tmp_path, bad, command):
    """Before: tracebacks (JSON, type and allocator errors; safetensors' own error), and for
    num_hidden_layers 1e6 a minute of meta layers until memory ran out. Now each is refused, naming
    the file and the field, before anything is built (plan reads no weights: it plans a target
    with damaged weights as it would the good one)."""
    import re

    from conftest import overrides
    from flashdraft.cli import main

    target = _broken_target(saved_target, tmp_path, bad)
    what, _, message = BAD_TARGETS[bad]
    file = target / (what if isinstance(what, str) else "config.json")
    if command == "eval":
        argv = ["eval", "--target", str(target), "--baseline", "ngram", "--prompts",
                str(saved_target / "prompts.jsonl"), "--block-size", "4", "--max-new-tokens", "2", "--device", "cpu"]
    else:
        argv = [command, *overrides(saved_target, tmp_path / "run", target__path=target)]
    if command == "plan" and what == "model.safetensors":
        assert main(argv) == 0
        return
    with pytest.raises(ValueError, match=re.escape(str(file)) + ": " + message):
        main(argv)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_target_with_code_of_its_own_is_refused_without_a_hub_url_made_of_its_path(tmp_path):
    """transformers' refusal read "inspect the repository content at https://hf.co//tmp/..."."""
    import json

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps({
        "model_type": "custom", "auto_map": {"AutoModelForCausalLM": "modeling.CustomForCausalLM"}}))
    with pytest.raises(ValueError, match=r"config.json: this target's architecture is Python code in its own "
                                         r"directory .*target.trust_remote_code=true") as caught:
        TargetModel.from_pretrained(tmp_path / "target")
    assert "hf.co" not in str(caught.value) and "https://" not in str(caught.value)
