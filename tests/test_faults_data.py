"""Data surprises at scale (issue 8): random malformed token shards and tokenized conversation
files. Every one is either refused at open with a ValueError / FileNotFoundError naming the file,
or opened with its bad samples dropped and counted -- and then every batch the trainer would
build from it holds only valid samples. Never an IndexError, KeyError or TypeError, and never
a bad id reaching the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from flashdraft.cli import main
from flashdraft.data.batching import BatchSampler
from flashdraft.data.collate import pad_batch
from flashdraft.data.dataset import open_dataset
from flashdraft.data.shards import write_token_shard

VOCAB = 300
MAX_LENGTH = 48
BUDGET = 96
MIN_SUP = 4

samples_st = st.lists(
    st.integers(1, 60).flatmap(lambda n: st.tuples(
        st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n),
        st.lists(st.integers(0, 1), min_size=n, max_size=n))),
    min_size=1, max_size=12)

MUTATIONS = ["none", "truncate_ids", "truncate_mask", "truncate_offsets", "delete_file", "garble_meta",
             "meta_missing_key", "meta_ids_dtype", "meta_lie_max_id", "meta_lie_counts", "offsets_decreasing",
             "offsets_out_of_range", "mask_values", "lie_num_supervised", "out_of_vocab", "empty_sample",
             "huge_sample"]


def _mutate(shard: Path, kind: str, data) -> None:
    meta_path = shard / "meta.json"
    meta = json.loads(meta_path.read_text())
    ids_path, offsets_path = shard / "input_ids.bin", shard / "offsets.bin"
    if kind.startswith("truncate_"):
        f = {"ids": ids_path, "mask": shard / "loss_mask.bin", "offsets": offsets_path}[kind[9:]]
        f.write_bytes(f.read_bytes()[: data.draw(st.integers(0, max(0, f.stat().st_size - 1)))])
    elif kind == "delete_file":
        (shard / data.draw(st.sampled_from(["input_ids.bin", "loss_mask.bin", "offsets.bin", "meta.json"]))).unlink()
    elif kind == "garble_meta":
        meta_path.write_text(meta_path.read_text()[: data.draw(st.integers(0, 20))])
    elif kind == "meta_missing_key":
        del meta[data.draw(st.sampled_from(["num_samples", "num_tokens", "ids_dtype", "vocab_size"]))]
        meta_path.write_text(json.dumps(meta))
    elif kind == "meta_ids_dtype":
        meta["ids_dtype"] = data.draw(st.sampled_from(["float32", "int8", "uint8", "int64", "bogus", "float16"]))
        meta_path.write_text(json.dumps(meta))
    elif kind == "meta_lie_max_id":  # meta claims small ids; the file holds an out-of-vocab one
        ids = np.fromfile(ids_path, dtype=meta["ids_dtype"])
        ids[data.draw(st.integers(0, len(ids) - 1))] = 5000
        ids.tofile(ids_path)
        meta["max_id"] = 10
        meta_path.write_text(json.dumps(meta))
    elif kind == "meta_lie_counts":
        meta[data.draw(st.sampled_from(["num_samples", "num_tokens"]))] += data.draw(st.sampled_from([-1, 1, 1000]))
        meta_path.write_text(json.dumps(meta))
    elif kind in ("offsets_decreasing", "offsets_out_of_range"):
        offsets = np.fromfile(offsets_path, dtype=np.int64)
        if len(offsets) > 2:
            i = data.draw(st.integers(1, len(offsets) - 2))
            offsets[i] = offsets[i + 1] + 1 if kind == "offsets_decreasing" else -5
            offsets.tofile(offsets_path)
    elif kind == "mask_values":
        mask = np.fromfile(shard / "loss_mask.bin", dtype=np.uint8)
        mask[data.draw(st.integers(0, len(mask) - 1))] = data.draw(st.sampled_from([2, 7, 255]))
        mask.tofile(shard / "loss_mask.bin")
    elif kind == "lie_num_supervised":  # claims every sample is fully supervised
        offsets = np.fromfile(offsets_path, dtype=np.int64)
        np.diff(offsets).astype(np.int32).tofile(shard / "num_supervised.bin")


def _check_usable(ds, trust_supervised_counts: bool = True) -> None:
    """What the trainer does with an opened dataset, and what every batch must satisfy.

    Any non-zero loss_mask byte counts as supervised (as in the objective). A shard whose
    num_supervised.bin lies can let a sample with too few supervised tokens through; it then
    carries little or zero loss weight -- harmless, so only checked when the counts are true."""
    sampler = BatchSampler(ds.lengths, token_budget=max(BUDGET, int(ds.lengths.max(initial=1))), max_batch_size=4,
                           seed=0, num_epochs=1)
    for _, _, idx in sampler:
        batch = pad_batch(ds, idx)
        real = batch.attention_mask.bool()
        assert int(batch.input_ids[real].max()) < VOCAB and int(batch.input_ids.min()) >= 0
        assert int(batch.lengths.min()) >= 1 and int(batch.lengths.max()) <= MAX_LENGTH
        if trust_supervised_counts:
            assert ((batch.loss_mask != 0).sum(1) >= MIN_SUP).all()


@settings(max_examples=120, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(samples=samples_st, kind=st.sampled_from(MUTATIONS), on_invalid=st.sampled_from(["raise", "drop"]),
       data=st.data())
def test_malformed_shards_are_refused_naming_the_file_or_dropped_and_counted(tmp_path_factory, samples, kind,
                                                                              on_invalid, data):
    shard = tmp_path_factory.mktemp("shard") / "data"
    vocab = VOCAB
    if kind == "out_of_vocab":
        vocab = 70000  # a tokenizer with more ids than the target: uint32 ids, some >= the target's vocab
        i = data.draw(st.integers(0, len(samples) - 1))
        samples[i] = ([*samples[i][0], 65000], [*samples[i][1], 1])
    elif kind == "empty_sample":
        samples.insert(data.draw(st.integers(0, len(samples))), ([], []))
    elif kind == "huge_sample":
        samples.append(([i % VOCAB for i in range(10_000)], [1] * 10_000))
    write_token_shard(shard, [(np.array(i, np.int64), np.array(m, np.uint8)) for i, m in samples], vocab_size=vocab)
    _mutate(shard, kind, data)
    try:
        ds = open_dataset(shard, vocab_size=VOCAB, max_length=MAX_LENGTH, min_supervised=MIN_SUP,
                          on_invalid=on_invalid, progress=False)
    except (ValueError, FileNotFoundError) as exc:
        assert str(shard) in str(exc), f"{kind}: the error does not name the shard: {exc}"
        return
    assert ds.report.kept + ds.report.num_dropped == ds.report.samples_seen
    try:
        _check_usable(ds, trust_supervised_counts=kind != "lie_num_supervised")
    except ValueError as exc:  # found while batching (a lie in the metadata): still named, never deep inside
        assert str(shard) in str(exc) and "sample" in str(exc), f"{kind}: {exc}"


# ---- tokenized conversations as users bring them (parquet) ---------------------------------

ROW_KINDS = ["ok", "null_row", "mask_longer", "negative_id", "huge_id", "out_of_vocab", "empty", "no_supervised",
             "huge"]


def _row(kind: str, rng: np.random.Generator):
    n = int(rng.integers(8, 40))
    ids = rng.integers(0, VOCAB, n).tolist()
    mask = [0] * 4 + [1] * (n - 4)
    if kind == "null_row":
        return None, None
    if kind == "mask_longer":
        mask = mask + [1]
    elif kind == "negative_id":
        ids[1] = -3
    elif kind == "huge_id":
        ids[2] = 2**40
    elif kind == "out_of_vocab":
        ids[3] = VOCAB + 7
    elif kind == "empty":
        ids, mask = [], []
    elif kind == "no_supervised":
        mask = [0] * n
    elif kind == "huge":
        ids, mask = list(range(1, 250)) * 20, [1] * 4980
    return ids, mask


@settings(max_examples=40, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kinds=st.lists(st.sampled_from(ROW_KINDS), min_size=1, max_size=20), seed=st.integers(0, 2**16),
       id_type=st.sampled_from([pa.int64(), pa.int32(), pa.uint32()]))
def test_malformed_conversations_in_parquet_are_dropped_and_counted_by_row(tmp_path_factory, kinds, seed, id_type):
    rng = np.random.default_rng(seed)
    rows = [_row(k, rng) for k in kinds]
    if id_type != pa.int64():  # narrower id columns cannot hold the out-of-range ids
        rows = [r if r[0] is None or all(0 <= i < 2**31 for i in r[0]) else ([1] * 8, [1] * 8) for r in rows]
    path = tmp_path_factory.mktemp("conv") / "chats.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([r[0] for r in rows], pa.list_(id_type)),
                             "loss_mask": pa.array([r[1] for r in rows], pa.list_(pa.int8()))}), path)
    ds = open_dataset(path, vocab_size=VOCAB, max_length=MAX_LENGTH, min_supervised=MIN_SUP, on_invalid="drop",
                      progress=False)
    assert ds.report.kept + ds.report.num_dropped == len(rows)
    if ds.report.num_dropped:
        with pytest.raises(ValueError, match=str(path)):
            open_dataset(path, vocab_size=VOCAB, max_length=MAX_LENGTH, min_supervised=MIN_SUP, on_invalid="raise",
                         progress=False)
    if len(ds):
        _check_usable(ds)


def test_non_integer_token_ids_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"input_ids": pa.array([[1.5, 2.0, 3.0, 4.0]], pa.list_(pa.float64())),
                             "loss_mask": pa.array([[1, 1, 1, 1]], pa.list_(pa.int8()))}), path)
    with pytest.raises(ValueError, match=r"(?s)floats.parquet.*input_ids.*integer"):
        open_dataset(path, vocab_size=VOCAB, progress=False)


# ---- resuming the data cursor ----------------------------------------------------------------


def _run(lengths, plan: list[tuple[int, int | None]], state=None) -> tuple[list[np.ndarray], int]:
    """Run segments [(world_size, steps or None = to the epoch's end)], each resumed from the
    previous one's cursor, all ranks in lockstep; returns every batch trained on and the number
    of samples dropped (counted, logged) by the remainder rule."""
    seen, dropped = [], 0
    for world, steps in plan:
        samplers = [BatchSampler(lengths, token_budget=3, max_batch_size=6, seed=7, rank=r, world_size=world,
                                 num_epochs=1) for r in range(world)]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        its = [iter(s) for s in samplers]
        n = 0
        while steps is None or n < steps:
            items = [next(it, None) for it in its]
            if items[0] is None:
                break
            seen += [idx for _, _, idx in items]
            n += 1
        state = samplers[0].state_dict()
        dropped += samplers[0].dropped.get(0, 0)
    return seen, dropped


def test_resuming_mid_epoch_with_a_remainder_step_is_exact_and_covers_the_epoch_across_world_changes():
    """10 samples in 4 batches on 3 ranks: the remainder rule moves a batch to the epoch's last
    step. The cursor used to assume plan order, so a resume re-trained one batch and skipped
    another (found by test_data_batching's property test); now it records each run segment."""
    lengths = np.ones(10, np.int64)
    straight, _ = _run(lengths, [(3, None)])
    resumed, _ = _run(lengths, [(3, 1), (3, None)])
    assert [b.tolist() for b in resumed] == [b.tolist() for b in straight]
    for plan in ([(3, 1), (1, None)], [(3, 1), (2, 1), (1, None)], [(2, 1), (3, 1), (1, None)]):
        seen, dropped = _run(lengths, plan)
        flat = np.concatenate(seen)
        assert len(set(flat.tolist())) == len(flat) and len(flat) + dropped == 10, plan


# ---- issue 31, 10: one-line errors where tracebacks were -----------------------------------------

@pytest.fixture(scope="module")
def qwen3_tokenizer(tmp_path_factory):
    from flashdraft.toy import train_toy_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tok"
    train_toy_tokenizer(template="qwen3").save_pretrained(path)
    return path


def test_prepare_explain_of_a_deep_record_or_a_huge_index_is_one_line(qwen3_tokenizer, tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}
    (tmp_path / "in.jsonl").write_text(json.dumps({**chat, "x": None}).replace("null", "[" * 5000 + "]" * 5000) + "\n")
    from flashdraft.data.prepare import explain

    said = explain([tmp_path / "in.jsonl"], qwen3_tokenizer, 0, min_supervised=1)
    assert said.startswith(f"{tmp_path / 'in.jsonl'}:1 (record 0) is dropped: bad_json: ")
    assert "nested too deeply" in said
    with pytest.raises(ValueError, match=r"--explain 10{30}: the inputs hold 1 records, numbered from 0"):
        explain([tmp_path / "in.jsonl"], qwen3_tokenizer, 10**30)


# ---- issue 31, the trial's re-run (h31b): defects its probes found -------------------------------

@pytest.mark.parametrize(("flag", "value"), [("--max-length", "0"), ("--block-size", "1"), ("--min-supervised", "-1")])
def test_prepare_refuses_bad_counts_before_reading_a_record(eval_dir, tmp_path, flag, value):
    (tmp_path / "chats.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match=rf"{flag} {value}: use"):
        main(["prepare", str(tmp_path / "chats.jsonl"), "--tokenizer", str(eval_dir / "target"),
              "--out", str(tmp_path / "shard"), flag, value])
