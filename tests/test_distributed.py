"""flashdraft.distributed: world-size-1 no-ops, real 2-rank gloo collectives, failing peers."""

from __future__ import annotations

import pytest
import torch

from conftest import read_log, results, run_ranks
from flashdraft.distributed import WATCH_S, Clocks, Dist


def test_single_process_needs_no_process_group(fresh_dist):
    D = fresh_dist
    d = D.init_distributed("cpu")
    assert d == Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None, clocks=Clocks())
    assert d.is_main and not torch.distributed.is_initialized()
    assert D.init_distributed("cpu") is d  # idempotent
    assert D.get_dist() is d and D.get_rank() == 0 and D.get_world_size() == 1
    x = torch.tensor([1.0, 2.0])
    assert D.all_reduce(x, "mean") is x and x.tolist() == [1.0, 2.0]
    assert D.all_reduce(x, "max") is x
    assert D.broadcast_object({"a": 1}) == {"a": 1}
    assert D.all_gather_object(5) == [5]
    assert D.gather_object("x") == ["x"]
    D.barrier()
    D.teardown()
    D.teardown()  # safe twice
    assert D.get_dist() == Dist()


def test_auto_device_and_torchrun_env_with_world_size_one(fresh_dist, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    d = fresh_dist.init_distributed("auto", timeout_s=5)
    assert d.world_size == 1 and d.backend is None and d.timeout_s == 5.0
    assert d.device.type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    ("env", "kwargs", "match"),
    [
        ({"WORLD_SIZE": "2", "RANK": "0"}, {}, "MASTER_ADDR, MASTER_PORT unset; launch with torchrun"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, {}, "inconsistent"),
        ({"WORLD_SIZE": "two"}, {}, "WORLD_SIZE='two' is not an integer"),
        ({}, {"device_type": "tpu"}, "use auto, cuda or cpu"),
        ({}, {"timeout_s": 0}, "positive"),
    ],
)
def test_bad_launch_environment_gives_clear_errors(fresh_dist, monkeypatch, env, kwargs, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        fresh_dist.init_distributed(**{"device_type": "cpu", **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_requested_without_gpu_is_a_clear_error(fresh_dist):
    with pytest.raises(ValueError, match="no CUDA device"):
        fresh_dist.init_distributed("cuda")


def test_each_wait_has_its_clock_and_names_the_field_that_sets_it():
    """The link clock is a step plus a drafter rank's pause; a receive posted for the whole run
    waits a year (a dead peer fails it at once, not the clock)."""
    clocks = Clocks(collective_s=5, startup_s=60, pause_s=30)
    assert [clocks.seconds(w) for w in ("collective", "startup", "pause", "link", "watch")] == [5, 60, 30, 35, WATCH_S]
    assert WATCH_S >= 365 * 86400
    assert clocks.describe("link") == "train.collective_timeout_s + train.pause_timeout_s = 35 s"
    assert clocks.describe("pause") == "train.pause_timeout_s = 30 s"
    with pytest.raises(ValueError, match="positive"):
        Clocks(pause_s=0)


def test_every_group_is_made_with_the_clock_of_the_longest_wait_posted_on_it(forkserver):
    """NCCL's watchdog times every op posted on a group by the group's timeout, whatever wait()
    is told, so each group gets the clock of its longest wait (the rule, kept on gloo's groups
    here; clocks: collective 5, start-up 60, pause 30). Colocated: the default group carries the
    step's collectives. Disaggregated (1 drafter rank, one target group of 2): the default group
    carries only the data channel, whose sends wait for a drafter rank's step and pause (link: 35),
    and so does the target group's mesh (its forward waits while its first rank's send does); the
    role groups carry the step's collectives; the gloo groups' waits carry their own clocks."""
    colocated = results(run_ranks(forkserver, "group_clocks", "0", "1", timeout=60))
    for r in colocated:
        assert r["timeouts"] == {"default": 5, "startup": 60, "host": 60}, r
    disaggregated = results(run_ranks(forkserver, "group_clocks", "2", "2", world_size=3, timeout=60))
    assert [r["role"] for r in disaggregated] == ["drafter", "target", "target"]
    assert disaggregated[0]["timeouts"] == {"default": 35, "role": 5, "control": 5, "startup": 60, "host": 60}
    for r in disaggregated[1:]:
        assert r["timeouts"] == {"default": 35, "role": 5, "control": 5, "startup": 60, "host": 60,
                                 "target mesh": 35}, r


def test_all_reduce_rejects_unknown_op(fresh_dist):
    with pytest.raises(ValueError, match="mean, sum, max or min"):
        fresh_dist.all_reduce(torch.ones(1), "avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="floating-point"):
        fresh_dist.all_reduce(torch.ones(1, dtype=torch.int64), "mean")


def test_two_gloo_ranks_collectives_then_hung_peer_times_out(forkserver):
    timeout_s = 3
    workers = run_ranks(forkserver, "collectives_then_peer_hangs", str(timeout_s), expect_exit=False)
    (pid0, out0), (pid1, out1) = workers
    try:
        code = forkserver.wait(pid0, timeout=60)
        assert code == 0, read_log(out0)
        r0, r1 = results(workers)
    finally:
        forkserver.kill(pid1)
    for r in (r0, r1):
        assert r["world_size"] == 2 and r["backend"] == "gloo" and r["device"] == "cpu"
        assert r["mean"] == [1.5, 15.0] and r["sum"] == [3.0, 30.0] and r["max"] == [2.0, 20.0]
        assert r["bcast"] == {"from": 0, "big": str(2**70)}
        assert r["all_gather"] == [0, 3]
    assert r0["is_main"] and not r1["is_main"]
    assert r0["gather"] == ["r0", "r1"] and r1["gather"] is None
    # Rank 1 never reached the second barrier: rank 0 must fail after ~timeout_s, not hang.
    assert r0["error"] and "barrier failed on rank 0/2" in r0["error"]
    assert f"train.collective_timeout_s = {timeout_s} s" in r0["error"]
    assert timeout_s * 0.8 <= r0["waited_s"] <= timeout_s + 10


def test_dead_peer_makes_the_next_collective_fail_fast(forkserver):
    workers = run_ranks(forkserver, "peer_exits", "30")
    assert forkserver.wait(workers[1][0], 0) == 3
    r0 = results(workers[:1])[0]
    assert r0["error"] and "all_reduce(sum) failed on rank 0/2" in r0["error"]
    assert r0["waited_s"] < 30  # well before the timeout: the closed connection is noticed


def test_the_multi_gpu_check_fails_on_a_context_on_another_gpu(tmp_path, capsys):
    """benchmarks/gpu_multi.sh's context check (flashdraft.bench.multi_check): a rank whose
    thread created a context on GPU 0 besides its own fails it; contexts on its own GPU pass."""
    import json

    from flashdraft.bench.multi_check import check_contexts, cuda_contexts

    if not torch.cuda.is_available():
        assert cuda_contexts() == []  # nothing to read: the smoke run's records hold no context
    record = {"tag": "ddp", "pid": 1, "exit": 0}
    (tmp_path / "ddp-rank0.json").write_text(json.dumps({**record, "rank": 0, "local_rank": 0, "contexts": [0]}))
    (tmp_path / "ddp-rank1.json").write_text(json.dumps({**record, "rank": 1, "local_rank": 1, "contexts": [1]}))
    assert check_contexts(tmp_path)
    (tmp_path / "ddp-rank1.json").write_text(json.dumps({**record, "rank": 1, "local_rank": 1, "contexts": [0, 1]}))
    assert not check_contexts(tmp_path)
    assert "ddp rank 1 (pid 1, LOCAL_RANK 1): contexts on GPUs [0, 1]" in capsys.readouterr().out
    assert not check_contexts(tmp_path / "empty")  # no process recorded: never a PASS


def test_gloo_binds_the_interface_named_else_the_hostnames_address_else_loopback(monkeypatch):
    """torch's choice of gloo's address, read the same way: GLOO_SOCKET_IFNAME's interface; an
    interface without an IPv4 address is named with those the machine has; a hostname that
    resolves to nothing falls back to loopback."""
    from flashdraft import distributed

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert distributed.gloo_address() == ("127.0.0.1", "GLOO_SOCKET_IFNAME=lo")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(distributed.GlooAddressError, match=r"GLOO_SOCKET_IFNAME=nosuch0: .* set it to one of lo \(127"):
        distributed.gloo_address()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr("socket.gethostname", lambda: "flashdraft-test.invalid")
    address, source = distributed.gloo_address()
    assert address == "127.0.0.1" and "resolves to no address" in source


def _routable_interface() -> str | None:
    from flashdraft.distributed import _interfaces, _is_loopback

    return next((name for name, address in _interfaces().items() if not _is_loopback(address)), None)


@pytest.mark.parametrize("case", ["loopback", "unreachable"])
def test_a_gloo_address_another_host_cannot_reach_stops_the_start_with_the_variable_to_set(forkserver, case):
    """2 ranks, the second posing as another host: a hostname that falls back to loopback, or a
    port that refuses the other host's connection. Every rank stops at start-up with
    GlooAddressError naming the address, its source and GLOO_SOCKET_IFNAME, in seconds; before,
    gloo bound the address and a real second node then failed (or hung) only at the first gloo
    group's connect, after its timeout. One host (the other tests) makes no probe at all."""
    interface = _routable_interface()
    if case == "unreachable" and interface is None:
        pytest.skip("this machine has no non-loopback IPv4 interface to bind gloo to")
    workers = run_ranks(forkserver, "gloo_on_two_hosts", case, interface or "", timeout=60,
                        env={"LOCAL_WORLD_SIZE": "1"})
    errors = [r["error"] for r in results(workers)]
    assert all(e and e.startswith("GlooAddressError: ") and "set GLOO_SOCKET_IFNAME" in e for e in errors), errors
    assert all("rank 1 (host flashdraft-test-node1.invalid) binds gloo to" in e for e in errors), errors
    if case == "loopback":
        assert all("127.0.0.1 (the hostname 'flashdraft-test-node1.invalid' resolves to no address" in e
                   and "a loopback address" in e for e in errors), errors
    else:
        assert all(f"(GLOO_SOCKET_IFNAME={interface}), which rank 0" in e and "ConnectionRefusedError" in e
                   for e in errors), errors


@pytest.mark.parametrize("agent_store", [False, True])
def test_the_ranks_whose_exit_ends_the_store_return_after_every_other_ranks_last_message(monkeypatch, agent_store):
    """4 ranks, 2 per node, on a real TCPStore: the store's host (rank 0; under torchrun's agent
    store node 0's ranks, whose agent exits with them) returns from the verdict barrier only once
    the last other rank has sent its last message; the other ranks return at once. Rank 3 is
    played by hand, late with that message."""
    import datetime
    import threading
    import time

    import torch.distributed as tdist

    from flashdraft.distributed import _verdicts_read

    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", str(agent_store))
    server = tdist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=30))

    def client() -> tdist.PrefixStore:
        return tdist.PrefixStore("flashdraft/gloo/0", tdist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                                      timeout=datetime.timedelta(seconds=30)))

    returned: dict[int, float] = {}

    def rank(r: int, store: tdist.PrefixStore) -> None:
        _verdicts_read(store, r, 4, 2)
        returned[r] = time.monotonic()

    ranks = [threading.Thread(target=rank, args=(r, client())) for r in range(3)]
    for t in ranks:
        t.start()
    last = client()  # rank 3: reads its verdict, then sends its last message late
    if last.add("read", 1) == 4:
        last.set("read/all", "")
    last.wait(["read/all"])
    time.sleep(0.5)
    left = time.monotonic()
    last.set("left/3", "")
    for t in ranks:
        t.join(30)
    hosts = [0, 1] if agent_store else [0]
    assert sorted(returned) == [0, 1, 2]
    assert all(returned[r] >= left for r in hosts), (returned, left)
    assert all(returned[r] < left for r in set(range(3)) - set(hosts)), (returned, left)


def test_a_job_whose_peer_never_joins_is_one_line_naming_the_address_and_the_fix(fresh_dist, monkeypatch):
    """Rank 0 of 2 alone (its peer died before the rendezvous): the store's raw DistStoreError
    ("Timed out after 2 seconds waiting for clients. 1/2 clients joined.") now says what it means."""
    from conftest import free_port

    port = free_port()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(fresh_dist.StartupError, match=rf"rank 0 of 2 could not join the job at 127.0.0.1:{port} "
                                                      r"within \d+ s \(.*\): every rank must start and join within "
                                                      r"train.collective_timeout_s=2 s. One did not: it died before "
                                                      r"joining"):
        fresh_dist.init_distributed("cpu", timeout_s=2)
    assert fresh_dist.StartupError.names_the_fix  # the command line prints it as one line
