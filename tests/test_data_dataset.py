"""open_dataset: token shards, HF save_to_disk dirs and parquet, conversion cache, validation."""

import shutil

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashdraft.data.dataset import open_dataset
from flashdraft.data.shards import write_token_shard


def make_rows(n=40, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, vocab, int(k)).tolist() for k in rng.integers(1, 60, n)]
    mask = [[0] * (len(x) // 2) + [1] * (len(x) - len(x) // 2) for x in ids]
    return ids, mask


def save_hf(path, ids, mask):
    # As the seed pipeline stored its data: int64 lists (what `datasets` writes for tokenizer
    # output / Python ints from map), plus seq_len.
    features = datasets.Features({
        "input_ids": datasets.List(datasets.Value("int64")),
        "loss_mask": datasets.List(datasets.Value("int64")),
        "seq_len": datasets.Value("int64"),
    })
    ds = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask, "seq_len": [len(x) for x in ids]},
                                    features=features)
    assert ds.features["input_ids"].feature.dtype == "int64"
    ds.save_to_disk(str(path))
    return path


def assert_same(ds, ids, mask):
    assert len(ds) == len(ids)
    for i in range(len(ids)):
        got_ids, got_mask = ds[i]
        assert got_ids.tolist() == ids[i] and got_mask.tolist() == mask[i]


def test_hf_save_to_disk_is_accepted_and_cached(tmp_path):
    ids, mask = make_rows()
    src = save_hf(tmp_path / "hf", ids, mask)
    ds = open_dataset(src, progress=False)
    assert_same(ds, ids, mask)
    assert ds.lengths.dtype == np.int64 and ds.num_tokens == sum(map(len, ids))
    assert ds.ids.dtype == np.uint16  # narrowed from int64
    assert ds.report.kept == ds.report.samples_seen == len(ids)
    cached = ds.path
    assert cached.parent == tmp_path / ".flashdraft-cache"
    stamp = (cached / "input_ids.bin").stat().st_mtime_ns
    again = open_dataset(src, progress=False)  # second open: the cache, not a new conversion
    assert again.path == cached and (cached / "input_ids.bin").stat().st_mtime_ns == stamp


def test_changed_source_gets_new_cache_entry(tmp_path):
    ids, mask = make_rows()
    src = save_hf(tmp_path / "hf", ids, mask)
    first = open_dataset(src, progress=False, cache_dir=tmp_path / "cache").path
    ids2, mask2 = make_rows(seed=1)
    save_hf(tmp_path / "hf2", ids2, mask2)
    shutil.rmtree(src)
    shutil.copytree(tmp_path / "hf2", src)
    second = open_dataset(src, progress=False, cache_dir=tmp_path / "cache")
    assert second.path != first
    assert_same(second, ids2, mask2)


def test_hf_dataset_dict_uses_train_split(tmp_path):
    ids, mask = make_rows()
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask})})
    dd.save_to_disk(str(tmp_path / "dd"))
    assert_same(open_dataset(tmp_path / "dd", progress=False), ids, mask)


def test_parquet_file_and_directory(tmp_path):
    ids, mask = make_rows(60)
    table = pa.table({"input_ids": ids, "loss_mask": mask})
    assert table.schema.field("input_ids").type == pa.list_(pa.int64())
    pq.write_table(table, tmp_path / "one.parquet")
    assert_same(open_dataset(tmp_path / "one.parquet", progress=False), ids, mask)
    (tmp_path / "dir").mkdir()
    pq.write_table(table.slice(0, 25), tmp_path / "dir" / "part-0.parquet")
    pq.write_table(table.slice(25), tmp_path / "dir" / "part-1.parquet")
    assert_same(open_dataset(tmp_path / "dir", progress=False), ids, mask)


def test_bool_mask_and_large_vocab(tmp_path):
    ids = [[70_000, 1, 2], [5]]
    mask = [[False, True, True], [True]]
    pq.write_table(pa.table({"input_ids": ids, "loss_mask": mask}), tmp_path / "p.parquet")
    ds = open_dataset(tmp_path / "p.parquet", progress=False)
    assert ds.ids.dtype == np.uint32
    assert_same(ds, ids, [[0, 1, 1], [1]])


def test_missing_column_names_fix(tmp_path):
    pq.write_table(pa.table({"input_ids": [[1, 2]]}), tmp_path / "p.parquet")
    with pytest.raises(ValueError, match="no column 'loss_mask'.*flashdraft prepare"):
        open_dataset(tmp_path / "p.parquet", progress=False)


def test_unknown_path_names_accepted_forms(tmp_path):
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="save_to_disk.*parquet"):
        open_dataset(tmp_path / "x.txt")


# --- validation: every problem names the file, the sample and the fix; drop mode counts ---


def test_mask_length_mismatch(tmp_path):
    ids, mask = make_rows(10)
    mask[3] = mask[3] + [1]
    src = save_hf(tmp_path / "hf", ids, mask)
    with pytest.raises(ValueError) as err:
        open_dataset(src, progress=False)
    msg = str(err.value)
    assert str(src.resolve()) in msg and "sample 3:" in msg and "mask_length_mismatch" in msg
    assert f"input_ids has {len(ids[3])} tokens but loss_mask has {len(ids[3]) + 1}" in msg
    assert "same tokenization" in msg and "data.on_invalid=drop" in msg
    ds = open_dataset(src, progress=False, on_invalid="drop")
    assert ds.report.dropped == {"mask_length_mismatch": 1} and len(ds) == 9
    assert 3 not in ds.source_index.tolist()
    assert ds[3][0].tolist() == ids[4]  # indices after the dropped one shift, data stays right


def test_ids_out_of_range(tmp_path):
    ids, mask = make_rows(10, vocab=500)
    ids[6][0] = 900
    src = write_token_shard(tmp_path / "s", zip(ids, mask), vocab_size=1000)
    with pytest.raises(ValueError) as err:
        open_dataset(src, vocab_size=500)
    msg = str(err.value)
    assert str(src) in msg and "sample 6: token id 900 is >= vocab_size 500" in msg
    assert "re-tokenize with the target's tokenizer" in msg
    ds = open_dataset(src, vocab_size=500, on_invalid="drop")
    assert ds.report.dropped == {"id_out_of_range": 1} and ds.vocab_size == 500
    assert len(open_dataset(src, vocab_size=1000)) == 10


def test_negative_ids_in_source(tmp_path):
    ids, mask = make_rows(5)
    ids[2][1] = -4
    src = save_hf(tmp_path / "hf", ids, mask)
    with pytest.raises(ValueError, match=r"(?s)sample 2: token ids span \[-4, .*re-tokenize"):
        open_dataset(src, progress=False)
    assert open_dataset(src, progress=False, on_invalid="drop").report.dropped == {"id_out_of_range": 1}


def test_empty_samples(tmp_path):
    ids, mask = make_rows(6)
    ids[4], mask[4] = [], []
    src = save_hf(tmp_path / "hf", ids, mask)
    with pytest.raises(ValueError, match=r"(?s)sample 4: has no tokens.*fix: remove empty samples.*on_invalid=drop"):
        open_dataset(src, progress=False)
    ds = open_dataset(src, progress=False, on_invalid="drop")
    assert ds.report.dropped == {"empty": 1} and ds.report.kept == 5


def test_too_few_supervised(tmp_path):
    ids = [[1] * 20, [2] * 20, [3] * 20]
    mask = [[1] * 20, [0] * 18 + [1] * 2, [0] * 10 + [1] * 10]
    src = write_token_shard(tmp_path / "s", zip(ids, mask), vocab_size=10)
    with pytest.raises(ValueError) as err:
        open_dataset(src, min_supervised=8)
    msg = str(err.value)
    assert "sample 1: 2 supervised tokens (loss_mask=1), fewer than min_supervised=8" in msg
    assert "lower data.min_supervised" in msg and "sample 2" not in msg
    # Truncation counts: sample 2 keeps only 4 supervised tokens of its first 14.
    with pytest.raises(ValueError, match=r"sample 2: 4 supervised"):
        open_dataset(src, min_supervised=8, max_length=14)
    ds = open_dataset(src, min_supervised=8, max_length=14, on_invalid="drop")
    assert ds.report.dropped == {"too_few_supervised": 2} and ds.report.truncated == 1
    assert ds.lengths.tolist() == [14]


def test_truncation_is_not_an_error(tmp_path):
    ids, mask = make_rows(30)
    src = write_token_shard(tmp_path / "s", zip(ids, mask), vocab_size=1000)
    ds = open_dataset(src, max_length=16)
    assert ds.lengths.max() <= 16 and ds.report.truncated == sum(len(x) > 16 for x in ids)
    for i in range(len(ids)):
        assert ds[i][0].tolist() == ids[i][:16] and ds[i][1].tolist() == mask[i][:16]


def test_null_row(tmp_path):
    table = pa.table({"input_ids": [[1, 2], None, [3]], "loss_mask": [[1, 1], [1], [1]]})
    pq.write_table(table, tmp_path / "p.parquet")
    with pytest.raises(ValueError, match=r"(?s)sample 1: is null.*fix: remove the null row"):
        open_dataset(tmp_path / "p.parquet", progress=False)
    ds = open_dataset(tmp_path / "p.parquet", progress=False, on_invalid="drop")
    assert ds.report.dropped == {"null_row": 1} and [ds[i][0].tolist() for i in range(2)] == [[1, 2], [3]]


def test_supervised_counts_after_truncation_vectorised(tmp_path):
    # Enough truncated samples to take the vectorised path, with the last one ending the file.
    rng = np.random.default_rng(3)
    ids = [rng.integers(0, 50, int(n)).tolist() for n in rng.integers(30, 80, 3000)]
    mask = [rng.integers(0, 2, len(x)).tolist() for x in ids]
    src = write_token_shard(tmp_path / "s", zip(ids, mask), vocab_size=50)
    ds = open_dataset(src, max_length=25, min_supervised=12, on_invalid="drop")
    want = [sum(m[:25]) for m in mask]
    kept = [i for i, w in enumerate(want) if w >= 12]
    assert ds.source_index.tolist() == kept and ds.report.truncated == len(kept)
    assert ds.num_supervised().tolist() == [want[i] for i in kept]
