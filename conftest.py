"""
What every test file shares. The tests run on a CPU-only machine: a multi-rank case starts 2, 3, 4 or 8
processes that talk over gloo (run_ranks), or train.py under torchrun (torchrun), and compares against the
obvious single-device computation in float32.

    python -m pytest -v                  # every test file
    python -m pytest -v test_ring.py     # one of them

pytest loads this file before the test files; they import what they need from it by name
(`from conftest import run_ranks`).
"""

import os
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import launch

HERE = os.path.dirname(os.path.abspath(__file__))


# ================================================================================================================
# Rank processes: run_ranks(world_size, fn, *args) runs fn on every rank of a gloo group


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    warnings.filterwarnings("error", module="ulysses")  # a collective that gloo never let go of fails the test
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
    dist.barrier()  # no rank tears the group down while another still talks to it
    dist.destroy_process_group()


def pytest_collection_finish(session):
    """Rank processes are forked from a server process that has imported this file and the test files (and so
    torch and the files they test) but computed nothing, so they start in a fraction of a second, and never
    inherit a thread pool that a fork would leave broken. fn travels to a rank by its name, e.g.
    test_gpt._gpt_rank, and is found there among the modules already imported."""
    mp.set_forkserver_preload(["conftest"] + sorted({item.module.__name__ for item in session.items}))


def run_ranks(world_size, fn, *args):
    """Run fn(rank, world_size, *args) on world_size gloo processes; return the list of what each rank returned.
    fn must be a top-level function of a test file."""
    with tempfile.TemporaryDirectory() as result_dir:
        mp.start_processes(_worker, args=(world_size, free_port(), fn, args, result_dir), nprocs=world_size,
                           start_method="forkserver")
        return [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


# ================================================================================================================
# train.py as a user runs it: under torchrun, in processes of its own


def torchrun(nproc, *argv):
    """The command line of train.py under torchrun on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv,
            "train.py"]


def torchrun_patched(tmp_path, patch, argv, timeout=120):
    """train.py's main under torchrun on 2 ranks, after `patch` (Python source) ran on rank 1 alone. Returns
    (exit status, output, seconds)."""
    script = tmp_path / "patched_train.py"
    script.write_text(f"import os, sys, time\nsys.path.insert(0, {HERE!r})\nimport checkpoint, data, train\n"
                      f"if os.environ['RANK'] == '1':\n" + "".join(f"    {line}\n" for line in patch.splitlines())
                      + "train.main()\n")
    start = time.time()
    done = subprocess.run(torchrun(2)[:-1] + [str(script), *argv], cwd=HERE, capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.time() - start


def start_long_run(tmp_path, extra, timeout=300):
    """torchrun with 2 ranks on a tiny model for 300 steps, saving every 10; once the first checkpoint is written,
    returns (process, out_dir, its worker pids), for a test to kill or stop a worker."""
    out_dir = tmp_path / "run"
    cmd = torchrun(2, *extra) + ["--steps", "300", "--seq-len", "32", "--n-embd", "32", "--save-every", "10",
                                 "--out-dir", str(out_dir), "--timeout", str(timeout)]
    launcher = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 90
    while not (out_dir / "step_000010").exists() and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.05)
    workers = workers_of(launcher.pid)
    assert len(workers) == 2, "the workers were not found"
    return launcher, out_dir, workers


def workers_of(launcher_pid):
    """The pids of a torchrun's worker processes (its children), in order."""
    workers = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[1] == str(launcher_pid):
                workers.append(int(pid))
    return sorted(workers)


def usp_groups(U, R):
    """(Ulysses group, ring group) of this rank when the world is an SP group of U x R: U consecutive ranks form
    a Ulysses group, and the ranks at the same place in each Ulysses group a ring."""
    mesh = init_device_mesh("cpu", (R, U), mesh_dim_names=("ring", "ulysses"))
    return mesh.get_group("ulysses"), mesh.get_group("ring")


# ================================================================================================================
# Comparing results


def assert_all_close(got, want, rtol=1e-5, atol=1e-5, where=""):
    """Compare two results of the same structure (tensors, numbers, and lists, tuples or dicts of them)."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            assert_all_close(got[key], want[key], rtol, atol, f"{where}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_all_close(g, w, rtol, atol, f"{where}[{i}]")
    elif torch.is_tensor(want) or isinstance(want, float):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{where}: {m}")
    else:  # flags, names, counts
        assert got == want, f"{where}: {got} != {want}"


def assert_same_training(history, reference, where):
    """Two runs of train.main, step by step: the same losses, gradient norms and accuracies within 1e-5."""
    for key in ("loss", "grad_norm", "accuracy"):
        torch.testing.assert_close([r[key] for r in history], [r[key] for r in reference], rtol=0, atol=1e-5,
                                   msg=lambda m: f"{where}, {key}: {m}")


def grads(model):
    """{parameter name: its gradient}."""
    return {name: p.grad for name, p in model.named_parameters()}


# ================================================================================================================
# Inputs that several test files use


def sp_slice(full, rank, world_size, dim=1):
    """This rank's part of a full tensor, cut along the sequence (dim 1) or the heads (dim 2)."""
    return full.chunk(world_size, dim=dim)[rank]


def qkv(B, S, Hq, Hkv, D):
    """Fixed random q, k, v and a gradient of the output, each [B, S, heads, D]."""
    g = torch.Generator().manual_seed(Hq * 100 + Hkv)
    return [torch.randn(B, S, h, D, generator=g) for h in (Hq, Hkv, Hkv, Hq)]  # q, k, v, grad of out


DOC_LENGTHS = [8, 11, 3, 10]  # S = 32; with sp 4 (8 tokens a rank): a document starts exactly at a shard
                              # boundary (8), one straddles two (8..19), one is shorter than a shard (19..22)


def packed_batch(changed_document=None):
    """Two rows of the same four documents (the second row reversed, its first one continued from an earlier
    sample, as packed text goes on from one sample to the next). changed_document: new tokens for it."""
    g = torch.Generator().manual_seed(7)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in DOC_LENGTHS]
    if changed_document is not None:
        docs[changed_document] = torch.randint(0, 256, (DOC_LENGTHS[changed_document],), generator=g)
    rows = [docs, docs[::-1]]
    inputs = torch.stack([torch.cat(r) for r in rows])  # (2, 32)
    labels = torch.stack([torch.cat([torch.cat([d[1:], torch.tensor([-100])]) for d in r]) for r in rows])
    position_ids = torch.stack([torch.cat([torch.arange(len(d)) for d in r]) for r in rows])  # 0 at each start
    position_ids[1, :DOC_LENGTHS[-1]] += 13  # the second row opens inside a document that began a sample before
    return inputs, labels, position_ids


def zero_batch():
    """A batch of 8 rows of 16 tokens, about a fifth of the labels -100: (input ids, position ids, labels)."""
    g = torch.Generator().manual_seed(5)
    idx, labels = torch.randint(0, 255, (8, 16), generator=g), torch.randint(0, 255, (8, 16), generator=g)
    labels[torch.rand(8, 16, generator=g) < 0.2] = -100
    return idx, torch.arange(16).expand(8, 16), labels


# text for train.py --data
PARAGRAPHS = "\n\n".join(f"paragraph {i}: " + "ab " * (i % 7) for i in range(40))  # 40 of 13 to 33 bytes

# runs of train.py in this process that save every 3 steps, for the checkpoint and failure tests
SHORT_RUN = ["--steps", "6", "--save-every", "3", "--n-layer", "2", "--n-embd", "32", "--seq-len", "32"]


# ================================================================================================================
# A line of progress while a test runs


@pytest.hookimpl(wrapper=True, trylast=True)  # trylast: inside the capture of the call
def pytest_runtest_call(item):
    """Every 10 s of a test, how long it has run, on the terminal (after its name with -v): a multi-rank test takes
    up to half a minute here, and the suite should never sit silent that long. The thread lives inside the test's
    call, while pytest captures its output, and lifts the capture for the moment it writes, as pytest's own live
    logging does; what the test prints in that moment reaches the terminal instead."""
    plugins = item.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if not (reporter and capture):  # absent under -p no:terminal or -p no:capture
        return (yield)
    start = time.monotonic()

    def tick():
        if time.monotonic() - start >= 10:  # not at the start
            with capture.global_and_fixture_disabled():
                reporter.write(f" {time.monotonic() - start:.0f} s", flush=True)

    with launch.repeating(tick, 10):
        return (yield)
