"""The target-feature cache: bit-exact round trips through RAM and disk, budgets, and a trainer
that skips the target forward in later epochs yet trains the same."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import overrides, results, run_ranks
from flashdraft.config import load_config
from flashdraft.data.shards import write_token_shard
from flashdraft.feed.cache import FeatureCache
from flashdraft.train.trainer import Trainer

F = 24  # feature size of the unit tests


def random_features(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(n, F, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ram_and_disk_round_trips_are_bit_exact(tmp_path, dtype):
    itemsize = torch.empty((), dtype=dtype).element_size()
    lengths = [7, 3, 12, 5, 9, 4]
    # RAM holds the first two samples (10 tokens); the rest go to disk.
    cache = FeatureCache(feature_size=F, dtype=dtype, ram_bytes=10 * F * itemsize, disk_bytes=10**6, directory=tmp_path)
    originals = {100 + k: random_features(n, dtype, k) for k, n in enumerate(lengths)}
    for sample_id, features in originals.items():
        assert cache.put(sample_id, features)
    stats = cache.stats()
    assert stats.ram_bytes == 10 * F * itemsize and stats.disk_bytes == (sum(lengths) - 10) * F * itemsize
    assert len(cache) == stats.entries == len(lengths)
    for sample_id, features in originals.items():
        got = cache.get(sample_id)
        assert got.dtype == dtype and torch.equal(got.view(torch.uint8), features.view(torch.uint8))
    # The scratch file is unlinked from the start: a crash leaves nothing behind.
    assert list(tmp_path.iterdir()) == []
    # A micro-batch in a new order, with a sample the cache lacks: padded rows are exact, pads are 0.
    ids = np.array([104, 101, 7, 102])
    found = cache.lookup(ids, torch.tensor([9, 3, 5, 12]), torch.device("cpu"))
    assert found.hit_rows == [0, 1, 3] and found.miss_rows == [2] and found.features.shape == (4, 12, F)
    for r, sample_id in zip(found.hit_rows, [104, 101, 102]):
        n = len(originals[sample_id])
        assert torch.equal(found.features[r, :n], originals[sample_id]) and not found.features[r, n:].any()
    assert not found.features[2].any()
    assert cache.stats().hits == 3 and cache.stats().misses == 1
    cache.close()
    assert len(cache) == 0


def test_ram_only_cache_needs_no_directory_and_refuses_wrong_features():
    cache = FeatureCache(feature_size=F, dtype=torch.float32, ram_bytes=1 << 20)
    x = random_features(5, torch.float32, 0)
    assert cache.put(3, x) and not cache.put(3, x)  # a second put of a held sample is a no-op
    x.zero_()  # the cache holds a copy, not a view of the caller's buffer
    assert torch.equal(cache.get(3), random_features(5, torch.float32, 0))
    with pytest.raises(ValueError, match=r"expected \[len, 24\] torch.float32"):
        cache.put(4, random_features(5, torch.bfloat16, 0))
    with pytest.raises(ValueError, match=r"expected \[len, 24\]"):
        cache.put(4, torch.zeros(5, F + 1))
    with pytest.raises(ValueError, match="needs a directory"):
        FeatureCache(feature_size=F, dtype=torch.float32, ram_bytes=0, disk_bytes=100)


class _Taps(torch.nn.Module):
    """A frozen stand-in target with the interface the cache calls: features per token from an
    embedding of the token id (so a sample's features are the same in every batch)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(100, F, dtype=torch.bfloat16)
        self.calls = 0

    def features(self, input_ids, attention_mask):
        self.calls += 1
        return self.embed(input_ids) * attention_mask[..., None]


def test_the_staging_pool_stays_bounded_over_an_epoch_of_varying_shapes(tmp_path):
    """Two epochs of 120 micro-batches of 1-8 samples of 1-400 tokens, through lookup and
    complete: the staging buffers are allocated a handful of times (a fresh [B, S, F] buffer per
    micro-batch kept every size the pinned allocator rounded to), they hold a few of the largest
    micro-batches, and every micro-batch's features are the target's, zeros in the padding."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 400, 480)
    tokens = [torch.from_numpy(rng.integers(1, 100, n)) for n in lengths.tolist()]
    target = _Taps().requires_grad_(False)
    ram = int(lengths[:300].sum()) * F * 2  # the RAM tier holds ~60%, the disk tier the rest
    cache = FeatureCache(feature_size=F, dtype=torch.bfloat16, ram_bytes=ram, disk_bytes=10**9, directory=tmp_path,
                         pin_memory=False, staging=4)
    order, largest, micro_batches = np.arange(480), 0, 0
    for epoch in range(2):
        rng.shuffle(order)
        start = 0
        while start < len(order):
            ids = order[start : start + int(rng.integers(1, 9))]
            start += len(ids)
            b, s = len(ids), int(lengths[ids].max())
            input_ids, mask = torch.zeros(b, s, dtype=torch.long), torch.zeros(b, s, dtype=torch.long)
            for r, i in enumerate(ids):
                input_ids[r, : lengths[i]], mask[r, : lengths[i]] = tokens[i], 1
            batch = type("Batch", (), {"input_ids": input_ids, "attention_mask": mask})
            found = cache.lookup(ids, torch.from_numpy(lengths[ids]), torch.device("cpu"))
            got = cache.complete(found, target, batch, ids, torch.from_numpy(lengths[ids]))
            expected = target.features(input_ids, mask)
            for r, i in enumerate(ids):
                assert torch.equal(got[r, : lengths[i]], expected[r, : lengths[i]]), (epoch, i)
                assert not got[r, lengths[i] :].any() or not found.hit_rows  # hits padded with zeros
            largest, micro_batches = max(largest, b * s * F * 2), micro_batches + 1
    stats = cache.stats()
    assert stats.entries == 480 and stats.hits == 480 and stats.ram_bytes <= ram and stats.disk_bytes
    assert micro_batches > 200
    assert cache.h2d_staging.allocations <= 4 * 6 and cache.d2h_staging.allocations <= 4 * 6  # grow by 1.5x
    assert cache.staging_bytes <= 2 * 4 * 1.5 * largest
    cache.close()


def test_new_samples_are_stored_once_their_copy_to_the_host_has_completed(monkeypatch):
    """On a GPU the new samples leave in one non-blocking copy with an event; the cache stores
    them when a later call finds the event completed (query), never waiting for it. Modelled
    with events the test completes; their room is reserved meanwhile."""
    import flashdraft.feed.cache as fc

    class Copy:
        done = False

        def query(self):
            return self.done

        def synchronize(self):
            raise AssertionError("the cache waited for a copy")

    events = []
    monkeypatch.setattr(fc, "record_event", lambda device: events.append(Copy()) or events[-1])
    cache = FeatureCache(feature_size=F, dtype=torch.bfloat16, ram_bytes=8 * F * 2, pin_memory=False)
    target, ids, lengths = _Taps().requires_grad_(False), np.array([5, 6]), torch.tensor([3, 4])
    batch = type("Batch", (), {"input_ids": torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7]]),
                               "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])})
    cache.complete(cache.lookup(ids, lengths, torch.device("cpu")), target, batch, ids, lengths)
    assert len(events) == 1 and len(cache) == 0  # in flight: not readable yet, its 7 tokens reserved
    assert not cache.has_room(2 * F * 2) and cache.has_room(F * 2)
    again = cache.lookup(ids, lengths, torch.device("cpu"))
    assert again.hit_rows == [] and target.calls == 1
    cache.complete(again, target, batch, ids, lengths)
    assert len(events) == 1  # the samples on their way are not copied twice
    events[0].done = True
    found = cache.lookup(ids, lengths, torch.device("cpu"))  # stores the completed copy first
    assert found.hit_rows == [0, 1] and len(cache) == 2 and cache.stats().ram_bytes == 7 * F * 2
    expected = target.features(batch.input_ids, batch.attention_mask)
    assert torch.equal(found.features[0, :3], expected[0, :3]) and torch.equal(found.features[1], expected[1])


def test_budgets_are_never_exceeded_and_the_first_samples_that_fit_stay(tmp_path):
    rng = np.random.default_rng(0)
    ram, disk = 1000 * F * 4, 3000 * F * 4
    cache = FeatureCache(feature_size=F, dtype=torch.float32, ram_bytes=ram, disk_bytes=disk, directory=tmp_path)
    kept, used = [], 0
    for sample_id, n in enumerate(rng.integers(1, 200, 80).tolist()):
        fits = cache.has_room(n * F * 4)
        assert cache.put(sample_id, random_features(n, torch.float32, sample_id)) == fits
        stats = cache.stats()
        assert stats.ram_bytes <= ram and stats.disk_bytes <= disk
        if fits:
            kept.append(sample_id)
            used += n * F * 4
        assert stats.ram_bytes + stats.disk_bytes == used
    assert len(kept) < 80 and used > 0.9 * (ram + disk)  # it filled up, then refused: nothing evicted
    assert all(i in cache for i in kept) and len(cache) == len(kept)
    assert all(torch.equal(cache.get(i), random_features(len(cache.get(i)), torch.float32, i)) for i in kept)


@pytest.mark.parametrize("bad, match", [
    ("pipeline.feature_cache_bytes=-1", "pipeline.feature_cache_bytes=-1 is invalid: use 0 .off. or a RAM budget"),
    ("pipeline.feature_cache_disk_bytes=-5", "pipeline.feature_cache_disk_bytes=-5 is invalid"),
    ("pipeline.feature_cache_dir=/scratch", "set pipeline.feature_cache_disk_bytes too"),
])
def test_config_mistakes_name_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        load_config(overrides=[bad])
    assert load_config().pipeline.feature_cache_bytes == 0  # off by default


def test_budgets_read_like_people_write_them_and_the_bench_says_whether_they_cover_a_full_cache(tiny_job):
    from flashdraft.bench.pipeline import cache_budget_verdict, feature_cache_estimate

    # YAML 1.1 reads 64e9 as a string; it is an integer byte count.
    assert load_config(overrides=["pipeline.feature_cache_bytes=64e9"]).pipeline.feature_cache_bytes == 64 * 10**9
    est = feature_cache_estimate(str(tiny_job / "target"), str(tiny_job / "data"), num_taps=2)
    assert est["bytes"] == 32 * 40 * 2 * 32 * 2  # 32 samples x 40 tokens x 2 taps x hidden 32 x bf16
    assert "covers it" in cache_budget_verdict(est["bytes"], est["bytes"] - 10, 10)
    assert "holds 50% of it" in cache_budget_verdict(est["bytes"], est["bytes"] // 4, est["bytes"] // 4)
    assert "is off" in cache_budget_verdict(est["bytes"], 0, 0)


# ---- the trainer ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def varied(tiny_job) -> Path:
    """32 samples of 16..40 tokens: padding and batch shapes change from epoch to epoch."""
    rng = np.random.default_rng(0)
    rows = [(rng.integers(0, 298, n), np.r_[np.zeros(4), np.ones(n - 4)]) for n in rng.integers(16, 41, 32)]
    write_token_shard(tiny_job / "varied", rows, vocab_size=300)
    return tiny_job / "varied"


def run(job: Path, data: Path, out: Path, **extra) -> tuple[Trainer, list[float], int]:
    """A 3-epoch run (8 micro-batches per epoch); returns its losses and target forwards."""
    trainer = Trainer(load_config(overrides=overrides(job, out, data__path=data, train__max_steps=24, **extra)))
    forwards = []
    trainer.target.layers[0].register_forward_hook(lambda *_: forwards.append(1))
    trainer.fit()
    assert trainer.sampler.batches_per_epoch == 8
    return trainer, [h["loss"] for h in trainer.history if "loss" in h], len(forwards)


@pytest.mark.parametrize("pipelined", ["true", "false"])
def test_a_cached_run_trains_like_an_uncached_one_and_skips_the_target(tiny_job, varied, tmp_path, pipelined):
    _, plain, plain_forwards = run(tiny_job, varied, tmp_path / "plain", pipeline__enabled=pipelined)
    cached, losses, forwards = run(tiny_job, varied, tmp_path / "cached", pipeline__enabled=pipelined,
                                   pipeline__feature_cache_bytes=10**7)
    warm_up = 1 if pipelined == "true" else 0  # one forward before the target thread starts
    assert plain_forwards == 24 + warm_up and forwards == 8 + warm_up  # epochs 2 and 3: no target forward
    stats = cached.feature_cache_stats
    assert (stats.hits, stats.misses, stats.skipped_forwards, stats.entries) == (64, 32, 16, 32)
    # Epoch 1 runs the target exactly as without a cache. Later epochs read epoch 1's features,
    # bit for bit; the uncached run recomputes them in other batches, whose shapes can move
    # the target's last bits (measured: 1 step of 24 differs, by ~1e-7 relative).
    assert losses[:8] == plain[:8]
    assert losses == pytest.approx(plain, rel=1e-5)
    record = cached.history[-1]
    assert record["cache/hits"] == 64 and record["cache/hit_rate"] == pytest.approx(64 / 96)
    assert "feature cache: 64 hits / 32 misses" in cached.pipeline_report.format()


def test_a_cache_too_small_for_the_data_still_trains_the_same(tiny_job, varied, tmp_path):
    _, plain, _ = run(tiny_job, varied, tmp_path / "plain")
    ram = 200 * 2 * 32 * 4  # 200 tokens of 2 taps x hidden 32 in fp32: about 7 of the 32 samples
    cached, losses, forwards = run(tiny_job, varied, tmp_path / "small", pipeline__feature_cache_bytes=ram)
    stats = cached.feature_cache_stats
    assert 0 < stats.ram_bytes <= ram and stats.disk_bytes == 0 and 0 < stats.entries < 32
    assert stats.hits == 2 * stats.entries  # each held sample hits once per later epoch
    assert stats.partial_forwards > 0 and forwards > 8  # the target ran on the missing samples
    assert losses == pytest.approx(plain, rel=1e-5)


def test_the_disk_tier_serves_what_ram_cannot_hold(tiny_job, varied, tmp_path):
    _, plain, _ = run(tiny_job, varied, tmp_path / "plain")
    scratch = tmp_path / "scratch"
    cached, losses, forwards = run(tiny_job, varied, tmp_path / "disk", pipeline__feature_cache_bytes=200 * 2 * 32 * 4,
                                   pipeline__feature_cache_disk_bytes=10**7, pipeline__feature_cache_dir=scratch)
    stats = cached.feature_cache_stats
    assert stats.disk_bytes > stats.ram_bytes > 0 and stats.entries == 32 and forwards == 9
    assert losses == pytest.approx(plain, rel=1e-5)
    assert scratch.is_dir() and os.listdir(scratch) == []  # the scratch file is gone with the run


def test_each_of_two_ranks_caches_what_it_sees(tiny_job, tmp_path, forkserver):
    """3 epochs at world size 2 (4 steps per epoch per rank): the counters are summed over
    ranks at every log, and the ranks stay in lockstep."""
    two = run_ranks(forkserver, "train_ranks", json.dumps(overrides(
        tiny_job, tmp_path / "two", train__max_steps=12, pipeline__feature_cache_bytes=10**7)), timeout=240)
    r0, r1 = results(two)
    assert all(r0["identical"]) and len(r0["identical"]) == 12 and r0["losses"] == r1["losses"]
    cache = r0["cache"]
    assert cache == r1["cache"]
    assert cache["cache/hits"] + cache["cache/misses"] == 12 * 4 * 2  # steps x samples per micro-batch x ranks
    # Epoch 1 fills each rank with the 16 samples it saw; later epochs deal each rank a different
    # half, so only some of its samples are held: hits, but fewer than at world size 1.
    assert 0 < cache["cache/hits"] < 64 and cache["cache/entries"] >= 32


def test_a_resume_with_the_cache_on_stays_within_float_rounding_of_an_uninterrupted_run(tiny_job, varied, tmp_path):
    """What docs/pipeline.md states: the cache starts empty after a resume, so the resumed run
    recomputes the features the interrupted run had cached, in other batches; a batched target
    forward differs in the last bits with the batch's shape, so the run goes on from features
    that differ by float rounding (with the cache off, resume is bit-exact: test_trainer.py)."""
    import os
    import signal

    from flashdraft.signals import Stopped

    cache = {"pipeline__feature_cache_bytes": 10**7}
    straight, straight_losses, _ = run(tiny_job, varied, tmp_path / "straight", **cache)
    out = tmp_path / "resumed"
    first = Trainer(load_config(overrides=overrides(tiny_job, out, data__path=varied, train__max_steps=24, **cache)))

    def stop_at_12(trainer):  # stopped mid epoch 2, where the interrupted run used cached features
        if trainer.step == 12:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Stopped):
        first.fit(on_step=stop_at_12)
    resumed, resumed_losses, _ = run(tiny_job, varied, out, **cache)
    assert resumed.step == 24 and len(resumed_losses) == 12
    # Measured (docs/reliability.md, row 6): losses 7e-8 relative apart, weights 1.8e-7; ~10x margin.
    # Bit-identity is not asserted either way: it depends on the platform's kernels.
    np.testing.assert_allclose(resumed_losses, straight_losses[12:], rtol=1e-6)
    for (name, a), b in zip(resumed.drafter.state_dict().items(), straight.drafter.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_full_disk_under_the_disk_tier_is_said_and_start_up_says_what_fits(tmp_path, caplog):
    """The scratch file's disk fills up (here: a file-size limit on this process, as a full disk
    refuses a write): the tier stops growing, with a warning naming the directory, and its stats
    say so (the hit rate fell from 62 % to 1.7 % without a word). A budget beyond the disk's free
    space is said at start-up, and the announced budget is what fits."""
    import resource
    import shutil
    import signal

    from flashdraft.metrics import format_bytes

    F = 16
    cache = FeatureCache(feature_size=F, dtype=torch.float32, ram_bytes=0, disk_bytes=10**6, directory=tmp_path,
                         pin_memory=False)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # its default would end the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 * 4 * F * 4, hard))  # room for four samples of 4 tokens
    try:
        kept = [cache.put(i, torch.randn(4, F)) for i in range(10)]
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, ignored)
    assert kept == [True] * 4 + [False] * 6
    assert (f"the disk tier's scratch file in {tmp_path} could not grow past 1.0K of its 976.6K budget (File too "
            "large)") in caplog.text
    assert "later epochs run the target" in caplog.text
    assert cache.stats().disk_full and "(the disk filled up)" in cache.stats().format()
    assert torch.equal(cache.get(3), cache.get(3)) and cache.get(3).shape == (4, F)  # what it holds still reads back
    cache.close()
    caplog.clear()
    huge = FeatureCache(feature_size=F, dtype=torch.float32, ram_bytes=0, disk_bytes=10**18, directory=tmp_path,
                        pin_memory=False)
    assert f"feature_cache_disk_bytes=1000000000000000000 ({format_bytes(10**18)}) but {tmp_path} has" in caplog.text
    assert 0 < huge.disk_budget <= shutil.disk_usage(tmp_path).free + 2**20
    huge.close()
