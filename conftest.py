"""
What every test file shares. The tests run on a CPU-only machine: a multi-rank case starts 2, 3, 4 or 8
processes that talk over gloo (run_ranks), or train.py under torchrun (torchrun), and compares against the
obvious single-device computation in float32.

    python -m pytest -v                  # every test file
    python -m pytest -v test_ring.py     # one of them

pytest loads this file before the test files; they import what they need from it by name
(`from conftest import run_ranks`).

No test can stall the suite: each has a time limit (LIMIT seconds, or its own `@pytest.mark.limit(seconds)`),
the rank processes' gloo group gives up on a collective after GROUP_TIMEOUT seconds, and every process a test
starts (rank processes, torchrun and its workers) is ended when the test ends, whether it passed or failed.
"""

import contextlib
import datetime
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

import ring
import train
import ulysses
from harness import launch

HERE = os.path.dirname(os.path.abspath(__file__))
if "OMP_NUM_THREADS" not in os.environ:  # one thread a process, this one and those it starts: the tests' models are
    os.environ["OMP_NUM_THREADS"] = "1"  # small, and on a busy machine threads that wait for each other take many
    torch.set_num_threads(1)  # times as long (train.py then leaves the thread count alone)
LIMIT = 240  # seconds a test may run, unless it says otherwise (@pytest.mark.limit): the longest takes 30 s idle
GROUP_TIMEOUT = 60  # seconds a collective of the rank processes waits for its peers (gloo's default: 30 minutes)
TICK = 10  # seconds between the lines of progress a running test writes


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
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    result = fn(rank, world_size, *args)
    torch.save(result, os.path.join(result_dir, f"{rank}.pt"))
    dist.barrier()  # no rank tears the group down while another still talks to it
    dist.destroy_process_group()


def pytest_collection_finish(session):
    """Rank processes are forked from a server process that has imported this file and the test files (and so
    torch and the files they test) but computed nothing, so they start in a fraction of a second, and never
    inherit a thread pool that a fork would leave broken. It imports what torch would import in every rank on
    first use, too: dynamo (AdamW's constructor imports it, a second) and inductor (torch.compile's). fn travels to
    a rank by its name, e.g. test_gpt._gpt_rank, and is found there among the modules already imported."""
    tested = sorted({item.module.__name__ for item in session.items})
    mp.set_forkserver_preload(["conftest", "torch._dynamo", "torch._inductor.compile_fx", *tested])


def run_ranks(world_size, fn, *args):
    """Run fn(rank, world_size, *args) on world_size gloo processes; return the list of what each rank returned.
    fn must be a top-level function of a test file (or of this one)."""
    with tempfile.TemporaryDirectory() as result_dir:
        ranks = mp.start_processes(_worker, args=(world_size, free_port(), fn, args, result_dir), nprocs=world_size,
                                   join=False, start_method="forkserver")
        _running.extend(ranks.processes)  # ended with the test, should it fail or run out of time first
        while not ranks.join():  # returns once every rank has ended; raises if one failed
            pass
        return [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def train_rank(rank, world_size, runs):
    """train.main once per run on this rank (for run_ranks); a run is its argv, or (argv, a checkpoint that rank 0
    first copies into the run's --out-dir, for it to resume from). Returns each run's (metrics, what it printed)."""
    results = []
    for entry in runs:
        argv, resume_from = entry if isinstance(entry, tuple) else (entry, None)
        if resume_from:
            if rank == 0:
                out_dir = argv[argv.index("--out-dir") + 1]
                shutil.copytree(resume_from, os.path.join(out_dir, os.path.basename(resume_from)))
            if dist.is_initialized():
                dist.barrier()
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            history = train.main(argv)
        results.append((history, printed.getvalue()))
    return results


# ================================================================================================================
# train.py as a user runs it: under torchrun, in processes of its own


def torchrun(nproc, *argv):
    """The command line of train.py under torchrun on this machine (argv: torchrun's own flags)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv,
            "train.py"]


def start(cmd, cwd=HERE, **popen):
    """Start a command (its output and errors together, as text, in .stdout) as a process of this test: it and
    every process it starts end with the test."""
    process = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    _running.append(process)
    return process


def run(cmd, cwd=HERE, timeout=120, **popen):
    """Run a command to its end, within timeout seconds. Returns (exit status, output, seconds)."""
    begun = time.monotonic()
    process = start(cmd, cwd, **popen)
    output, _ = process.communicate(timeout=timeout)
    return process.returncode, output, time.monotonic() - begun


def exit_statuses(output):
    """{rank: exit status} of the ranks that failed, from torchrun's closing report ("rank : 1 (local_rank: 1)",
    then "exitcode : 143 (pid: ...)"); {} when every rank exited 0."""
    return {int(rank): int(status) for rank, status in
            re.findall(r"^ +rank +: (\d+) \(local_rank: \d+\)\n +exitcode +: (-?\d+)", output, re.M)}


def torchrun_patched(tmp_path, patch, argv, launcher=(), timeout=120):
    """train.py's main under torchrun on 2 ranks (launcher: torchrun's flags), after `patch` (Python source) ran on
    rank 1 alone. Returns (exit status, output, seconds)."""
    script = tmp_path / "patched_train.py"
    script.write_text(f"import os, signal, sys, time\nsys.path.insert(0, {HERE!r})\nimport data, train\n"
                      f"from harness import checkpoint, memory\nif os.environ['RANK'] == '1':\n"
                      + "".join(f"    {line}\n" for line in patch.splitlines()) + "train.main()\n")
    return run(torchrun(2, *launcher)[:-1] + [str(script), *argv], timeout=timeout)


def start_long_run(tmp_path, extra, timeout=300):
    """torchrun with 2 ranks on a tiny model for 300 steps, saving every 10; once the first checkpoint is written,
    returns (process, out_dir, its worker pids), for a test to kill or stop a worker."""
    out_dir = tmp_path / "run"
    launcher = start(torchrun(2, *extra) + ["--steps", "300", "--seq-len", "32", "--n-embd", "32", "--save-every",
                                            "10", "--out-dir", str(out_dir), "--timeout", str(timeout)])
    deadline = time.time() + 90
    while not (out_dir / "step_000010").exists() and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.05)
    workers = children(launcher.pid)
    assert len(workers) == 2, "the workers were not found"
    return launcher, out_dir, workers


def children(pid):
    """The pids of a process's children (a torchrun's are its workers), in order."""
    found = []
    for child in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError), open(f"/proc/{child}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[1] == str(pid):
                found.append(int(child))
    return sorted(found)


_running = []  # what the running test started: subprocess.Popen and rank processes (multiprocessing.Process)


def end_processes():
    """End every process the test started that is still running, and every process those started (torchrun
    starts each worker in a session of its own, so only the family tree finds them): SIGSTOP, SIGKILL, reap."""
    while _running:
        process = _running.pop()
        if (process.poll() if isinstance(process, subprocess.Popen) else process.exitcode) is not None:
            continue  # ended, and reaped: its pid may be another process's by now
        family, unseen = [], [process.pid]
        while unseen:  # the whole tree first, each stopped before its children are read, so that none starts another
            for pid in unseen:  # meanwhile; a worker whose launcher is gone has no parent to be found by
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
            family += unseen
            unseen = [child for pid in unseen for child in children(pid)]
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait() if isinstance(process, subprocess.Popen) else process.join()


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


def summed(per_rank):
    """{name: the sum over the ranks} of one {name: tensor} a rank: each rank's gradient of its own tokens' loss,
    summed, is the gradient of the whole batch's."""
    return {name: sum(rank[name] for rank in per_rank) for name in per_rank[0]}


def whole_sequence(parts, indices=None):
    """The full [B, S, ...] tensor from each rank's [B, S/P, ...] part: in rank order, or each part at its rank's
    token indices, [S/P] (a ring's zigzag order; my_tokens) or [B, S/P] (each row its own: ring.shard_for_ring's
    token_index with documents.document_layout)."""
    if indices is None:
        return torch.cat(parts, dim=1)
    B = parts[0].shape[0]
    full = parts[0].new_zeros(B, sum(index.shape[-1] for index in indices), *parts[0].shape[2:])
    for index, part in zip(indices, parts):
        full[torch.arange(B)[:, None], index.expand(B, -1)] = part
    return full


def attention_and_grads(q, k, v, grad_out, attn_fn=ulysses.causal_attention, **kwargs):
    """One device: attn_fn(q, k, v, **kwargs) over the whole sequence and the gradients of q, k and v for
    grad_out: [output, dq, dk, dv]."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = attn_fn(q, k, v, **kwargs)
    out.backward(grad_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def attention_formula(q, k, v, grad_out, window=None, position_ids=None, sinks=None):
    """One device, by the formula, in float64: causal attention of q [B, S, Hq, D] over k and v [B, S, Hkv, D]
    (within the last `window` tokens; inside each document of position_ids [B, S]; with sinks [Hq], a logit per
    query head that joins each query's softmax as one more score and adds no value, gpt-oss's attention sinks), and
    the gradients for grad_out: [out, dq, dk, dv], and with sinks their gradient last."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    B, S, Hq, D = q.shape
    i = torch.arange(S)
    visible = (i[:, None] >= i) & ((i[:, None] - i < window) if window else True)  # (S, S)
    if position_ids is not None:
        document = (position_ids == 0).cumsum(1)  # (B, S)
        visible = visible & (document[:, :, None] == document[:, None, :])  # (B, S, S)
    G = Hq // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(G, dim=2)) * D ** -0.5  # (B, Hq, S, S)
    scores = scores.masked_fill(~visible.view(-1, 1, S, S), float("-inf"))
    inputs = [q, k, v]
    if sinks is not None:
        inputs.append(sinks.detach().double().requires_grad_())
        scores = torch.cat([scores, inputs[-1].view(1, Hq, 1, 1).expand(B, Hq, S, 1)], dim=-1)  # (B, Hq, S, S + 1)
    p = scores.softmax(-1)[..., :S]  # the sink's column dropped: it adds no value
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(G, dim=2))  # (B, S, Hq, D)
    return [out.detach(), *torch.autograd.grad(out, inputs, grad_out.double())]


def bytes_line(printed, what="all-to-all"):
    """From train.py's summary, under its line that says what the bytes count, the line of `what` ("all-to-all",
    "ring", "context-parallel Gated DeltaNet"): [bytes sent, the formula's bytes] and, where the line gives them,
    [calls forward, calls backward] per layer and micro-step (of all layers, where they are of two kinds)."""
    said = r"^bytes rank 0 sent in one optimizer step, all \d+ layers and \d+ micro-steps?, forward and backward"
    assert re.search(said, printed, re.M), f"no line says what the bytes count in: {printed}"
    line = re.search(rf"^  {what}: ([\d,]+) \(formula ([\d,]+)\)"
                     rf"(?:; \w+ per (?:layer per )?micro-step(?:, all layers)?: ([\d.]+) forward, ([\d.]+) backward)?$", printed, re.M)
    assert line, f"no {what} line in: {printed}"
    return [float(n.replace(",", "")) for n in line.groups() if n is not None]


# ================================================================================================================
# Inputs that several test files use


def my_tokens(S, group, ring_group=None):
    """The global indices of this rank's tokens of a sequence of S, in the order ulysses.shard_for_sp gives them
    (with a ring group, ring.shard_for_ring's zigzag order): [S/P]."""
    full = [torch.arange(S)[None]] * 3  # input ids, labels, positions: (1, S)
    shards = ulysses.shard_for_sp(*full, group) if ring_group is None else ring.shard_for_ring(*full, group, ring_group)
    return shards[0][0]


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


@pytest.fixture
def text_file(tmp_path):
    """A file of PARAGRAPHS, for --data."""
    path = tmp_path / "text.txt"
    path.write_text(PARAGRAPHS)
    return path


@pytest.fixture
def one_rank(monkeypatch):
    """train.main in this process is a run of one rank, whatever the environment says."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")


# runs of train.py in this process that save every 3 steps, for the checkpoint and failure tests
SHORT_RUN = ["--steps", "6", "--save-every", "3", "--n-layer", "2", "--n-embd", "32", "--seq-len", "32"]


# ================================================================================================================
# Each test: its time limit, the end of the processes it started, a line of progress while it runs


def pytest_configure(config):
    config.addinivalue_line("markers", "limit(seconds): the test's time limit, in place of conftest.LIMIT")


@pytest.hookimpl(wrapper=True, trylast=True)  # trylast: inside the capture of the call
def pytest_runtest_call(item):
    """The test's time limit (SIGALRM interrupts whatever the test waits on: a rank, a subprocess, a sleep), and
    the end of every process it started, pass or fail.

    Every TICK seconds of a test, how long it has run, on the terminal (after its name with -v): a multi-rank test
    takes up to half a minute here, and the suite should never sit silent that long. The thread lives inside the
    test's call, while pytest captures its output, and lifts the capture for the moment it writes, as pytest's own
    live logging does; what the test prints in that moment reaches the terminal instead. Lifting the capture and
    putting it back sets sys.stdout and sys.stderr anew, so a test's own redirect of them (train_rank's) is put back
    after."""
    marker = item.get_closest_marker("limit")
    limit = marker.args[0] if marker else LIMIT

    def out_of_time(signum, frame):
        pytest.fail(f"{item.name} ran past its limit of {limit} s; its processes are ended", pytrace=False)

    before = signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(limit)
    try:
        plugins = item.config.pluginmanager
        reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
        if not (reporter and capture):  # absent under -p no:terminal or -p no:capture
            return (yield)
        start = time.monotonic()

        def tick():
            if time.monotonic() - start >= TICK:  # not at the start
                streams = sys.stdout, sys.stderr  # pytest's capture, or the test's own redirect of it
                with capture.global_and_fixture_disabled():
                    reporter.write(f" {time.monotonic() - start:.0f} s", flush=True)
                sys.stdout, sys.stderr = streams

        with launch.repeating(tick, TICK):
            return (yield)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
        end_processes()
