"""The shared-memory all-reduce of CPU tensor-parallel groups (distributed/shm_all_reduce.py): two ranks in
two processes join a gloo group, which takes it; sums of many steps (both halves reused) equal gloo's within
float32 rounding and are the same bits on both ranks; tensors it does not take (too large, not float32)
go through gloo; a rank whose peer never arrives fails with a clear error instead of hanging, and after
that neither rank sums again (their steps no longer match); the file goes even when setting it up fails."""
from __future__ import annotations

import multiprocessing
import os
import socket
import uuid

import pytest
import torch

from tokenmill.distributed.shm_all_reduce import ShmAllReduce, create_group_shm, shm_supported

pytestmark = pytest.mark.skipif(not shm_supported(), reason="the shared-memory all-reduce is for x86-64 hosts")


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist
    from tokenmill.distributed.communication import all_reduce
    from tokenmill.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
    torch.set_num_threads(1)
    tp = init_tensor_parallel(rank, 2, f"tcp://127.0.0.1:{port}", "gloo")
    results = {"shm": tp.shm is not None, "sums": [], "gloo": []}
    g = torch.Generator().manual_seed(100 + rank)
    for numel in (1, 576, 7 * 576, 5, 2048 * 1024, 2048 * 1024 + 1):     # the last: over the capacity
        x = torch.randn(numel, generator=g)
        ref = x.clone()
        dist.all_reduce(ref)
        results["sums"].append(all_reduce(x.clone()).numpy())       # numpy: pickled by value, not by fd
        results["gloo"].append(ref.numpy())
    half = torch.randn(64, generator=g).to(torch.bfloat16)              # not float32: gloo's path
    results["bf16"] = all_reduce(half.clone()).float().numpy()
    out.put((rank, results))
    destroy_tensor_parallel()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_sum_through_shared_memory_as_gloo_does():
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got[0]["shm"] and got[1]["shm"]
    for a, b, ref in zip(got[0]["sums"], got[1]["sums"], got[0]["gloo"]):
        assert (a == b).all()                                           # the same bits on every rank
        assert torch.allclose(torch.from_numpy(a), torch.from_numpy(ref), rtol=1e-6, atol=1e-6)
    assert (got[0]["bf16"] == got[1]["bf16"]).all()
    assert not any(f.startswith("tokenmill-tp-") for f in os.listdir("/dev/shm"))   # unlinked once mapped


def _shm_file(tmp_path) -> str:
    path = str(tmp_path / f"shm-{uuid.uuid4().hex}")
    with open(path, "wb") as f:
        f.truncate(2 * 64 + 2 * 2 * 4096)
    return path


def test_a_missing_peer_is_an_error_not_a_hang(tmp_path):
    shm = ShmAllReduce(_shm_file(tmp_path), rank=0, size=2, capacity=4096, timeout_s=0.2)
    assert not shm.all_reduce(torch.ones(2048))                          # over the capacity: not taken
    with pytest.raises(RuntimeError, match="rank 1 did not reach all-reduce step 1"):
        shm.all_reduce(torch.ones(8))


def test_after_a_timeout_no_rank_sums_out_of_step(tmp_path):
    """Rank 1 misses all-reduce A (its step raised before it) and rank 0 times out in A. In B rank 1 would
    sum rank 0's A slot with its own B value, and rank 0 would wait for a step rank 1 never publishes (or,
    once rank 1 got further, sum mismatched slots too): both must raise instead, every time."""
    path = _shm_file(tmp_path)
    rank0 = ShmAllReduce(path, rank=0, size=2, capacity=4096, timeout_s=0.2)
    rank1 = ShmAllReduce(path, rank=1, size=2, capacity=4096, timeout_s=0.2)
    with pytest.raises(RuntimeError, match="rank 1 did not reach all-reduce step 1"):
        rank0.all_reduce(torch.full((4,), 10.0))                          # A: rank 1 never arrives
    b1 = torch.full((4,), 200.0)
    with pytest.raises(RuntimeError, match="rank 0 gave up on an all-reduce"):
        rank1.all_reduce(b1)                                              # was 10 + 200 = 210
    assert (b1 == 200.0).all()
    for _ in range(3):                                                    # refused at once, whatever follows
        with pytest.raises(RuntimeError, match="refuses further use"):
            rank0.all_reduce(torch.full((4,), 20.0))
        with pytest.raises(RuntimeError, match="refuses further use"):
            rank1.all_reduce(torch.full((4,), 300.0))
    with pytest.raises(RuntimeError, match="refuses further use"):
        rank0.all_reduce(torch.ones(2048))                                # gloo's path is out of step too


def test_the_file_is_removed_when_a_set_up_collective_fails(monkeypatch):
    import torch.distributed as dist

    def peer_gone(*args, **kwargs):
        raise RuntimeError("gloo: Connection closed by peer")
    monkeypatch.setattr(dist, "broadcast_object_list", lambda *args, **kwargs: None)
    monkeypatch.setattr(dist, "all_reduce", peer_gone)
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(RuntimeError, match="closed by peer"):
        create_group_shm(0, 2, group=None, capacity=4096)
    assert not {f for f in os.listdir("/dev/shm") if f.startswith("tokenmill-tp-")} - before
