"""The measured steps of `attnkit demo` (tasks/tour.py): both routes compute the same layer, cached
decoding equals the full pass, and the peak-memory reading sees an allocation it is shown."""

from __future__ import annotations

import itertools
import sys
from types import SimpleNamespace

import pytest
import torch

from attnkit.tasks import tour


def test_both_routes_give_the_same_output_and_report_themselves() -> None:
    state = torch.random.get_rng_state()
    r = tour.compare_routes(96, rounds=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is kept
    assert r.n == 96 and r.dense.name == "dense" and r.tiled.name == "tiled"
    assert 0 <= r.max_difference < 1e-5
    assert r.bias_mb == pytest.approx(8 * 96 * 96 * 4 / 2**20)  # (1, h, n, n) float32
    assert r.dense.seconds > 0 and r.tiled.seconds > 0
    assert len(r.ratios) == 1 and r.time_ratio == r.ratios[0] > 0


def test_one_slow_round_cannot_flip_the_time_ratio(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every round: dense 1.0 s, tiled 0.5 s, except a load spike during round 2's tiled call.
    # Rounds alternate who goes first: dense, tiled | tiled, dense | dense, tiled | ...
    durations = iter([1.0, 0.5, 0.5, 1.0, 1.0, 9.5, 0.5, 1.0, 1.0, 0.5])
    calls, now = itertools.count(), [0.0]

    def perf_counter() -> float:
        if next(calls) % 2:  # the end of a timed call
            now[0] += next(durations)
        return now[0]

    monkeypatch.setattr(tour, "time", SimpleNamespace(perf_counter=perf_counter))
    r = tour.compare_routes(64, rounds=5)
    assert r.ratios == (0.5, 0.5, 9.5, 0.5, 0.5)
    assert r.time_ratio == 0.5 and r.tiled.seconds == 0.5 and r.dense.seconds == 1.0
    assert sum((1.0, 0.5, 0.5, 9.5, 0.5, 0.5)) / 5 > 1  # a mean would have said "slower"
    assert tour.paired_ratios([2.0, 4.0], [1.0, 1.0]) == (0.5, 0.25)
    with pytest.raises(ValueError, match="as many dense as tiled"):
        tour.paired_ratios([1.0], [])


def test_cached_decoding_equals_the_full_pass() -> None:
    gap = tour.kv_cache_gap(33)
    assert 0 <= gap < 1e-5


def _allocate_64_mb() -> torch.Tensor:
    big = torch.ones(64 * 2**20 // 4)  # 64 MB, touched, then freed
    return big[:1].clone()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
def test_peak_memory_sees_an_allocation_even_after_it_is_freed() -> None:
    out, mb = tour.peak_extra_mb(_allocate_64_mb)
    assert out.item() == 1.0
    assert mb is not None and 60 <= mb < 200, mb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")
def test_peak_memory_sees_an_allocation_that_reuses_freed_heap_memory() -> None:
    # A long process leaves freed memory resident inside the C heap; an allocation served from it
    # adds no resident pages. Build that state: a 31 MB block freed raises glibc's threshold for
    # taking big blocks straight from the system, then 90 MB of heap blocks are freed next to one
    # that stays, so the next 64 MB can come from the heap.
    torch.ones(31 * 2**20 // 4)  # made and freed at once
    blocks = [torch.ones(30 * 2**20 // 4) for _ in range(4)]
    del blocks[:3]
    out, mb = tour.peak_extra_mb(_allocate_64_mb)
    assert out.item() == 1.0
    assert mb is not None and 60 <= mb < 200, mb
    del blocks


@pytest.mark.parametrize(("fn", "kwargs"), [(tour.compare_routes, {"n": 8}),
                                             (tour.compare_routes, {"n": 64, "rounds": 0}),
                                             (tour.kv_cache_gap, {"n": 1})])  # fmt: skip
def test_bad_sizes_are_refused(fn, kwargs) -> None:
    with pytest.raises(ValueError, match="must be an int"):
        fn(**kwargs)


def test_a_length_whose_dense_bias_cannot_fit_is_refused_before_any_allocation() -> None:
    """n = 10**9 would need a (1, 8, n, n) float32 bias of 2.9e19 bytes (and a 2 TB input): it
    is refused by its size, at once, with the number in the message."""
    words = r"n = 1,000,000,000: torch's dense route, whose \(1, 8, n, n\) ALiBi bias needs "
    with pytest.raises(ValueError, match=words + r"29,802,322,387\.7 GiB, more than"):
        tour.compare_routes(10**9)
    tour.check_length(1024)  # 32 MiB: fits any machine
