"""Test support: a free local port, and ranks of a gloo world in processes of their own, ended within a deadline."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous or a Ray head)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(worker: Callable, args: tuple, nprocs: int, timeout_s: float, what: str) -> None:
    """``worker(rank, *args)`` in ``nprocs`` spawned processes; a rank that raises fails the test with its error
    (torch's ``ProcessRaisedException``), one that has not ended within ``timeout_s`` fails it naming ``what``, and
    no rank outlives the call."""
    import torch.multiprocessing as mp

    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() >= deadline:
                pytest.fail(f"{what} did not finish within {timeout_s} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


@contextmanager
def gloo_world(rank: int, port: int, world_size: int, timeout_s: float) -> Iterator[None]:
    """This process as ``rank`` of a gloo world of ``world_size`` ranks meeting at 127.0.0.1:``port`` (one torch
    thread each: the ranks share the machine's cores), its collectives bounded by ``timeout_s``; the process group
    is destroyed on exit."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        yield
    finally:
        dist.destroy_process_group()
