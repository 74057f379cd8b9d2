"""How much memory the machine has, so a request that can never fit is refused before it starts.

A tensor larger than the machine's memory is not always refused by the allocator: Linux hands
out address space lazily, so the failure comes later (a swap storm, the out-of-memory killer)
or as an allocator error deep inside the work. Code that sizes a large allocation from a user's
number (a sequence length, a token budget) checks it here first. The bound is the device's
*total* memory, not what is free now: a request within it may still be slow, one beyond it
cannot succeed.
"""

from __future__ import annotations

import os

import torch

__all__ = ["check_fits", "total_memory"]


def total_memory(device: torch.device | str = "cpu") -> int | None:
    """Bytes of memory of ``device``: physical RAM for the CPU (POSIX ``sysconf``), the card's
    for CUDA; ``None`` where it cannot be known (then nothing is refused)."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type != "cpu":
        return None
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


def check_fits(nbytes: int, what: str, device: torch.device | str = "cpu") -> None:
    """A ``ValueError`` when ``nbytes`` exceed ``device``'s memory; ``what`` says what needs
    them and which argument sets their number, e.g. ``"max_new_tokens=10**9: the KV cache"``."""
    total = total_memory(device)
    if total is not None and nbytes > total:
        raise ValueError(
            f"{what} needs {_gib(nbytes)}, more than the {_gib(total)} of memory of this "
            f"machine ({torch.device(device).type})"
        )
