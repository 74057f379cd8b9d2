"""Ring attention across 1, 2 and 4 CPU processes equals single-process attention.

The oracle is ``attnkit.scaled_dot_product_attention(..., backend="math")`` on the full sequence
in float64: forward output and the gradients of query, key and value, to 1e-10.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attnkit import scaled_dot_product_attention
from attnkit.distributed import (
    ring_attention,
    shard_lengths,
    shard_segments,
    shard_sequence,
    unshard_sequence,
)
from attnkit.masks import window_fn
from distributed_harness import run_workers

TOL = 1e-10


def _alibi(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """An ALiBi-style bias on global positions (Press et al. 2022), slope 2^-(h+1)."""
    return -(2.0 ** -(h + 1).double()) * (i - j).abs().double()


# (name, layout, is_causal, n_q, n_k, mask fn, bias fn[, key/value heads]); 3 query heads
CASES = [
    ("full contiguous", "contiguous", False, 24, 24, None, None),
    ("causal contiguous", "contiguous", True, 24, 24, None, None),
    ("full zigzag", "zigzag", False, 24, 24, None, None),
    ("causal zigzag", "zigzag", True, 24, 24, None, None),
    ("causal contiguous uneven n=23", "contiguous", True, 23, 23, None, None),
    ("causal zigzag uneven n=21", "zigzag", True, 21, 21, None, None),
    ("causal contiguous n_q=16 < n_k=24", "contiguous", True, 16, 24, None, None),
    ("causal zigzag n_q=24 > n_k=16 (masked rows)", "zigzag", True, 24, 16, None, None),
    ("window mask fn + alibi bias fn", "contiguous", False, 24, 24, window_fn(5, 2), _alibi),
    ("causal zigzag + window mask fn", "zigzag", True, 24, 24, window_fn(6), None),
    ("causal zigzag grouped-query h_kv=1", "zigzag", True, 24, 24, None, None, 1),
]


def _check_case(rank: int, world: int, case: tuple) -> dict[str, float]:
    name, layout, causal, n_q, n_k, mask, bias = case[:7]
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))  # same on every rank
    b, h, d, dv = 2, 3, 8, 5
    h_kv = case[7] if len(case) > 7 else h
    q = torch.randn(b, h, n_q, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, h_kv, n_k, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, h_kv, n_k, dv, generator=gen, dtype=torch.float64)
    grad = torch.randn(b, h, n_q, dv, generator=gen, dtype=torch.float64)

    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = scaled_dot_product_attention(*full, mask, bias=bias, is_causal=causal, backend="math")
    ref.backward(grad)

    local = [shard_sequence(t, world, rank, layout=layout).requires_grad_(True) for t in (q, k, v)]
    out = ring_attention(*local, mask, bias=bias, is_causal=causal, layout=layout)
    out.backward(shard_sequence(grad, world, rank, layout=layout))

    errors = {"out": (out - shard_sequence(ref, world, rank, layout=layout)).abs().max().item()}
    for label, mine, theirs in zip(("dq", "dk", "dv"), local, full, strict=True):
        expected = shard_sequence(theirs.grad, world, rank, layout=layout)
        errors[label] = (mine.grad - expected).abs().max().item()
    assert all(e < TOL for e in errors.values()), f"rank {rank}/{world} {name}: {errors}"
    assert out.dtype == torch.float64 and out.shape == (b, h, local[0].shape[2], dv)
    return errors


def _check_errors(rank: int, world: int) -> None:
    x = torch.randn(1, 2, 4 * world, 8, dtype=torch.float64)
    shard = shard_sequence(x, world, rank)
    # Shards that are not a layout of the total length: every rank raises, nobody hangs.
    bad = torch.randn(1, 2, 4 - (rank == 0), 8, dtype=torch.float64)  # first shard short
    with pytest.raises(ValueError, match="shard lengths"):
        ring_attention(bad, bad, bad)
    # Ranks that disagree on is_causal.
    with pytest.raises(ValueError, match="disagree"):
        ring_attention(shard, shard, shard, is_causal=rank == 0)
    with pytest.raises(ValueError, match="mask"):
        ring_attention(shard, shard, shard, torch.ones(4, 4 * world, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="dropout_p"):
        ring_attention(shard, shard, shard, dropout_p=0.1)
    # The group still works after the rejected calls.
    shard.requires_grad_(True)
    ring_attention(shard, shard, shard, is_causal=True).sum().backward()
    assert shard.grad is not None and torch.isfinite(shard.grad).all()


def _worker(rank: int, world: int, report: str) -> None:
    results = {case[0]: _check_case(rank, world, case) for case in CASES}
    _check_errors(rank, world)
    worst = [None] * world
    dist.all_gather_object(worst, max(max(e.values()) for e in results.values()))
    if rank == 0:
        Path(report).write_text(json.dumps({"cases": results, "worst_per_rank": worst}))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_matches_single_process(world: int, tmp_path: Path) -> None:
    report = tmp_path / "errors.json"
    run_workers(_worker, world, str(report))
    result = json.loads(report.read_text())
    for name, errors in result["cases"].items():  # shown with pytest -s or -rA
        print(f"W={world} {name}: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    assert set(result["cases"]) == {case[0] for case in CASES}
    assert max(result["worst_per_rank"]) < TOL


@pytest.mark.distributed
def test_world_of_one_in_process() -> None:
    """A group of one rank (a FileStore, no network): the ring degenerates to one block step."""
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            q, k, v = (
                torch.randn(2, 2, 11, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)
            )
            out = ring_attention(q, k, v, is_causal=True, layout="zigzag")
            ref = scaled_dot_product_attention(q, k, v, is_causal=True, backend="math")
            assert (out - ref).abs().max().item() < TOL
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
            for g, r in zip(grads, ref_grads, strict=True):
                assert (g - r).abs().max().item() < TOL
            with pytest.raises(ValueError, match="grouped-query"):
                ring_attention(q[:, :1], k, v)  # 1 query head, 2 key/value heads
        finally:
            dist.destroy_process_group()


def test_not_initialised_is_a_clear_error() -> None:
    assert not dist.is_initialized()
    x = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="init_process_group"):
        ring_attention(x, x, x)


def test_bad_arguments_rejected_before_communication() -> None:
    x = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match="4-D"):
        ring_attention(x[0], x[0], x[0])
    with pytest.raises(ValueError, match="layout"):
        ring_attention(x, x, x, layout="striped")
    with pytest.raises(TypeError, match="dtype"):
        ring_attention(x, x.double(), x)


def test_zigzag_layout_by_hand() -> None:
    # n = 16 over 4 ranks: 8 chunks of 2; rank r holds chunks r and 7 - r.
    x = torch.arange(16).view(1, 1, 16, 1)
    held = [shard_sequence(x, 4, r, layout="zigzag").flatten().tolist() for r in range(4)]
    assert held == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert shard_segments(16, 4, 1, "zigzag") == ((2, 2), (12, 2))
    assert shard_sequence(x, 4, 2).flatten().tolist() == [8, 9, 10, 11]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("n", [0, 1, 7, 16, 97])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(layout: str, n: int, world: int) -> None:
    x = torch.randn(2, 3, n, 5)
    shards = [shard_sequence(x, world, r, layout=layout) for r in range(world)]
    assert [s.shape[2] for s in shards] == shard_lengths(n, world, layout)
    assert max(shard_lengths(n, world, layout)) - min(shard_lengths(n, world, layout)) <= 2
    assert torch.equal(unshard_sequence(shards, layout=layout), x)
    # Shards cover every position exactly once.
    positions = sorted(
        p
        for r in range(world)
        for s, m in shard_segments(n, world, r, layout)
        for p in range(s, s + m)
    )
    assert positions == list(range(n))


def test_unshard_rejects_foreign_lengths_and_passes_gradients() -> None:
    with pytest.raises(ValueError, match="not a zigzag layout"):
        unshard_sequence([torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 5, 2)], layout="zigzag")
    shards = [torch.randn(1, 1, 4, 2, requires_grad=True) for _ in range(2)]
    full = unshard_sequence(shards, layout="zigzag")
    (full * torch.arange(8.0).view(1, 1, 8, 1)).sum().backward()
    assert shards[0].grad[0, 0, :, 0].tolist() == [0.0, 1.0, 6.0, 7.0]
    assert math.isclose(shards[1].grad.sum().item(), 2 * (2 + 3 + 4 + 5))


def _dies(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)  # a crash: no exception, no clean shutdown
    dist.barrier()  # rank 0 would wait here forever (until the group's timeout)


@pytest.mark.distributed
@pytest.mark.slow
def test_harness_fails_instead_of_hanging_when_a_worker_dies() -> None:
    start = time.monotonic()
    with pytest.raises(mp.ProcessExitedException, match="exit code 3"):
        run_workers(_dies, 2, timeout=100)
    # Reported as soon as rank 1 died, before the group timeout (60 s) ended rank 0's wait.
    assert time.monotonic() - start < 60


def _causal_work(layout: str, n: int, world: int) -> list[int]:
    """Query-key pairs each rank computes for causal attention (blocks causality skips cost 0)."""
    from attnkit.distributed.ring import _block_pairs, _Plan

    work = []
    for rank in range(world):
        plan = _Plan(
            group=None,
            rank=rank,
            world_size=world,
            q_segments=shard_segments(n, world, rank, layout),
            k_segments=tuple(shard_segments(n, world, r, layout) for r in range(world)),
            k_lengths=tuple(shard_lengths(n, world, layout)),
            causal_offset=0,
            scale=1.0,
            mask=None,
            bias=None,
        )
        work.append(
            sum(
                (qs.stop - qs.start) * (ks.stop - ks.start)
                for src in range(world)
                for qs, ks, _ in _block_pairs(plan, src)
            )
        )
    return work


def test_zigzag_balances_causal_work_and_contiguous_does_not() -> None:
    zigzag = _causal_work("zigzag", 64, 4)
    assert len(set(zigzag)) == 1  # every rank: 3 + 2 * (W - 1) blocks of 8 x 8
    assert zigzag[0] == (3 + 2 * 3) * 8 * 8
    contiguous = _causal_work("contiguous", 64, 4)
    assert contiguous == [256 * (r + 1) for r in range(4)]  # rank r: r full blocks + diagonal
    # The slowest rank sets the pace of a ring step: zigzag's does 576 pairs, contiguous's 1024.
    assert max(zigzag) < 0.6 * max(contiguous)
    # Neither skips a visible pair (the parity tests prove it; here: enough work is done).
    assert min(sum(zigzag), sum(contiguous)) >= 64 * 65 // 2
