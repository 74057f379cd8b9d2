"""Run a function on several CPU processes joined by gloo on loopback, in bounded time.

Used by the ``@pytest.mark.distributed`` tests. Workers are started with the ``spawn`` method
(a fresh interpreter each: no forked threads or locks); the process group is initialised with a
timeout, and the parent waits with a deadline, so a crashed or stuck worker fails the test
instead of hanging it. A worker's exception is re-raised in the parent with its traceback.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

INIT_TIMEOUT_S = 60  # init_process_group and every collective give up after this


def free_port() -> int:
    """A port that was free a moment ago (bind port 0 and let the kernel choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., None], world_size: int, port: int, args: tuple) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # the machine is shared; W processes of 1 thread each
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=INIT_TIMEOUT_S)
    )
    try:
        fn(rank, world_size, *args)
    finally:
        if dist.is_initialized():  # the worker may have torn it down itself
            dist.destroy_process_group()


def run_workers(fn: Callable[..., None], world_size: int, *args: object, timeout: float = 150):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` processes; fail on error/timeout."""
    context = mp.start_processes(
        _entry,
        args=(fn, world_size, free_port(), args),
        nprocs=world_size,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + timeout
    # join() re-raises a worker's exception (or a death by signal) and terminates the others.
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
            for process in context.processes:
                process.join(5)
            pytest.fail(f"{world_size} workers running {fn.__name__} exceeded {timeout} s")
