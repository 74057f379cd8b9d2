"""The machine's memory (``_memory``): the CPU's total against the kernel's own count, and a
request beyond it refused with what needs it, while one within it (or on a machine whose memory
cannot be known) passes."""

from __future__ import annotations

import os

import pytest

from attnkit import _memory
from attnkit._memory import check_fits, total_memory


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="reads /proc/meminfo (Linux)")
def test_the_cpu_total_is_the_kernels_memtotal() -> None:
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
    # MemTotal leaves out what the kernel reserved at boot: a few percent at most.
    total = total_memory("cpu")
    assert total is not None and kib * 1024 <= total <= kib * 1024 * 1.1


def test_a_request_beyond_the_memory_is_refused_naming_what_needs_it(monkeypatch) -> None:
    monkeypatch.setattr(_memory, "total_memory", lambda device="cpu": 8 * 2**30)
    check_fits(8 * 2**30, "n = 10: a bias")  # exactly the memory: allowed
    with pytest.raises(ValueError) as err:
        check_fits(3 * 2**40, "n = 10**6: a bias")
    assert str(err.value) == (
        "n = 10**6: a bias needs 3,072.0 GiB, more than the 8.0 GiB of memory of this machine (cpu)"
    )


def test_a_machine_whose_memory_is_unknown_refuses_nothing(monkeypatch) -> None:
    def no_sysconf(name: str) -> int:
        raise ValueError(f"unrecognized configuration name {name!r}")

    monkeypatch.setattr(os, "sysconf", no_sysconf)
    assert total_memory("cpu") is None
    check_fits(2**80, "anything")
    assert total_memory("meta") is None
