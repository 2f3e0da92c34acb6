"""Sliding-window and in-block-causal drafter layers (DFLASH2.md section 3): the masks against the
fact sheet's per-query rule, every attention path against the dense one, training against
per-anchor inference and against an independent implementation, and the serving config keys
each engine reads."""

from __future__ import annotations

import json

import pytest
import torch
from test_step_equivalence import assert_same, batch, grads_of, make

from flashdraft.config import LayerMask
from flashdraft.drafter import DFlashDrafter
from flashdraft.drafter.attention import decode_mask, dense_block_mask
from flashdraft.drafter.serving import layer_attention

# (layer_types, window, causal): W < bs and W >= bs, explicit causality or by layer type.
LAYOUTS = [
    (["sliding_attention", "sliding_attention"], 3, False),  # DFlash2's: all sliding, is_causal false
    (["sliding_attention", "sliding_attention"], 6, None),  # sliding, causal by type
    (["sliding_attention", "full_attention"], 2, None),  # [S, F]: causal windowed, then full bidirectional
    (["full_attention", "full_attention"], None, True),  # full but in-block causal
]


def _visible_by_hand(a: int, valid: bool, k: int, key: int, key_is_slot: bool, key_slot: int, same: bool,
                     layer: LayerMask) -> bool:
    """DFLASH2.md 3.1 for the query at slot k of the block anchored at a: context a + k - (W-1)
    <= kv < a; in-block slots <= k when causal, within the window; a padded block: its slots."""
    if key_is_slot:
        return same and (not layer.causal or key_slot <= k) and (layer.window is None or k - key_slot < layer.window)
    return valid and key < a and (layer.window is None or a + k - (layer.window - 1) <= key)


@pytest.mark.parametrize("layer", [LayerMask(), LayerMask(2, False), LayerMask(3, True), LayerMask(9, False),
                                   LayerMask(None, True)])
def test_the_dense_mask_is_the_per_query_rule(layer):
    bs, s = 4, 20
    anchors = torch.tensor([[3, 7, 15, 0], [0, 5, 12, 18]])
    valid = torch.tensor([[True, True, True, False], [True, True, True, True]])
    mask = dense_block_mask(anchors, valid, s, bs, layer)[:, 0]
    for b in range(2):
        for n in range(4):
            for k in range(bs):
                row = mask[b, n * bs + k]
                for key in range(s + 4 * bs):
                    is_slot = key >= s
                    expected = _visible_by_hand(int(anchors[b, n]), bool(valid[b, n]), k, key, is_slot,
                                                (key - s) % bs, is_slot and (key - s) // bs == n, layer)
                    assert bool(row[key]) == expected, (b, n, k, key)


@pytest.mark.parametrize("impl", ["split", "blockwise"])
@pytest.mark.parametrize("layer_types,window,causal", LAYOUTS)
def test_every_attention_path_equals_the_dense_one(impl, layer_types, window, causal):
    target, drafter = make(block_size=4, group_blocks=2, layer_types=layer_types, sliding_window=window,
                           causal=causal)
    inputs = batch(target, drafter, [40, 23], 12, seed=3)
    ref = grads_of(drafter, target, inputs, attention="dense")
    assert_same(ref, grads_of(drafter, target, inputs, attention=impl))
    assert_same(ref, grads_of(drafter, target, inputs, attention=impl, chunk_size=7, anchors_per_microbatch=5))


@pytest.mark.parametrize("layer_types,window,causal", LAYOUTS)
def test_flex_forward_equals_dense(layer_types, window, causal):
    target, drafter = make(block_size=4, layer_types=layer_types, sliding_window=window, causal=causal)
    features, embeds, anchors, valid, *_ = batch(target, drafter, [40, 23], 12, seed=5)
    with torch.no_grad():
        dense = drafter(features, embeds, anchors, valid, attention="dense")
        flex = drafter(features, embeds, anchors, valid, attention="flex")
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_a_window_shorter_than_the_context_changes_the_output():
    """The window bites: the same weights with full attention give another output (so the
    equalities above compare masks that do something)."""
    target, swa = make(block_size=4, layer_types=["sliding_attention"] * 2, sliding_window=3, causal=False)
    full = DFlashDrafter({**swa.config, "layer_types": ["full_attention"] * 2, "use_sliding_window": False})
    full.load_state_dict(swa.state_dict())
    features, embeds, anchors, valid, *_ = batch(target, swa, [40], 8, seed=1)
    with torch.no_grad():
        assert not torch.allclose(swa(features, embeds, anchors, valid, attention="dense"),
                                  full(features, embeds, anchors, valid, attention="dense"), atol=1e-3)


@pytest.mark.parametrize("layer_types,window,causal", LAYOUTS)
def test_an_export_reloads_to_the_same_drafter(layer_types, window, causal, tmp_path):
    # (training == per-anchor inference == the spec's own implementation, for these layouts:
    # test_drafter.py::test_the_exported_drafter_computes_what_dflash_md_specifies)
    target, drafter = make(block_size=4, layer_types=layer_types, sliding_window=window, causal=causal)
    drafter.eval().save_pretrained(tmp_path, dtype=torch.float32)
    reloaded = DFlashDrafter.from_pretrained(tmp_path)
    assert reloaded.layer_masks == drafter.layer_masks
    features, embeds, anchors, valid, *_ = batch(target, drafter, [40, 23], 12, seed=2)
    with torch.no_grad():
        assert torch.equal(reloaded(features, embeds, anchors, valid), drafter(features, embeds, anchors, valid))


def test_the_export_writes_what_vllm_and_sglang_read(target):
    mixed = DFlashDrafter.for_target(target, num_layers=3, block_size=8, mask_token_id=299,
                                     layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                     sliding_window=2048).config
    assert mixed["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert mixed["sliding_window"] == 2048 and mixed["use_sliding_window"] is True and mixed["max_window_layers"] == 3
    assert mixed["dflash_config"]["swa_window_size"] == 2048
    assert "is_causal" not in mixed and "causal" not in mixed["dflash_config"]  # mixed: the by-type default
    assert layer_attention(mixed) == [LayerMask(2048, True), LayerMask(2048, True), LayerMask(None, False)]
    v2 = DFlashDrafter.for_target(target, num_layers=2, block_size=8, mask_token_id=299,
                                  layer_types=["sliding_attention"] * 2, sliding_window=2048, causal=False).config
    assert v2["is_causal"] is False and v2["dflash_config"]["causal"] is False  # DFlash2's released layout
    assert layer_attention(v2) == [LayerMask(2048, False)] * 2


def test_layer_attention_follows_the_engines_precedence():
    base = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}
    assert layer_attention(base) == [LayerMask(16, True), LayerMask(None, False)]  # by type
    assert layer_attention({**base, "dflash_config": {"causal": True}}) == [LayerMask(16, True), LayerMask(None, True)]
    assert layer_attention({**base, "is_causal": False, "dflash_config": {"causal": True}}) == \
        [LayerMask(16, False), LayerMask(None, False)]  # top-level is_causal first
    assert layer_attention({**base, "dflash_config": {"swa_window_size": 8}})[0].window == 8
    use_swa = {"num_hidden_layers": 2, "layer_types": ["full_attention"] * 2,
               "dflash_config": {"use_swa": True, "swa_window_size": 32}}
    assert layer_attention(use_swa) == [LayerMask(32, False)] * 2  # MiMo-style: forced sliding, still bidirectional
    assert layer_attention({**use_swa, "is_causal": True}) == [LayerMask(32, True)] * 2
    # Without layer_types, as HF's Qwen3Config derives them (sliding from max_window_layers on).
    hf = {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    assert layer_attention(hf) == [LayerMask(None, False), LayerMask(8, True), LayerMask(8, True)]
    assert layer_attention({**hf, "use_sliding_window": False}) == [LayerMask()] * 3


def test_decode_mask_is_the_training_rule_for_one_block():
    layer = LayerMask(3, True)
    mask = decode_mask(10, 4, layer, "cpu")[0, 0]
    expected = dense_block_mask(torch.tensor([[10]]), torch.tensor([[True]]), 10, 4, layer)[0, 0]
    assert torch.equal(mask, expected)
    assert decode_mask(10, 4, LayerMask(), "cpu") is None


# ---- issue 31, 14 (its first sub-item): a sliding window that leaves a block slot blind to the target ----

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [4, 8])
def test_blind_slots_are_those_the_training_mask_never_connects_to_the_context(block_size, causal):
    """The rule (config.blind_slots) against the real training mask, layer after layer: a slot
    learns of the context through its own row of context keys or an in-block slot that learnt of
    it in an earlier layer."""
    import torch

    from flashdraft.config import LayerMask, blind_slots
    from flashdraft.drafter.attention import dense_block_mask

    seq = 3 * block_size
    anchors, valid = torch.tensor([[2 * block_size]]), torch.tensor([[True]])
    stacks = [[LayerMask(w, causal)] * n for w in range(1, block_size + 2) for n in (1, 2, 3)]
    stacks += [[LayerMask(1, causal), LayerMask(None, causal)], [LayerMask(None, causal), LayerMask(2, causal)]]
    for layers in stacks:
        informed = torch.zeros(block_size, dtype=torch.bool)
        for layer in layers:
            mask = dense_block_mask(anchors, valid, seq, block_size, layer)[0, 0]  # [bs, seq + bs]
            informed = informed | mask[:, :seq].any(1) | (mask[:, seq:] & informed.view(1, -1)).any(1)
        assert blind_slots(layers, block_size) == [k for k in range(1, block_size) if not informed[k]], layers


def test_a_blind_slot_of_a_real_drafter_has_no_gradient_from_the_target_features(target):
    """The drafter itself: a window of 2 over 2 layers and a block of 8 gives slots 2..7 no path
    from the target's features (their gradient is exactly zero), slot 1 one."""
    import torch

    from conftest import MASK_ID
    from flashdraft.config import LayerMask, blind_slots
    from flashdraft.drafter import DFlashDrafter

    drafter = DFlashDrafter.for_target(target, num_layers=2, block_size=8, mask_token_id=MASK_ID,
                                       layer_types=["sliding_attention"] * 2, sliding_window=2, causal=False)
    drafter.reset_parameters(std=0.02, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(0, MASK_ID, (1, 24), generator=torch.Generator().manual_seed(1))
    features = target.features(ids).detach().requires_grad_(True)
    block = torch.full((1, 8), MASK_ID)
    block[0, 0] = ids[0, 12]
    out = drafter(features, target.embed(block).unsqueeze(1), torch.tensor([[12]]), torch.tensor([[True]]))[0, 0]
    reached = [bool(torch.autograd.grad(out[k].sum(), features, retain_graph=True)[0].abs().sum() > 0)
               for k in range(1, 8)]
    assert [k for k, r in zip(range(1, 8), reached) if not r] == blind_slots([LayerMask(2, False)] * 2, 8) \
        == [2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize(("window", "block_size", "layers", "message"), [
    (1, 16, 5, r"drafter.sliding_window=1 .*block slots 1..15 can see no target feature.*window of 5 or more"),
    (2, 16, 5, r"drafter.sliding_window=2 .*block slots 5..15 .*window of 5 or more"),
    (4, 4, 1, r"drafter.sliding_window=4 .*block slots 3 can see.*window of 5 or more"),
])
def test_a_sliding_window_that_leaves_a_slot_blind_is_refused_at_load(window, block_size, layers, message):
    from flashdraft.config import DrafterConfig

    with pytest.raises(ValueError, match=message + r".*or make a layer full_attention"):
        DrafterConfig(block_size=block_size, num_layers=layers, layer_types=("sliding_attention",),
                      sliding_window=window)
    # what stays accepted: the released layout's miniature (W 3 < block 4, 2 layers: tests/test_dflash2.py), a
    # full layer anywhere in the stack, the smallest window the refusal names, the released window
    DrafterConfig(block_size=4, num_layers=2, layer_types=("sliding_attention",), sliding_window=3)
    DrafterConfig(block_size=block_size, num_layers=2, sliding_window=window,
                  layer_types=("sliding_attention", "full_attention"))
    DrafterConfig(block_size=block_size, num_layers=layers, layer_types=("sliding_attention",), sliding_window=5)
    DrafterConfig(layer_types=("sliding_attention",), sliding_window=2048)


def test_an_export_whose_window_leaves_a_slot_blind_is_refused_on_load(eval_dir, tmp_path):
    import shutil

    from flashdraft.drafter.serving import read_config

    export = tmp_path / "export"
    shutil.copytree(eval_dir / "drafter", export)  # 1 layer, block 4
    config = json.loads((export / "config.json").read_text())
    config.update(layer_types=["sliding_attention"], sliding_window=2, use_sliding_window=True)
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"(?s)config.json: .*sliding_window=2.*block_size 4.*1 sliding layer.*"
                                         r"slots 1..3.*window of 5 or more"):
        read_config(export)
    (export / "config.json").write_text(json.dumps({**config, "sliding_window": 5}))
    assert read_config(export)["sliding_window"] == 5
    del config["block_size"]
    config["dflash_config"].pop("block_size", None)
    (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"block_size=None: give the drafter's block size"):
        read_config(export)
