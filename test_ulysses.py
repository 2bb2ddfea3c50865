"""
Tests, runnable on a CPU-only machine: every multi-rank case spawns 2 or 4 processes that talk over gloo, and
compares against the obvious single-device computation in float32.

    pytest -q test_ulysses.py
"""

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ulysses
from gpt import GPT, GPTConfig


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_ranks(world_size, fn, *args):
    """Run fn(rank, world_size, *args) on world_size gloo processes; return the list of what each rank returned.
    fn must be a module-level function (it is pickled into the child processes)."""
    with tempfile.TemporaryDirectory() as result_dir:
        mp.spawn(_worker, args=(world_size, _free_port(), fn, args, result_dir), nprocs=world_size)
        return [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]
