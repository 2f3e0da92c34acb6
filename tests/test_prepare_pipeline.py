"""`flashdraft prepare` end to end: input formats, bad inputs, workers, cache key, CLI."""

import json
import os

import numpy as np
import pytest

from conftest import REPO
from flashdraft.cli import main
from flashdraft.data.prepare import prepare
from flashdraft.data.shards import read_token_shard
from flashdraft.toy import synthetic_conversations, train_toy_tokenizer

N = 120


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("prep")
    records = synthetic_conversations(N, seed=3)
    corpus = [m["content"] for r in records[:40] for m in r["messages"]]
    for style in ("qwen3", "llama3"):
        train_toy_tokenizer(corpus, 800, template=style).save_pretrained(d / f"tok-{style}")
    with open(d / "chats.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return d, records


def shard(path):
    meta, ids, mask, offsets = read_token_shard(path)
    return meta, [(np.array(ids[a:b]), np.array(mask[a:b])) for a, b in zip(offsets[:-1], offsets[1:])]


def test_prepare_writes_masked_samples_and_a_summary(workdir):
    d, records = workdir
    s = prepare([d / "chats.jsonl"], d / "tok-qwen3", d / "out", max_length=256, min_supervised=32,
                num_workers=1, progress=False)
    meta, samples = shard(d / "out")
    assert s["samples_in"] == N and s["samples"] + sum(s["dropped"].values()) == N
    assert meta["num_samples"] == s["samples"] and meta["source"]["summary"]["tokens"] == s["tokens"]
    assert all(len(ids) <= 256 and m.sum() >= 32 for ids, m in samples)
    assert 0 < s["supervised_share"] < 1 and s["truncated"] > 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d / "tok-qwen3")
    assert meta["vocab_size"] == len(tok)  # includes the added <think>, </think>, <|MASK|> tokens


def test_workers_give_an_identical_shard(workdir):
    d, _ = workdir
    prepare([d / "chats.jsonl"], d / "tok-qwen3", d / "w1", max_length=512, num_workers=1, progress=False)
    prepare([d / "chats.jsonl"], d / "tok-qwen3", d / "w2", max_length=512, num_workers=2, progress=False)
    for name in ("input_ids.bin", "loss_mask.bin", "offsets.bin"):
        assert (d / "w1" / name).read_bytes() == (d / "w2" / name).read_bytes()


def test_json_parquet_and_hf_dataset_inputs_match_jsonl(workdir):
    import datasets

    d, records = workdir
    sub = records[:30]
    (d / "chats.json").write_text(json.dumps(sub))
    sharegpt = [{"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                    "value": m["content"]} for m in r["messages"]]} for r in sub]
    datasets.Dataset.from_list(sharegpt).to_parquet(str(d / "chats.parquet"))
    datasets.Dataset.from_list([{"messages": r["messages"]} for r in sub]).save_to_disk(str(d / "hfdir"))
    with open(d / "sub.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in sub)
    ref = None
    for name in ("sub.jsonl", "chats.json", "chats.parquet", "hfdir"):
        prepare([d / name], d / "tok-llama3", d / f"fmt-{name}", max_length=512, num_workers=1, progress=False)
        samples = shard(d / f"fmt-{name}")[1]
        ref = ref or samples
        assert len(samples) == len(ref) > 0
        assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(samples, ref))


def test_bad_inputs_are_counted_not_fatal(workdir):
    d, records = workdir
    good = [json.dumps(r).encode() for r in records[:5]]
    bad = [
        b"{not json",
        json.dumps({"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}).encode(),
        json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}).encode(),
        json.dumps({"messages": records[0]["messages"] + [{"role": "user", "content": "and?"}]}).encode(),
        b'{"messages": [{"role": "user", "content": "caf\xe9"}]}',
    ]
    (d / "bad.jsonl").write_bytes(b"\n".join(good[:2] + bad + good[2:]) + b"\n")
    s = prepare([d / "bad.jsonl"], d / "tok-qwen3", d / "bad-out", max_length=4096, min_supervised=1,
                num_workers=2, progress=False)
    assert s["samples"] == 5 and s["samples_in"] == 10
    assert s["dropped"] == {"bad_json": 1, "unknown_role": 1, "empty_assistant": 1, "ends_with_user": 1, "bad_utf8": 1}
    assert any("bad.jsonl:3" in e for e in s["errors"])  # errors name file and line


def test_cache_key_hits_and_changed_template_rebuilds(workdir, tmp_path):
    d, _ = workdir
    args = ([d / "chats.jsonl"], d / "tok-qwen3", tmp_path / "c")
    first = prepare(*args, max_length=512, num_workers=1, progress=False)
    again = prepare(*args, max_length=512, num_workers=1, progress=False)
    assert not first["cached"] and again["cached"] and again["cache_key"] == first["cache_key"]
    assert not prepare(*args, max_length=256, num_workers=1, progress=False)["cached"]
    # Same vocabulary, different chat template: never silently reused.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d / "tok-qwen3")
    tok.chat_template = tok.chat_template.replace("'<|im_start|>' + m.role", "'<|im_start|>' + m.role + ' '")
    tok.save_pretrained(tmp_path / "tok-changed")
    changed = prepare([d / "chats.jsonl"], tmp_path / "tok-changed", tmp_path / "c", max_length=512,
                      num_workers=1, progress=False)
    assert not changed["cached"] and changed["cache_key"] != first["cache_key"]


def test_cli_prepare(workdir, tmp_path, capsys):
    d, _ = workdir
    rc = main(["prepare", str(d / "chats.jsonl"), "--tokenizer", str(d / "tok-qwen3"), "--out", str(tmp_path / "cli"),
               "--max-length", "512", "--block-size", "8", "--workers", "2", "--thinking", "default",
               "--no-supervise-thinking", "--no-progress"])
    assert rc == 0
    meta = read_token_shard(tmp_path / "cli")[0]
    assert meta["source"]["options"]["min_supervised"] == 16 and not meta["source"]["options"]["supervise_thinking"]
    assert "samples/s" in capsys.readouterr().out


def test_out_never_deletes_a_directory_that_is_not_a_shard(workdir, tmp_path):
    """--out pointed at a directory of other files (the inputs' own, '.', home) is refused before
    any work; an older shard, or an empty directory, is replaced."""
    d, _ = workdir
    mine = tmp_path / "important"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(ValueError, match=r"important: exists and is not a token shard .*Choose a new output directory"):
        prepare([d / "chats.jsonl"], d / "tok-qwen3", mine, max_length=512, min_supervised=16, num_workers=1,
                progress=False)
    assert (mine / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["important"]
    (tmp_path / "empty").mkdir()
    for _ in range(2):  # into an empty directory, then over its own (older) shard
        prepare([d / "chats.jsonl"], d / "tok-qwen3", tmp_path / "empty", max_length=512, min_supervised=16,
                num_workers=1, progress=False, force=True)
    assert read_token_shard(tmp_path / "empty")[0]["num_samples"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "important"]  # no .tmp- / .old- left


def test_cli_prepare_fails_when_no_sample_is_left_and_says_why(workdir, tmp_path, capsys):
    d, _ = workdir
    rc = main(["prepare", str(d / "chats.jsonl"), "--tokenizer", str(d / "tok-qwen3"), "--out", str(tmp_path / "o"),
               "--max-length", "8", "--workers", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "no usable sample" in err and "raise --max-length or lower --min-supervised" in err


@pytest.mark.slow  # a fresh interpreter and its worker processes: multi-process, ~4 s each
@pytest.mark.parametrize("workers", [1, 2])
def test_a_stop_raised_by_a_signal_handler_ends_prepare_and_its_workers(workdir, tmp_path, workers):
    # A benchmark's SIGTERM handler raises Stopped wherever the signal lands: in the middle of a
    # record it must end prepare, not be counted as that record's drop, and the forked workers
    # (which inherit the handler) must neither swallow it nor print tracebacks when the pool ends.
    d, _ = workdir
    many = tmp_path / "many.jsonl"
    many.write_text((d / "chats.jsonl").read_text() * 60)  # 7,200 records: seconds of work
    (finished, stopped), stderr = _run_stoppable(tmp_path, [(d / "chats.jsonl", 0), (many, 1.0)], d / "tok-qwen3",
                                                 workers)
    assert finished == {"finished": N, "children": 0}
    assert stopped == {"stopped": True, "children": 0} and "Traceback" not in stderr, stderr


STOPPABLE = """
import json, multiprocessing as mp, os, signal, sys, threading, time
from flashdraft.data.prepare import prepare
from flashdraft.signals import Stopped
tok, out, workers, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
def stop(signum, frame):  # what `flashdraft bench` installs: raise wherever the signal lands
    raise Stopped(signum, "")
signal.signal(signal.SIGTERM, stop)
for i, (chats, stop_after) in enumerate(runs):  # one interpreter for the runs: each start costs seconds
    if stop_after > 0:
        threading.Timer(stop_after, os.kill, (os.getpid(), signal.SIGTERM)).start()
    try:
        s = prepare([chats], tok, f"{out}-{i}", max_length=512, num_workers=workers, progress=False,
                    log=lambda *a: None)
        print(json.dumps({"finished": s["samples_in"], "children": len(mp.active_children())}), flush=True)
    except Stopped:
        print(json.dumps({"stopped": True, "children": len(mp.active_children())}), flush=True)
"""


def _run_stoppable(tmp_path, runs: list, tok, workers: int) -> tuple[list[dict], str]:
    """Each run (chats, seconds before this process sends itself SIGTERM, 0: never) in one fresh
    interpreter, in order: each run's JSON line, and the process's stderr."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", STOPPABLE, str(tok), str(tmp_path / f"out-{workers}"), str(workers),
                           json.dumps([[str(chats), stop_after] for chats, stop_after in runs])],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(runs):]], proc.stderr
