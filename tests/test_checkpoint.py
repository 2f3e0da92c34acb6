"""flashdraft.checkpoint: exact round trips, atomicity under SIGKILL, corruption, disk errors, 2 ranks."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import read_log, results, run_ranks
from flashdraft import checkpoint as ckpt
from flashdraft.checkpoint import (
    MANIFEST,
    CheckpointError,
    CheckpointManager,
    flatten_state,
    sha256_file,
    unflatten_state,
    verify_checkpoint,
)


def assert_same(a, b, path="<root>"):
    """Exact equality: same types everywhere, bit-identical tensors and arrays."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731 (NaN-safe, -0.0-exact)
        assert torch.equal(as_bytes(a), as_bytes(b)), path
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), path
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}.{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def training_state(seed: int = 0):
    """A tiny model trained 3 AdamW steps with a LambdaLR warmup, plus every RNG and a cursor."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    for _ in range(3):
        model(torch.randn(2, 4, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    np_rng = np.random.default_rng(seed)
    np_rng.random(3)
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np_rng.bit_generator.state,
           "numpy_legacy": np.random.get_state()}
    cursor = {"epoch": 1, "batch_index": 17, "seed": seed, "order_hash": "ab12", "done": False}
    return model, opt, sched, rng, cursor


def test_flatten_round_trip_is_exact_for_all_supported_leaves():
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    obj = {
        "ints": [0, -1, 2**40, 2**64 + 5, -(2**100)],
        "floats": (0.1, -0.0, 1e300, float("inf"), float("-inf"), float("nan")),
        "misc": [None, True, False, "s", "", {"nested": ({"x": 1},)}],
        7: {"int key": 1}, 2.5: "float key", None: "none key", True: "bool key",
        "tensors": {"view_T": base.t(), "slice": base[1], "alias_a": base, "alias_b": base,
                    "bf16": torch.randn(5).to(torch.bfloat16), "bool": torch.tensor([True, False]),
                    "i64_scalar": torch.tensor(3), "empty": torch.zeros(0, 3),
                    "u8": torch.arange(256, dtype=torch.uint8)},
        "numpy": {"arr": np.arange(6, dtype=np.uint32).reshape(2, 3), "f32": np.float32(1.25), "i64": np.int64(-3),
                  "f64": np.float64(2.5)},
        "a.b": 1, "a": {"b": torch.ones(1)},
    }
    tensors, skeleton = flatten_state(obj)
    json.dumps(skeleton, allow_nan=False)  # strictly JSON-able
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in tensors.values())
    assert_same(unflatten_state(tensors, skeleton), obj)


def test_flatten_rejects_unsupported_types_naming_the_path():
    with pytest.raises(TypeError, match=r"opt\.0\.fn"):
        flatten_state({"opt": [{"fn": lambda: 0}]})
    with pytest.raises(TypeError, match="dict key"):
        flatten_state({(1, 2): 3})


def test_save_load_round_trips_adamw_scheduler_rng_and_cursor(tmp_path):
    model, opt, sched, rng, cursor = training_state()
    mgr = CheckpointManager(tmp_path / "ckpt")
    parts = {"drafter": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
             "cursor": cursor}
    path = mgr.save(3, parts, per_rank_parts={"rng": rng}, config={"optim": {"lr": 1e-3}, "seed": 0})
    assert path == tmp_path / "ckpt" / "step_00000003"
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_00000003"
    names = {p.name for p in path.iterdir()}
    assert names == {"drafter.safetensors", "drafter.json", "optimizer.safetensors", "optimizer.json",
                     "scheduler.safetensors", "scheduler.json", "cursor.safetensors", "cursor.json",
                     "rng_rank0.safetensors", "rng_rank0.json", "config.json", "manifest.json"}
    assert all(n.endswith((".json", ".safetensors")) for n in names)

    step, loaded, config = mgr.load_latest()
    assert step == 3 and config == {"optim": {"lr": 1e-3}, "seed": 0}
    assert_same(loaded["optimizer"], opt.state_dict())  # incl. AdamW's `step` tensors and int param ids
    assert_same(loaded["scheduler"], sched.state_dict())
    assert_same(loaded["drafter"], model.state_dict())
    assert_same(loaded["cursor"], cursor)
    assert_same(loaded["rng"], rng)

    # The restored states drive the real objects to identical futures.
    model2, opt2, sched2, _, _ = training_state(seed=1)
    model2.load_state_dict(loaded["drafter"])
    opt2.load_state_dict(loaded["optimizer"])
    sched2.load_state_dict(loaded["scheduler"])
    x = torch.randn(2, 4, dtype=torch.bfloat16)
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        m(x).float().pow(2).mean().backward()
        o.step()
        s.step()
    for p1, p2 in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p1, p2)
    assert sched.get_last_lr() == sched2.get_last_lr()
    torch.set_rng_state(loaded["rng"]["torch"])
    after_load = torch.rand(3)
    torch.set_rng_state(rng["torch"])
    assert torch.equal(torch.rand(3), after_load)
    random.setstate(loaded["rng"]["python"])
    after_load_py = random.random()
    random.setstate(rng["python"])
    assert random.random() == after_load_py
    g = np.random.default_rng()
    g.bit_generator.state = loaded["rng"]["numpy"]
    ref = np.random.default_rng(0)
    ref.random(3)
    assert g.random() == ref.random()


def test_export_fn_files_are_covered_by_the_manifest(tmp_path):
    mgr = CheckpointManager(tmp_path)

    def export(d: Path):
        (d / "export").mkdir()
        (d / "export" / "config.json").write_text('{"architectures": ["DFlashDraftModel"]}')
        (d / "export" / "model.safetensors").write_bytes(b"x" * 100)

    path = mgr.save(1, {"m": {"w": torch.ones(2)}}, export_fn=export)
    manifest = verify_checkpoint(path)
    assert {"export/config.json", "export/model.safetensors"} <= set(manifest["files"])
    (path / "export" / "model.safetensors").write_bytes(b"y" * 100)  # same size, different bytes
    with pytest.raises(CheckpointError, match="sha256"):
        verify_checkpoint(path)


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "delete_manifest", "delete_part", "garble_manifest",
                                    "manifest_escapes_dir"])
def test_damaged_newest_checkpoint_is_skipped_and_previous_loaded(tmp_path, caplog, damage):
    mgr = CheckpointManager(tmp_path, keep_last=3)
    for step in (10, 20):
        mgr.save(step, {"m": {"w": torch.full((1000,), float(step))}})
    newest = tmp_path / "step_00000020"
    f = newest / "m.safetensors"
    if damage == "flip_byte":
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-7])
    elif damage == "delete_manifest":
        (newest / "manifest.json").unlink()
    elif damage == "delete_part":
        f.unlink()
    elif damage == "garble_manifest":
        (newest / "manifest.json").write_text("{not json")
    else:
        manifest = json.loads((newest / "manifest.json").read_text())
        manifest["files"]["../step_00000010/m.safetensors"] = manifest["files"].pop("m.safetensors")
        (newest / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="flashdraft.checkpoint"):
        step, parts, _ = mgr.load_latest()
    assert step == 10 and torch.equal(parts["m"]["w"], torch.full((1000,), 10.0))
    assert "skipping checkpoint" in caplog.text and "step_00000020" in caplog.text
    with pytest.raises(CheckpointError):
        mgr.load(newest)


def test_newest_complete_checkpoint_wins_over_a_stale_latest_pointer(tmp_path):
    # A crash between the rename and the pointer update leaves `latest` one checkpoint behind.
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"m": {"v": 1}})
    mgr.save(2, {"m": {"v": 2}})
    (tmp_path / "latest").write_text("step_00000001\n")
    assert mgr.load_latest().step == 2


def test_no_checkpoint_returns_none_and_stale_tmp_dirs_are_removed(tmp_path, caplog):
    mgr = CheckpointManager(tmp_path / "missing")
    assert mgr.load_latest() is None
    mgr = CheckpointManager(tmp_path)
    stale = tmp_path / ".tmp-step_00000005-123"
    stale.mkdir()
    (stale / "m.safetensors").write_bytes(b"partial")
    with caplog.at_level(logging.WARNING, logger="flashdraft.checkpoint"):
        assert mgr.load_latest() is None
    assert not stale.exists() and "stale partial checkpoint" in caplog.text


def test_keep_last_prunes_old_checkpoints_but_keeps_latest(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=2)
    for step in range(1, 6):
        mgr.save(step * 100, {"m": {"step": step}})
    assert [p.name for p in mgr.checkpoints()] == ["step_00000500", "step_00000400"]
    assert (tmp_path / "latest").read_text().strip() == "step_00000500"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    # Resuming from 400 and saving 450 abandons the old 500: it must not be resumed from next time.
    mgr.save(450, {"m": {"step": 4.5}})
    assert [p.name for p in mgr.checkpoints()] == ["step_00000450", "step_00000400"]
    assert mgr.load_latest().step == 450


def test_resaving_the_same_step_keeps_the_old_copy_aside(tmp_path):
    # A run resumed from an earlier step saving step 5 again: its step 5 is the one to resume
    # from; the abandoned timeline's step 5 is kept, like its newer checkpoints, never deleted.
    mgr = CheckpointManager(tmp_path)
    mgr.save(5, {"m": {"v": 1}})
    mgr.save(5, {"m": {"v": 2}})
    assert mgr.load_latest().parts["m"] == {"v": 2}
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "latest") == [
        "abandoned-step_00000005", "step_00000005"]
    assert CheckpointManager(tmp_path).load(tmp_path / "abandoned-step_00000005").parts["m"] == {"v": 1}


def test_a_crash_between_the_two_renames_of_a_resave_keeps_the_step(tmp_path, monkeypatch):
    """Re-saving step 5 moves the old copy aside, then renames the new one in. Dying between the
    two renames must not lose step 5: the next load restores the old copy."""
    mgr = CheckpointManager(tmp_path)
    mgr.save(5, {"m": {"v": 1}})
    real_replace, calls = os.replace, []

    def dies_on_the_second_rename(src, dst):
        calls.append(dst)
        if len(calls) == 2 and Path(dst).name == "step_00000005":
            raise KeyboardInterrupt  # the process is killed here
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", dies_on_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(5, {"m": {"v": 2}})
    monkeypatch.setattr(os, "replace", real_replace)
    assert not (tmp_path / "step_00000005").exists()  # the moment of the crash
    loaded = CheckpointManager(tmp_path).load_latest()
    assert loaded.step == 5 and loaded.parts["m"] == {"v": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000005"]


def _assert_previous_intact(tmp_path: Path, mgr: CheckpointManager):
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert [p.name for p in mgr.checkpoints()] == ["step_00000001"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]
    step, parts, _ = mgr.load_latest()
    assert step == 1 and torch.equal(parts["m"]["w"], torch.ones(3))


@pytest.mark.parametrize("where", ["safetensors_write", "fsync", "manifest_write"])
def test_disk_full_raises_naming_the_path_and_keeps_previous(tmp_path, monkeypatch, where):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"m": {"w": torch.ones(3)}})

    def enospc(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "safetensors_write":
        monkeypatch.setattr(ckpt.safetensors.torch, "save_file", enospc)
    elif where == "fsync":
        monkeypatch.setattr(ckpt, "_fsync_file", enospc)
    else:
        real = ckpt._write_json
        monkeypatch.setattr(ckpt, "_write_json", lambda p, o: enospc() if p.name == "manifest.json" else real(p, o))
    with pytest.raises(CheckpointError, match=r"step_00000002.*No space left on device"):
        mgr.save(2, {"m": {"w": torch.zeros(3)}}, config={"a": 1})
    monkeypatch.undo()
    _assert_previous_intact(tmp_path, mgr)


def test_unwritable_output_dir_raises_naming_the_path(tmp_path):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the output directory should be")
    with pytest.raises(CheckpointError, match="not_a_dir"):
        CheckpointManager(blocker / "ckpt").save(1, {"m": {"x": 1}})


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_output_dir_raises_and_keeps_previous(tmp_path):
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, {"m": {"w": torch.ones(3)}})
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match=str(tmp_path)):
            mgr.save(2, {"m": {"w": torch.zeros(3)}})
    finally:
        tmp_path.chmod(0o755)
    _assert_previous_intact(tmp_path, mgr)


def test_invalid_part_names_are_rejected(tmp_path):
    mgr = CheckpointManager(tmp_path)
    for bad in ("manifest", "a/b", "rng_rank0", "", ".hidden"):
        with pytest.raises(ValueError, match="part name"):
            mgr.save(1, {bad: {}})
    with pytest.raises(ValueError, match="unique"):
        mgr.save(1, {"rng": {}}, per_rank_parts={"rng": {}})


def test_sigkill_during_save_never_loses_the_last_good_checkpoint(tmp_path, forkserver):
    """A writer killed at random moments (mid-file, mid-manifest, mid-rename, mid-prune) leaves
    the newest checkpoint it completed (or the one after it) loadable, and never a damaged one."""
    rnd = random.Random(1234)
    for trial in range(6):
        root = tmp_path / f"trial{trial}"
        CheckpointManager(root, keep_last=2).save(0, {"model": {"w": torch.zeros(1), "marker": torch.zeros(4)},
                                                      "meta": {"step": 0}})
        pid, out = forkserver.spawn("checkpoint_writer", str(root))
        deadline = time.monotonic() + 30
        while "writing" not in read_log(out):
            assert time.monotonic() < deadline and forkserver.wait(pid, 0) is None, read_log(out)
            time.sleep(0.005)
        time.sleep(rnd.uniform(0.0, 0.7))  # one save takes ~0.2-0.3 s here
        forkserver.kill(pid)
        assert forkserver.wait(pid, 10) == -signal.SIGKILL, out.read_text()
        saved = [0] + [int(ln.split()[1]) for ln in out.read_text().splitlines() if ln.startswith("saved")]
        mgr = CheckpointManager(root, keep_last=2)
        step, parts, _ = mgr.load_latest()
        # The save after the last reported one may have completed just before the kill.
        assert step in (saved[-1], saved[-1] + 1), (step, saved)
        assert parts["meta"] == {"step": step}
        assert torch.equal(parts["model"]["marker"], torch.full((4,), step))
        verify_checkpoint(root / (root / "latest").read_text().strip())  # the pointer names a complete one
        assert not [p for p in root.iterdir() if p.name.startswith(".tmp")]  # stale temp dirs removed


def test_two_gloo_ranks_save_and_get_back_their_own_rng(tmp_path, forkserver):
    found = results(run_ranks(forkserver, "checkpoint_per_rank_rng", str(tmp_path)))
    for r in found:
        assert r["visible"] and r["same"] and r["step"] == 7 and r["config"] == {"seed": 0}
        assert r["w"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert {"rng_rank0.safetensors", "rng_rank1.safetensors", "rng_rank0.json", "rng_rank1.json"} <= set(r["files"])
    manifest = verify_checkpoint(tmp_path / "step_00000007")
    assert manifest["world_size"] == 2 and manifest["per_rank_parts"] == ["rng"]
    # A single process resuming that checkpoint gets rank 0's state; a rank 2 would get none.
    single = CheckpointManager(tmp_path)
    assert "rng" in single.load(tmp_path / "step_00000007", rank=0).parts
    assert "rng" not in single.load(tmp_path / "step_00000007", rank=2).parts


def test_failed_save_on_rank_0_raises_on_every_rank(tmp_path, forkserver):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for r in results(run_ranks(forkserver, "checkpoint_save_fails_everywhere", str(blocker / "ckpt"))):
        assert r["error"] and "could not save checkpoint step 1" in r["error"] and str(blocker) in r["error"]
        assert r["waited_s"] < 20  # told by rank 0, not timed out


def _edit_manifest(path, edit):
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def test_a_format_2_manifest_has_no_digest_and_loads_a_format_3_one_must(tmp_path, monkeypatch):
    mgr = CheckpointManager(tmp_path / "ckpt")
    with monkeypatch.context() as m:  # what format 2 wrote: no digest
        m.setattr(ckpt, "VERSION", 2)
        old = mgr.save(2, {"model": {"w": torch.ones(3)}})
    _edit_manifest(old, lambda m: m.pop("digest"))
    assert mgr.load(old).version == 2
    new = mgr.save(3, {"model": {"w": torch.ones(3)}})
    _edit_manifest(new, lambda m: m.pop("digest"))
    with pytest.raises(CheckpointError, match="digest does not match"):
        verify_checkpoint(new)


@pytest.mark.parametrize("how", ["drop_a_file_entry", "world_size", "entry_outside", "unlisted_file",
                                 "symlink_out", "drop_a_part_and_its_entries"])
def test_a_manifest_edited_into_valid_json_is_refused(tmp_path, how):
    """The manifest vouches for every file; its own edits must not pass (a dropped entry would
    hide a swapped file, another world_size would hand ranks another's RNG)."""
    mgr = CheckpointManager(tmp_path / "ckpt")
    path = mgr.save(3, {"model": {"w": torch.ones(3)}, "opt": {"m": torch.zeros(2)}},
                    per_rank_parts={"rng": {"s": torch.arange(4)}})
    if how == "drop_a_file_entry":
        _edit_manifest(path, lambda m: m["files"].pop("opt.safetensors"))
        match = "digest does not match"
    elif how == "world_size":
        _edit_manifest(path, lambda m: m.update(world_size=2))
        match = "digest does not match"
    elif how == "entry_outside":
        (tmp_path / "outside.bin").write_bytes(b"x")

        def outside(m):
            m["files"]["sub/../../../outside.bin"] = {"size": 1, "sha256": sha256_file(tmp_path / "outside.bin")}
            m["digest"] = ckpt.manifest_digest(m)
        _edit_manifest(path, outside)
        match = "must lie inside the checkpoint"
    elif how == "unlisted_file":
        (path / "extra.safetensors").write_bytes(b"planted")
        match = "files not in the manifest: extra.safetensors"
    elif how == "symlink_out":
        (tmp_path / "secret").write_text("s")
        os.symlink(tmp_path / "secret", path / "opt.json.link")
        match = "files not in the manifest: opt.json.link"
    else:  # a consistent-looking manifest that no longer lists a part's files
        def drop(m):
            m["files"].pop("opt.safetensors")
            m["files"].pop("opt.json")
            m["digest"] = ckpt.manifest_digest(m)
        _edit_manifest(path, drop)
        (path / "opt.safetensors").unlink()
        (path / "opt.json").unlink()
        match = "the manifest's parts lack their files"
    with pytest.raises(CheckpointError, match=match):
        verify_checkpoint(path)
    assert mgr.load_latest() is None  # skipped as damaged, with a warning
