"""
Tests, runnable on a CPU-only machine: every multi-rank case starts 2, 3 or 4 processes that talk over gloo,
and compares against the obvious single-device computation in float32. Sections follow the files in reading
order: ulysses, tiled, gpt, zero3, train, failures.

    pytest -v test_ulysses.py -k "not compile and not test_ring"   # the quick suite
    pytest -v test_ulysses.py -k "compile or test_ring"            # torch.compile, ring attention, USP
"""

import argparse
import contextlib
import io
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from functools import partial

import pytest
import torch
import torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.optim.optimizer import register_optimizer_step_pre_hook

import bench
import data
import deltanet
import gpt
import ring
import tiled
import train
import ulysses
import zero3
from gpt import GPT, GPTConfig

HERE = os.path.dirname(os.path.abspath(__file__))


class _StillRunning:
    """Every 10 s of a test, how long it has run, on the terminal (after its name with -v): a multi-rank test takes
    up to half a minute here, and the suite should never sit silent that long. The thread lives inside the test's
    call, while pytest captures its output, and lifts the capture for the moment it writes, as pytest's own live
    logging does; what the test prints in that moment reaches the terminal instead."""

    def __init__(self, reporter, capture, every=10):
        self.reporter, self.capture, self.every = reporter, capture, every

    @pytest.hookimpl(wrapper=True, trylast=True)  # trylast: inside the capture of the call
    def pytest_runtest_call(self, item):
        start = time.monotonic()

        def tick():
            if time.monotonic() - start >= self.every:  # not at the start
                with self.capture.global_and_fixture_disabled():
                    self.reporter.write(f" {time.monotonic() - start:.0f} s", flush=True)

        with train.repeating(tick, self.every):
            return (yield)


@pytest.fixture(scope="session", autouse=True)
def _still_running(request):
    """Registers _StillRunning for the session (a test module cannot hold pytest hooks itself), before the first
    test's call."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if reporter and capture:  # absent under -p no:terminal or -p no:capture
        plugins.register(_StillRunning(reporter, capture))


def _free_port():
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


# Rank processes are forked from a server process that has imported torch and this file but computed nothing,
# so they start in a fraction of a second, and never inherit a thread pool that a fork would leave broken.
mp.set_forkserver_preload([__name__])


def run_ranks(world_size, fn, *args):
    """Run fn(rank, world_size, *args) on world_size gloo processes; return the list of what each rank returned."""
    with tempfile.TemporaryDirectory() as result_dir:
        mp.start_processes(_worker, args=(world_size, _free_port(), fn, args, result_dir), nprocs=world_size,
                           start_method="forkserver")
        return [torch.load(os.path.join(result_dir, f"{r}.pt"), weights_only=False) for r in range(world_size)]


def torchrun(nproc, *argv):
    """The command line of train.py under torchrun on this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv,
            "train.py"]


def grads(model):
    return {name: p.grad for name, p in model.named_parameters()}


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


def _sp_slice(full, rank, world_size, dim=1):
    return full.chunk(world_size, dim=dim)[rank]


# ================================================================================================================
# ulysses.py: the batch, the head layout, the all-to-all, attention


def _shard_and_all_to_all_rank(rank, world_size, dtype):
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 9, (2, 13), generator=g), torch.randint(0, 9, (2, 13), generator=g)
    labels[0, :5] = -100
    shard = ulysses.shard_for_sp(ids, labels, torch.arange(13).expand(2, 13), group)
    valid = ulysses.global_valid_tokens([shard[1], shard[1][:1]], group)  # two micro-batches
    full = torch.randn(2, 12, 4 * world_size, 3, generator=g).to(dtype)  # (B, S, H, D)
    local = _sp_slice(full, rank, world_size).clone().requires_grad_()  # (B, S/P, H, D): my tokens
    heads = ulysses.seq_to_heads(local, group).mul_(1.0)  # (B, S, H/P, D): all tokens, my heads; in place is fine
    back = ulysses.heads_to_seq(heads, group)
    grad_heads = torch.randn(heads.shape, generator=torch.Generator().manual_seed(1 + rank)).to(dtype)
    heads.backward(grad_heads)
    # uneven heads, two tensors in one call: 5 heads and 3 heads over the ranks as head_layout splits them
    five, three = (_sp_slice(torch.randn(2, 12, h, 3, generator=g).to(dtype), rank, world_size) for h in (5, 3))
    layouts = (ulysses.head_layout(5, 5, world_size)[0], ulysses.head_layout(3, 3, world_size)[0])
    pair = ulysses.seq_to_heads((five, three), group, layouts)
    return (shard, valid, heads.detach(), back.detach(), local.grad, ulysses.heads_to_seq(grad_heads, group),
            pair, ulysses.heads_to_seq(pair, group, layouts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_shard_for_sp_and_the_all_to_all(world_size, dtype):
    """shard_for_sp pads at the end and keeps global positions; the valid-token count covers every rank; the
    all-to-all gives each rank exactly its heads of every token, heads_to_seq undoes it, and the backward of
    seq_to_heads is heads_to_seq (one tensor: the plain all_to_all); uneven head counts and several tensors in
    one call (the fused exchange) work the same way. In bf16 too, bit for bit: the exchanges only move data."""
    results = run_ranks(world_size, _shard_and_all_to_all_rank, dtype)
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 9, (2, 13), generator=g), torch.randint(0, 9, (2, 13), generator=g)
    labels[0, :5] = -100
    full = torch.randn(2, 12, 4 * world_size, 3, generator=g).to(dtype)
    five, three = (torch.randn(2, 12, h, 3, generator=g).to(dtype) for h in (5, 3))
    pad = -13 % world_size
    for i, want in enumerate((torch.cat([ids, torch.zeros(2, pad, dtype=torch.long)], 1),
                              torch.cat([labels, torch.full((2, pad), -100)], 1),
                              torch.arange(13 + pad).expand(2, -1))):
        assert torch.equal(torch.cat([r[0][i] for r in results], dim=1), want)
    assert all(r[1] == (labels != -100).sum() + (labels[:1] != -100).sum() for r in results)
    for rank, (_, _, heads, back, grad, inverse_of_grad, pair, pair_back) in enumerate(results):
        assert heads.dtype == dtype and torch.equal(heads, _sp_slice(full, rank, world_size, dim=2))  # my heads
        assert torch.equal(back, _sp_slice(full, rank, world_size))
        assert torch.equal(grad, inverse_of_grad)
        for got, x, n in zip(pair, (five, three), (5, 3)):
            mine = ulysses.head_layout(n, n, world_size)[0][rank]
            assert torch.equal(got, x[:, :, mine.start:mine.stop])
            assert got.transpose(1, 2).is_contiguous()  # the fused exchange stores head-major, as SDPA reads it
        for got, x in zip(pair_back, (five, three)):
            assert torch.equal(got, _sp_slice(x, rank, world_size))


def _layout_by_hand(n_head, n_kv_head, P):
    """The head layout from its definition: contiguous runs of query heads, the first n_head % P ranks one more,
    and each rank's kv heads the set its query heads use."""
    sizes = [n_head // P + (r < n_head % P) for r in range(P)]
    query = [list(range(sum(sizes[:r]), sum(sizes[:r + 1]))) for r in range(P)]
    return query, [sorted({h // (n_head // n_kv_head) for h in heads}) for heads in query]


def test_head_layout():
    query, kv = ulysses.head_layout(6, 2, 4)  # the docstring's picture
    assert [list(r) for r in query] == [[0, 1], [2, 3], [4], [5]] and [list(r) for r in kv] == [[0], [0, 1], [1], [1]]
    for P, Hq, Hkv in [(P, Hq, Hkv) for Hq in range(1, 13) for Hkv in range(1, Hq + 1) if Hq % Hkv == 0
                       for P in range(1, Hq + 1)]:
        query, kv = ulysses.head_layout(Hq, Hkv, P)
        assert ([list(r) for r in query], [list(r) for r in kv]) == _layout_by_hand(Hq, Hkv, P)
    with pytest.raises(ValueError, match=r"sp=8 is larger than n_head=6: a rank would hold no head; "
                                         r"choose sp in \{1, 2, 3, 4, 5, 6\}"):
        ulysses.head_layout(6, 6, 8)
    with pytest.raises(ValueError, match=r"n_head=8 is not a multiple of n_kv_head=3; choose n_kv_head in "
                                         r"\{1, 2, 4, 8\}"):
        GPTConfig(n_head=8, n_kv_head=3, n_embd=64)


EVEN_CASES = [(2, 4, 4), (4, 8, 8), (2, 8, 2), (4, 8, 4), (4, 8, 2), (4, 4, 1)]  # (P, Hq, Hkv)
UNEVEN_CASES = [(4, 6, 6), (4, 6, 2), (4, 6, 3), (3, 8, 8), (3, 8, 2), (3, 4, 1), (4, 12, 4), (4, 5, 5), (2, 3, 1)]
KERNELS = [(ulysses.causal_attention, {}), (ulysses.sliding_window_attention, {"window": 5})]


def _qkv(B, S, Hq, Hkv, D):
    g = torch.Generator().manual_seed(Hq * 100 + Hkv)
    return [torch.randn(B, S, h, D, generator=g) for h in (Hq, Hkv, Hkv, Hq)]  # q, k, v, grad of out


def _attention_rank(rank, world_size, cases):
    results = []
    for P, Hq, Hkv in cases:
        q, k, v, grad_out = (_sp_slice(t, rank, P) for t in _qkv(2, 24, Hq, Hkv, 8))
        for attn_fn, kwargs in KERNELS:
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            ulysses.reset_all_to_all_stats()
            out = ulysses.ulysses_attention(q, k, v, dist.group.WORLD, attn_fn, **kwargs)
            out.backward(grad_out)
            stats = {d: dict(c) for d, c in ulysses.all_to_all_stats.items()}
            results.append(((out.detach(), q.grad, k.grad, v.grad), stats))
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ulysses_attention_matches_one_device(world_size):
    """Output and dq, dk, dv against one device, for even and uneven head layouts (MHA, GQA, kv heads fewer
    than ranks, query heads of one rank using their kv heads unevenly), with causal and sliding-window kernels.
    Each rank sends exactly the bytes of its head layout, in one all-to-all each way and direction."""
    cases = [c for c in EVEN_CASES + UNEVEN_CASES if c[0] == world_size]
    per_rank = run_ranks(world_size, _attention_rank, cases)
    for i, ((P, Hq, Hkv), (attn_fn, kwargs)) in enumerate((c, k) for c in cases for k in KERNELS):
        q, k, v, grad_out = _qkv(2, 24, Hq, Hkv, 8)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = attn_fn(q, k, v, **kwargs)
        out.backward(grad_out)
        got = [torch.cat(pieces, dim=1) for pieces in zip(*(r[i][0] for r in per_rank))]
        assert_all_close(got, [out, q.grad, k.grad, v.grad], where=f"P={P} Hq={Hq} Hkv={Hkv} {attn_fn.__name__}")
        query, kv = _layout_by_hand(Hq, Hkv, P)
        unit = 2 * 24 // P * 8 * 4  # bytes of one head of a rank's tokens: B * S/P * D float32
        for rank, (_, stats) in enumerate(r[i] for r in per_rank):
            others = [j for j in range(P) if j != rank]
            to_heads = sum(len(query[j]) + 2 * len(kv[j]) for j in others)  # q, k, v: other ranks' heads
            to_seq = (P - 1) * len(query[rank])  # the output: my heads of the other ranks' tokens
            assert stats["forward"] == {"calls": 2, "bytes": unit * (to_heads + to_seq)}
            back_to_heads = sum(len(query[j]) for j in others)  # the output's gradient, then q's, k's and v's
            back_to_seq = (P - 1) * (len(query[rank]) + 2 * len(kv[rank]))
            assert stats["backward"] == {"calls": 2, "bytes": unit * (back_to_heads + back_to_seq)}
            if Hq % P == 0 and (Hkv % P == 0 or P % Hkv == 0):  # even: what the even split always sent
                kv_sent = Hkv if Hkv % P == 0 else P  # P % Hkv == 0: every rank gets one kv head
                assert stats["forward"]["bytes"] == unit * (2 * Hq + 2 * kv_sent) * (P - 1) // P


BASELINE = dict(S=24, Hq=8, Hkv=4, D=8)  # (c) needs P to divide both head counts


def _baselines_rank(rank, world_size):
    results = []
    for B in (1, 2):  # B = 1: (c) copies once per all-to-all; B = 2: twice
        for baseline in (bench.three_all_to_alls, bench.gathered_kv):
            q, k, v, grad_out = (_sp_slice(t, rank, world_size) for t in _qkv(B, *BASELINE.values()))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            ulysses.reset_all_to_all_stats()
            bench.gather_stats["bytes"] = 0
            out = baseline(q, k, v, dist.group.WORLD)
            out.backward(grad_out)
            sent = bench.gather_stats["bytes"] + sum(c["bytes"] for c in ulysses.all_to_all_stats.values())
            results.append(((out.detach(), q.grad, k.grad, v.grad), sent))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_benchmark_baselines_match_one_device(world_size):
    """What python bench.py attention times against ulysses_attention computes the same attention: (c) q, k and
    v in three all-to-alls and (d) all-gathered k and v, output and dq, dk, dv against one device, B = 1 and 2,
    each sending the bytes of its formula."""
    per_rank = run_ranks(world_size, _baselines_rank)
    P, (S, Hq, Hkv, D) = world_size, BASELINE.values()
    for i, (B, name) in enumerate((B, name) for B in (1, 2) for name in ("(c)", "(d)")):
        q, k, v, grad_out = _qkv(B, S, Hq, Hkv, D)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = ulysses.causal_attention(q, k, v)
        out.backward(grad_out)
        got = [torch.cat(pieces, dim=1) for pieces in zip(*(r[i][0] for r in per_rank))]
        assert_all_close(got, [out, q.grad, k.grad, v.grad], where=f"{name} B={B}")
        head = B * S // P * D * 4  # bytes of one head of a rank's tokens, float32
        formula = {"(c)": 2 * (Hq + 2 * Hkv + Hq) * head * (P - 1) // P,  # (P-1)/P of q, k, v and out, both ways
                   "(d)": 4 * Hkv * head * (P - 1)}[name]  # k and v to every other rank, their gradients back
        assert [r[i][1] for r in per_rank] == [formula] * P, f"{name} B={B}"


def _dense_attention(q, k, v, allowed):
    """The textbook formula with an explicit [S, S] (or [B, S, S]) mask of allowed query-key pairs."""
    k, v = (t.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed.view(-1, 1, *allowed.shape[-2:]), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def test_attention_kernels_match_the_dense_formula():
    q, k, v, _ = _qkv(2, 16, 4, 2, 8)
    i = torch.arange(16)
    causal = i[:, None] >= i[None, :]
    torch.testing.assert_close(ulysses.causal_attention(q, k, v), _dense_attention(q, k, v, causal))
    torch.testing.assert_close(ulysses.sliding_window_attention(q, k, v, window=5),
                               _dense_attention(q, k, v, causal & (i[:, None] - i[None, :] < 5)))
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 0, 1],
                                 [5, 6, 7, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])  # row 1 opens mid-document
    document = (position_ids == 0).cumsum(1)  # (B, S): which document each token is in
    same_document = document[:, :, None] == document[:, None, :]  # (B, S, S)
    torch.testing.assert_close(ulysses.document_attention(q, k, v, position_ids),
                               _dense_attention(q, k, v, causal & same_document))
    torch.testing.assert_close(ulysses.document_attention(q, k, v, position_ids, window=3),
                               _dense_attention(q, k, v, causal & same_document & (i[:, None] - i[None, :] < 3)))


COMPILE_CASES = {2: [(4, 2)], 3: [(6, 2)], 4: [(6, 3)]}  # P: (Hq, Hkv); GQA, and 3 and 4 split kv heads unevenly


def _compiled_attention_rank(rank, world_size, backend):
    """ulysses_attention compiled with fullgraph (any break is an error) against eager, for two sequence lengths
    marked dynamic; per head layout, the largest difference (outputs and input gradients) and the graphs made."""
    results = []
    for Hq, Hkv in COMPILE_CASES[world_size]:
        torch._dynamo.reset()  # a model has one head layout: each case starts afresh
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(ulysses.ulysses_attention, backend=backend, fullgraph=True)
        worst = 0.0
        for S in (24, 36):
            q, k, v, grad_out = (_sp_slice(t, rank, world_size) for t in _qkv(2, S, Hq, Hkv, 8))
            pair = []
            for attention in (ulysses.ulysses_attention, compiled):
                inputs = [t.clone().requires_grad_() for t in (q, k, v)]
                for t in inputs:
                    torch._dynamo.mark_dynamic(t, 1)  # the sequence length
                out = attention(*inputs, dist.group.WORLD)
                pair.append([out, *torch.autograd.grad(out, inputs, grad_out)])
            worst = max([worst] + [(a - b).abs().max().item() for a, b in zip(*pair)])
        results.append((worst, torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_compiled_attention_matches_eager(world_size):
    """torch.compile(ulysses_attention, fullgraph=True) traces the exchange without a break (the all-to-all is
    an operator of its own) and equals eager, forward and backward, with uneven heads and GQA; a second sequence
    length, marked dynamic, reuses the graph."""
    for rank_results in run_ranks(world_size, _compiled_attention_rank, "aot_eager"):
        assert rank_results == [(pytest.approx(0, abs=1e-6), 1)] * len(COMPILE_CASES[world_size])


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_compiled_attention_inductor(world_size):
    """The same with inductor, which generates code around the exchange (slow: a compile per head layout)."""
    for rank_results in run_ranks(world_size, _compiled_attention_rank, "inductor"):
        assert rank_results == [(pytest.approx(0, abs=1e-6), 1)] * len(COMPILE_CASES[world_size])


USER_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
import torch
import torch.distributed as dist
import ring
import ulysses

torch.set_num_threads(1)
dist.init_process_group("gloo")
group = dist.group.WORLD  # held until the interpreter exits, as user scripts do
q, k, v = (torch.randn(2, 16, 4, 8, requires_grad=True) for _ in range(3))
ulysses.ulysses_attention(q, k, v, group).sum().backward()
ring.ring_attention(q, k, v, group).sum().backward()  # the last communication: the ring's sends
dist.destroy_process_group()
"""


def test_ring_and_ulysses_user_script_exits_cleanly(tmp_path):
    """ulysses_attention and then ring_attention, forward and backward, destroy_process_group, exit: status 0 on
    every rank, every time (gloo's worker threads once outlived such a script's last collective and aborted it
    at exit). In the second suite, with the ring tests."""
    script = tmp_path / "user_script.py"
    script.write_text(USER_SCRIPT.format(here=HERE))
    for run in range(3):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                               str(script)], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, PYTHONWARNINGS="error:::ulysses"))
        assert done.returncode == 0 and "terminate called" not in done.stderr, (run, done.stderr[-2000:])


# ================================================================================================================
# ring.py: ring attention, and Ulysses x Ring (USP). Every test name starts "test_ring": the second suite runs them.

RING_CASES = [("zigzag", torch.float64, None), ("contiguous", torch.float64, None), ("zigzag", torch.float32, None),
              ("contiguous", torch.float32, None), ("zigzag", torch.float64, 3),
              ("zigzag", torch.bfloat16, None)]  # (layout, dtype, window)
# bf16: the ring computes in float32 from bf16 inputs, against one device in float64 from the same bf16 numbers;
# what remains is the rounding of each result to bf16 (8 significant bits: 2^-9 relative) and a float32 sum
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2 ** -7}


def _full_attention(q, k, v, window, grad_out):
    """One device: output and dq, dk, dv of causal (or sliding-window) attention over the whole sequence."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = ulysses.sliding_window_attention(q, k, v, window) if window else ulysses.causal_attention(q, k, v)
    out.backward(grad_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def _ring_rank(rank, R, cases):
    ring.QUERY_TILE = 5  # several query tiles a block
    results = []
    for layout, dtype, window in cases:
        index = ring.token_index(layout, rank, R, 24 // R)
        q, k, v, grad_out = (t.to(dtype)[:, index].requires_grad_() for t in _qkv(2, 24, 4, 2, 8))
        ring.reset_ring_stats()
        out = ring.ring_attention(q, k, v, dist.group.WORLD, layout, window)
        out.backward(grad_out)
        results.append(([out.detach(), q.grad, k.grad, v.grad], {d: dict(c) for d, c in ring.ring_stats.items()}))
    return results


@pytest.mark.parametrize("R", [2, 3, 4])
def test_ring_attention_matches_one_device(R):
    """Output and dq, dk, dv of ring attention on R ranks against one device: batch 2, GQA (4 query heads, 2 kv
    heads), zigzag and contiguous layouts, float64 within 1e-12 and float32 within 1e-5, bf16 within its rounding
    (outputs and gradients come back in bf16), and a sliding window.
    Each rank sends R-1 key/value blocks forward; backward those again and R dk/dv accumulators in float32. A
    backward that computed with the wrong block (the first one, say, instead of the one that arrived) fails."""
    per_rank = run_ranks(R, _ring_rank, RING_CASES)
    for i, (layout, dtype, window) in enumerate(RING_CASES):
        q, k, v, grad_out = (t.to(dtype) for t in _qkv(2, 24, 4, 2, 8))
        want = [t.to(dtype) for t in _full_attention(*(t.double() for t in (q, k, v)), window, grad_out.double())]
        got = [torch.zeros_like(t) for t in want]
        for rank in range(R):
            index = ring.token_index(layout, rank, R, 24 // R)
            for full, part in zip(got, per_rank[rank][i][0]):
                full[:, index] = part
        tolerance = TOLERANCE[dtype]
        assert_all_close(got, want, tolerance, tolerance, where=f"R={R} {layout} {dtype} window={window}")
        kv_bytes = 2 * 2 * (24 // R) * 2 * 8 * dtype.itemsize  # k and v: B * L * Hkv * D elements each
        dkv_bytes = kv_bytes * 4 // min(4, dtype.itemsize)  # their gradients, in float32 or wider
        expected = {"forward": {"calls": R - 1, "bytes": (R - 1) * kv_bytes},
                    "backward": {"calls": 2 * R - 1, "bytes": (R - 1) * kv_bytes + R * dkv_bytes}}
        assert [r[i][1] for r in per_rank] == [expected] * R
        assert ring.ring_bytes(R, kv_bytes, dkv_bytes) == (expected["forward"]["bytes"], expected["backward"]["bytes"])


def _usp_groups(U, R):
    """(Ulysses group, ring group) of this rank when the world is an SP group of U x R: U consecutive ranks form
    a Ulysses group, and the ranks at the same place in each Ulysses group a ring."""
    mesh = init_device_mesh("cpu", (R, U), mesh_dim_names=("ring", "ulysses"))
    return mesh.get_group("ulysses"), mesh.get_group("ring")


def _usp_rank(rank, P, U, R, heads, cases):
    ring.QUERY_TILE = 5  # several query tiles a block
    ulysses_group, ring_group = _usp_groups(U, R)
    S = 24
    index = ulysses.shard_for_sp(*[torch.arange(S)[None]] * 3, ulysses_group, ring_group)[0][0]  # my global tokens
    results = []
    for dtype, window in cases:
        q, k, v, grad_out = (t.to(dtype)[:, index].requires_grad_() for t in _qkv(2, S, *heads, 8))
        attend = partial(ring.ring_attention, group=ring_group, window=window)
        out = ulysses.ulysses_attention(q, k, v, ulysses_group, attend)
        out.backward(grad_out)
        results.append((index, [out.detach(), q.grad, k.grad, v.grad]))
    return results


@pytest.mark.parametrize("U, R, heads", [(2, 2, (4, 2)), (2, 3, (4, 2)), (4, 1, (4, 2)), (1, 4, (4, 2)),
                                         (3, 2, (8, 2))])
def test_ring_usp_matches_one_device(U, R, heads):
    """Ulysses x Ring on U x R ranks against one device, output and dq, dk, dv: float64 within 1e-12, float32
    within 1e-5, and a sliding window. 4 query heads and 2 kv heads (with U = 4 each kv head travels to two
    ranks), and 8 and 2 on U = 3 (uneven: 3, 3, 2 query heads, the middle rank using both kv heads).
    shard_for_sp gives each rank its tokens in the zigzag order, and every token to exactly one rank."""
    cases = [(torch.float64, None), (torch.float32, None), (torch.float64, 5)]
    per_rank = run_ranks(U * R, _usp_rank, U, R, heads, cases)
    assert sorted(torch.cat([r[0][0] for r in per_rank]).tolist()) == list(range(24))
    for i, (dtype, window) in enumerate(cases):
        q, k, v, grad_out = (t.to(dtype) for t in _qkv(2, 24, *heads, 8))
        want = _full_attention(q, k, v, window, grad_out)
        got = [torch.zeros_like(t) for t in want]
        for index, parts in (r[i] for r in per_rank):
            for full, part in zip(got, parts):
                full[:, index] = part
        tolerance = TOLERANCE[dtype]
        assert_all_close(got, want, tolerance, tolerance, where=f"U={U} R={R} heads={heads} {dtype} window={window}")


def test_ring_work_is_balanced_by_zigzag():
    """Causal work per rank (query-key pairs computed): zigzag gives every rank the same, a contiguous split
    gives the last rank R times the first rank's."""
    for R in (2, 3, 4, 8):
        L = 4 * R
        assert len(set(ring.ring_work(R, L, "zigzag"))) == 1, R
        contiguous = ring.ring_work(R, L, "contiguous")
        assert contiguous == sorted(contiguous) and contiguous[-1] == R * contiguous[0], R
    # zigzag on R ranks: my own block (a causal pair of chunks) and half of each other block
    assert ring.ring_work(4, 8, "zigzag") == [8 * 8 + 3 * 8 * 4] * 4


# ================================================================================================================
# tiled.py: the same numbers without the full activations


def _labels_with_gaps(shape):
    labels = torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(3))
    labels[:, 4:7] = -100  # with 13 tokens in 4 tiles, tile 1 (tokens 4-6) has no label at all
    labels[0, 0] = -100
    return labels


def _mlp_and_grads(run, x, weights, grad_out):
    out = run()
    out.backward(grad_out)
    result = [out.detach()] + [t.grad.clone() for t in (x, *weights)]
    for t in (x, *weights):
        t.grad = None
    return result


@pytest.mark.parametrize("S, n_tiles", [(13, 4), (13, 13), (3, 8)])
def test_tiled_mlp_matches_untiled(S, n_tiles):
    torch.manual_seed(0)
    x = torch.randn(2, S, 16, requires_grad=True)
    weights = [torch.randn(64, 16, requires_grad=True), torch.randn(16, 64, requires_grad=True)]
    grad_out = torch.randn(2, S, 16)
    assert_all_close(_mlp_and_grads(lambda: tiled.tiled_mlp(gpt.mlp, x, weights, n_tiles), x, weights, grad_out),
                     _mlp_and_grads(lambda: gpt.mlp(x, *weights), x, weights, grad_out))


@pytest.mark.parametrize("all_ignored", [False, True])
def test_tiled_loss_matches_untiled(all_ignored):
    torch.manual_seed(0)
    head = GPT(GPTConfig(vocab_size=64, n_embd=16, n_head=2, n_kv_head=2)).head
    torch.nn.init.normal_(head.norm.weight, 1.0, 0.2)  # a norm weight of ones would hide a wrong norm gradient
    x = torch.randn(2, 13, 16, requires_grad=True)
    labels = torch.full((2, 13), -100) if all_ignored else _labels_with_gaps((2, 13))
    results = []
    for tiles in (1, 4):
        head.tiles = tiles
        loss_sum, correct = head(x, labels)
        loss_sum.backward()
        results.append([loss_sum.detach(), correct, x.grad.clone(), head.norm.weight.grad.clone(),
                        head.lm_head.weight.grad.clone()])
        x.grad, head.norm.weight.grad, head.lm_head.weight.grad = None, None, None
    assert_all_close(results[1], results[0])
    if all_ignored:
        assert results[1][0].item() == 0 and all(torch.all(g == 0) for g in results[1][2:])  # 0, never NaN


def test_tiled_keeps_only_its_input_and_sends_each_gradient_once():
    """A ZeRO-3 post-accumulate-grad hook must fire once per backward, not once per tile."""
    x = torch.randn(2, 13, 16, requires_grad=True)
    weights = [torch.randn(64, 16, requires_grad=True), torch.randn(16, 64, requires_grad=True)]
    arrivals = [0, 0]
    for i, w in enumerate(weights):
        w.register_post_accumulate_grad_hook(lambda w, i=i: arrivals.__setitem__(i, arrivals[i] + 1))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = tiled.tiled_mlp(gpt.mlp, x, weights, 4)
    assert len(saved) == 1 and saved[0] is x  # not the [B, S, 4h] hidden layer
    out.sum().backward()
    assert arrivals == [1, 1]


def test_tiles_recompute_under_the_forward_autocast():
    """Backward runs outside autocast, so the tiles must re-enter the forward's autocast to recompute what forward
    computed. With bf16 weights (ZeRO-3's gathered copy under --dtype bfloat16) and a float32 input it would not
    even run."""
    torch.manual_seed(0)
    x = torch.randn(2, 13, 16, requires_grad=True)
    weights = [(torch.randn(64, 16) / 4).bfloat16().requires_grad_(),
               (torch.randn(16, 64) / 8).bfloat16().requires_grad_()]
    results = []
    for run in (lambda: gpt.mlp(x, *weights), lambda: tiled.tiled_mlp(gpt.mlp, x, weights, 4)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run()  # (B, S, h) bf16
        out.float().pow(2).sum().backward()
        results.append([out.detach().float()] + [t.grad.float() for t in (x, *weights)])
        for t in (x, *weights):
            t.grad = None
    for got, want in zip(*reversed(results)):  # bf16 arithmetic: per-tile sums round differently from one sum
        torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())


def test_tiles_keep_float64():
    """A float64 layer stays float64 tiled: the parameter gradients summed over tiles, and the loss, are never
    rounded to float32 on the way (half precision is widened to float32, nothing is ever narrowed)."""
    torch.manual_seed(0)
    x = torch.randn(2, 13, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 13))
    linear = lambda t, w: t @ w.T
    for tiled_run, plain_run in (
            (lambda: tiled.tiled_mlp(linear, x, (w,), 1), lambda: linear(x, w)),
            (lambda: tiled.tiled_mlp(linear, x, (w,), 4), lambda: linear(x, w)),
            (lambda: tiled.tiled_lm_loss(linear, x, labels, (w,), 4)[0],
             lambda: F.cross_entropy(linear(x, w).flatten(0, 1), labels.flatten(), reduction="sum"))):
        results = []
        for run in (tiled_run, plain_run):
            out = run()
            results.append([out.detach(), *torch.autograd.grad(out.sum(), (x, w))])
        assert results[0][0].dtype == torch.float64
        assert_all_close(results[0], results[1], rtol=1e-13, atol=1e-13)


# ================================================================================================================
# gpt.py: the whole model, SP=P equals SP=1, with padding, packing, tiles and recomputation

GPT_CASES = [(16, 4, 4), (13, 4, 2), (13, 4, 1)]  # (seq_len, n_head, n_kv_head); 13 is not divisible by 2, 3, 4


def _gpt_loss_and_grads(cases, group):
    results = []
    for seq_len, n_head, n_kv_head in cases:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=n_head, n_kv_head=n_kv_head, n_embd=32), sp_group=group)
        samples = (data.make_sample(i, seq_len, seed=3) for i in range(2))
        full = [torch.stack(column) for column in zip(*samples)]
        inputs, labels, position_ids = ulysses.shard_for_sp(*full, group)  # (B, S_pad/sp) each
        valid = ulysses.global_valid_tokens(labels, group)
        loss_sum, _ = model(inputs, position_ids, labels)
        (loss_sum / valid).backward()
        results.append((loss_sum.detach() / valid, grads(model)))
    return results


def _gpt_rank(rank, world_size):
    return _gpt_loss_and_grads(GPT_CASES, dist.group.WORLD)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gpt_with_sp_matches_one_device(world_size):
    """Loss and every parameter gradient, with lengths that need padding, GQA and (sp 3) uneven head layouts."""
    per_rank = run_ranks(world_size, _gpt_rank)
    for i, (reference_loss, reference_grads) in enumerate(_gpt_loss_and_grads(GPT_CASES, None)):
        # each rank holds the loss of its own tokens, and the gradient of it; summed they are the whole batch's
        torch.testing.assert_close(sum(r[i][0] for r in per_rank), reference_loss, rtol=1e-5, atol=1e-6)
        summed = {name: sum(r[i][1][name] for r in per_rank) for name in reference_grads}
        assert_all_close(summed, reference_grads, rtol=1e-4, atol=1e-6, where=str(GPT_CASES[i]))


DOC_LENGTHS = [8, 11, 3, 10]  # S = 32; with sp 4 (8 tokens a rank): a document starts exactly at a shard
                              # boundary (8), one straddles two (8..19), one is shorter than a shard (19..22)


def _packed_batch(changed_document=None):
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


def _packed_model(group, pattern, window=0):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, window=window, layer_pattern=pattern),
               sp_group=group)


def _packed_run(group, pattern, window=0, changed_document=None):
    """Logits and (grads of the mean loss) of this rank's shard of the packed batch."""
    model = _packed_model(group, pattern, window)
    inputs, labels, position_ids = ulysses.shard_for_sp(*_packed_batch(changed_document), group)
    logits = model(inputs, position_ids, packed=True)  # (B, S_pad/sp, vocab)
    loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    (loss_sum / ulysses.global_valid_tokens(labels, group)).backward()
    return logits.detach(), grads(model)


def _packed_rank(rank, world_size, pattern):
    return [_packed_run(dist.group.WORLD, pattern, window) for window in (0, 5)] + \
           [_packed_run(dist.group.WORLD, pattern, 0, changed_document=1)]


@pytest.mark.parametrize("pattern", ["a", "da"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_packed_documents_under_sp(world_size, pattern):
    """SP boundaries are not document boundaries: sp 2, 3 (uneven heads) and 4 equal one device on a packed
    batch, for causal and sliding-window attention and for Gated DeltaNet (da: a DeltaNet layer, then softmax
    attention), and no document sees another."""
    per_rank = run_ranks(world_size, _packed_rank, pattern)
    sp_results = [(torch.cat([r[i][0] for r in per_rank], dim=1)[:, :32],
                   {n: sum(r[i][1][n] for r in per_rank) for n in per_rank[0][i][1]}) for i in range(3)]
    for (logits, summed), window in zip(sp_results, (0, 5)):
        reference_logits, reference_grads = _packed_run(None, pattern, window)
        torch.testing.assert_close(logits, reference_logits, rtol=1e-5, atol=1e-5)
        assert_all_close(summed, reference_grads, rtol=1e-4, atol=1e-6, where=f"window {window}")
    # no leakage: new tokens in document 1 change its own logits and nothing else
    logits, changed = sp_results[0][0], sp_results[2][0]
    for row, order in ((0, [0, 1, 2, 3]), (1, [3, 2, 1, 0])):
        offset = 0
        for d in order:
            span = slice(offset, offset + DOC_LENGTHS[d])
            if d == 1:
                assert not torch.allclose(logits[row, span], changed[row, span], atol=1e-3)
            else:
                torch.testing.assert_close(changed[row, span], logits[row, span], rtol=0, atol=1e-5)
            offset += DOC_LENGTHS[d]


@pytest.mark.parametrize("pattern", ["a", "da"])
def test_packed_batch_equals_documents_alone(pattern):
    """Each document of a packed batch gets exactly the logits it gets when run alone from position 0."""
    model = _packed_model(None, pattern)
    inputs, _, position_ids = _packed_batch()
    packed_logits = model(inputs, position_ids, packed=True)  # (2, 32, vocab)
    offset = 0
    for n in DOC_LENGTHS:
        alone = model(inputs[:1, offset:offset + n], torch.arange(n)[None])  # (1, n, vocab), plain causal
        torch.testing.assert_close(packed_logits[:1, offset:offset + n], alone, rtol=1e-5, atol=1e-5)
        offset += n


def _zero_batch():
    g = torch.Generator().manual_seed(5)
    idx, labels = torch.randint(0, 255, (8, 16), generator=g), torch.randint(0, 255, (8, 16), generator=g)
    labels[torch.rand(8, 16, generator=g) < 0.2] = -100
    return idx, torch.arange(16).expand(8, 16), labels


def test_gpt_tiled_and_recomputed_equals_plain():
    idx, position_ids, labels = _zero_batch()
    labels[:, 4:8] = -100
    results = []
    for tiles, recompute in ((1, False), (3, False), (3, True), (1, True)):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, tiles=tiles, recompute=recompute))
        loss_sum, correct = model(idx, position_ids, labels)
        loss_sum.backward()
        results.append((loss_sum.detach(), correct, grads(model)))
    for result in results[1:]:
        assert_all_close(result, results[0], rtol=1e-5, atol=1e-6)


# Gated DeltaNet: the chunked kernel against the recurrence, and the layer under SP


def _delta_rule_inputs(B, S, H, Dk, Dv, dtype):
    """Inputs as a Gated DeltaNet layer makes them (normalised q and k, beta in (0, 1), realistic decays), given
    as [B, S, H, ...] views of head-major memory."""
    g = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(B, H, S, Dk, generator=g, dtype=dtype), dim=-1) for _ in range(2))
    v, beta = torch.randn(B, H, S, Dv, generator=g, dtype=dtype), torch.rand(B, H, S, generator=g, dtype=dtype)
    rate = torch.empty(H, 1, dtype=dtype).uniform_(1, 16, generator=g)  # exp(A_log)
    decay = -rate * torch.rand(B, H, S, generator=g, dtype=dtype) / 4  # g = -exp(A_log) * softplus(...)
    return [t.transpose(1, 2).requires_grad_() for t in (q, k, v, decay, beta)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunked_gated_delta_rule_equals_the_recurrence(dtype, tolerance, chunk_size):
    """Output and every input gradient, S = 150 (not a multiple of the chunk), key dim 16 and value dim 12, with
    and without documents: one starting mid-chunk, one at a chunk boundary (64), some shorter than the
    convolution (100, 101, 103)."""
    inputs = _delta_rule_inputs(2, 150, 3, 16, 12, dtype)
    grad_out = torch.randn(2, 150, 3, 12, dtype=dtype, generator=torch.Generator().manual_seed(1))
    starts = torch.zeros(2, 150, dtype=torch.bool)
    starts[0, [37, 64, 100, 101, 103, 130]] = True  # row 1 is one document
    for documents in (None, starts):
        results = []
        for kernel in (deltanet.gated_delta_rule, partial(deltanet.chunk_gated_delta_rule, chunk_size=chunk_size)):
            out = kernel(*inputs, starts=documents)
            results.append([out, *torch.autograd.grad(out, inputs, grad_out)])
        assert_all_close(results[1], results[0], rtol=tolerance, atol=tolerance)


def test_causal_conv1d_restarts_at_every_document():
    x, weight = torch.randn(2, 40, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    bounds = [0, 9, 10, 12, 31, 40]  # documents of 9, 1, 2, 19 and 9 tokens
    starts = torch.zeros(2, 40, dtype=torch.bool)
    starts[:, bounds[:-1]] = True
    want = torch.cat([F.conv1d(x[:, s:e].transpose(1, 2), weight[:, None], padding=3, groups=6)[..., :e - s]
                      for s, e in zip(bounds, bounds[1:])], dim=2).transpose(1, 2)  # each document alone
    torch.testing.assert_close(deltanet.causal_conv1d(x, weight, starts), want, rtol=1e-12, atol=1e-12)


GDN_CASES = [  # (config, dtype, tolerance): today's shape, and Qwen3-Next's 16 key and 32 value heads scaled down
    (GPTConfig(n_head=4, n_embd=32), torch.float32, 1e-5),
    (GPTConfig(n_head=4, n_embd=32, gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=8, gdn_v_dim=12), torch.float32, 1e-5),
    (GPTConfig(n_head=4, n_embd=32, gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=8, gdn_v_dim=12), torch.float64, 1e-10),
]


def _deltanet_rank(rank, world_size):
    """The layer alone on this rank's tokens, one row a document and one row of packed documents, for each case;
    and the bytes its all-to-alls sent."""
    group = dist.group.WORLD if world_size > 1 else None
    full_positions = _packed_batch()[2]  # documents at 0, 8, 19, 22 (S/4 = 8 tokens a rank at sp 4)
    results = []
    for cfg, dtype, _ in GDN_CASES:
        torch.manual_seed(0)
        layer = deltanet.GatedDeltaNet(cfg, group).to(dtype)
        x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)  # (B, S, h)
        for starts in (None, full_positions[:, :24] == 0):
            local = _sp_slice(x, rank, world_size).clone().requires_grad_()
            ulysses.reset_all_to_all_stats()
            out = layer(local, None, None, partial(deltanet.gated_delta_net, starts=starts))
            out.backward(_sp_slice(torch.cos(x), rank, world_size))  # any fixed gradient
            sent = tuple(ulysses.all_to_all_stats[d]["bytes"] for d in ("forward", "backward"))
            results.append((out.detach(), local.grad, grads(layer), sent, layer.all_to_all_bytes(24 // world_size *
                                                                                                 2, dtype.itemsize)))
            layer.zero_grad()
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gated_deltanet_layer_under_sp(world_size):
    """Output, input gradient and every parameter gradient (conv weights, A_log and dt_bias included: each rank
    uses its heads' slices, and their gradients reach the whole parameters once) equal one device: today's shape
    in float32, and 2 key heads for 4 value heads with key dim 8 and value dim 12 in float32 and float64 (at sp 3
    the value heads split 2, 1, 1 and key head 1 goes to two ranks), one document a row and packed documents.
    Each rank sends the bytes of the layer's formula."""
    per_rank = run_ranks(world_size, _deltanet_rank)
    cases = [case for case in GDN_CASES for _ in range(2)]
    for i, ((out, input_grad, reference_grads, _, _), (_, _, tolerance)) in enumerate(zip(_deltanet_rank(0, 1), cases)):
        where = f"sp {world_size}, case {i}"
        assert_all_close(torch.cat([r[i][0] for r in per_rank], dim=1), out, tolerance, tolerance, where)
        assert_all_close(torch.cat([r[i][1] for r in per_rank], dim=1), input_grad, tolerance, tolerance, where)
        summed = {name: sum(r[i][2][name] for r in per_rank) for name in reference_grads}
        assert_all_close(summed, reference_grads, tolerance, tolerance, where)
        assert all(r[i][3] == r[i][4] for r in per_rank), [(r[i][3], r[i][4]) for r in per_rank]


def test_gated_deltanet_runs_in_float32_under_bf16(monkeypatch):
    """Under bf16 autocast, with bf16 inputs, the chunked kernel gets float32 q, k, v, gates and beta (so its
    state, cumulative decays and triangular solve are float32), and the output comes back in bf16."""
    seen = []

    def recording(q, k, v, g, beta, starts=None):
        seen.extend(t.dtype for t in (q, k, v, g, beta))
        return chunk(q, k, v, g, beta, starts)

    chunk = deltanet.chunk_gated_delta_rule
    monkeypatch.setattr(deltanet, "chunk_gated_delta_rule", recording)
    layer = deltanet.GatedDeltaNet(GPTConfig(n_head=4, n_embd=32, gdn_k_heads=2, gdn_v_heads=4, gdn_v_dim=12), None).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deltanet.gated_delta_net(*(torch.randn(1, 16, h, d, dtype=torch.bfloat16)
                                         for h, d in ((2, 8), (2, 8), (4, 12))),
                                       *(torch.randn(1, 16, 4, 1, dtype=torch.bfloat16) for _ in range(2)),
                                       torch.cat([layer.conv_qk.flatten(0, 2), layer.conv_v.flatten(0, 1)]),
                                       layer.A_log, layer.dt_bias, [0, 0, 1, 1])
    assert seen == [torch.float32] * 5 and out.dtype == torch.bfloat16 and out.shape == (1, 16, 4, 12)


# ================================================================================================================
# zero3.py: each rank holds its shards and nothing more; the consolidated state loads anywhere

ZERO_CFG = GPTConfig(vocab_size=255, n_layer=2, n_head=3, n_kv_head=3, n_embd=30)  # on 4 ranks a unit needs padding


def _zero3_rank(rank, world_size):
    torch.manual_seed(0)
    reference = GPT(ZERO_CFG)
    idx, position_ids, labels = _zero_batch()
    reference(idx, position_ids, labels)[0].backward()  # the whole batch in one process
    torch.manual_seed(0)
    model = GPT(ZERO_CFG)
    zero = zero3.ZeRO3(model, model.units(), group=dist.group.WORLD)
    assert list(model.parameters()) == []  # the model keeps no full parameter of its own
    gathered = []  # after every gather: how many units hold their full parameters
    for unit in zero.units:
        def counting_gather(async_op=False, gather=unit.gather):
            gather(async_op)
            gathered.append(sum(u.full.untyped_storage().size() > 0 for u in zero.units))
        unit.gather = counting_gather
    rows = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)  # data parallel: my rows of the batch
    model(idx[rows], position_ids[rows], labels[rows])[0].backward()
    assert max(gathered) == 2  # the unit computing and the one prefetched, never more
    for unit, reference_unit in zip(zero.units, reference.units()):
        params = list(reference_unit.parameters())
        padding = -sum(p.numel() for p in params) % world_size
        flat = torch.cat([p.detach().flatten() for p in params] + [torch.zeros(padding)]).view(world_size, -1)
        flat_grad = torch.cat([p.grad.flatten() for p in params] + [torch.zeros(padding)]).view(world_size, -1)
        assert torch.equal(unit.shard.detach(), flat[rank])  # exactly my slice, nothing more
        torch.testing.assert_close(unit.shard.grad, flat_grad[rank], rtol=1e-5, atol=1e-6)  # summed, not averaged
        assert unit.full.untyped_storage().size() == 0 and unit.full.grad is None  # gathered copy freed
    optimizer = torch.optim.AdamW(zero.parameters())
    optimizer.step()
    assert all(state["exp_avg"].shape == shard.shape for shard, state in optimizer.state.items())
    assert set(optimizer.state) == set(zero.parameters())
    with torch.no_grad():
        logits = model(idx, position_ids)
    return _cloned(zero3.held(model, optimizer, zero)), zero3.optimizer_scalars(optimizer), logits


def _cloned(pieces):
    return {name: (shape, start, {key: t.clone() for key, t in values.items()})
            for name, (shape, start, values) in pieces.items()}


def _zero3_load_rank(rank, world_size, stored, scalars):
    torch.manual_seed(123)  # other weights, all overwritten by the load
    model = GPT(ZERO_CFG)
    zero = zero3.ZeRO3(model, model.units(), group=dist.group.WORLD)
    optimizer = torch.optim.AdamW(zero.parameters())
    zero3.prepare_optimizer(optimizer, ["exp_avg", "exp_avg_sq"], scalars)
    zero3.load_pieces(zero3.held(model, optimizer, zero), stored)
    with torch.no_grad():
        logits = model(*_zero_batch()[:2])
    return _cloned(zero3.held(model, optimizer, zero)), zero3.optimizer_scalars(optimizer), logits


def test_zero3_shards_and_checkpoint_pieces():
    """What 4 ranks hold of the model and of AdamW's state (zero3.held) is the whole model in one process, and
    loads onto 2 ranks exactly."""
    four = run_ranks(4, _zero3_rank)
    stored = [pieces for pieces, _, _ in four]
    plain = GPT(ZERO_CFG)
    plain.load_state_dict(zero3.whole(stored))  # held on 4 ranks, whole in one process
    expected = plain(*_zero_batch()[:2])
    for _, scalars, rank_logits in four:
        torch.testing.assert_close(rank_logits, expected, rtol=0, atol=1e-5)
        assert scalars == {"step": 1.0}
    moments = zero3.whole(stored, "exp_avg")
    assert {name: t.shape for name, t in moments.items()} == {name: p.shape for name, p in plain.named_parameters()}
    two = run_ranks(2, _zero3_load_rank, stored, {"step": 1.0})
    for _, scalars, rank_logits in two:
        torch.testing.assert_close(rank_logits, expected, rtol=0, atol=1e-5)
        assert scalars == {"step": 1.0}
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert_all_close(zero3.whole([pieces for pieces, _, _ in two], key), zero3.whole(stored, key), rtol=0, atol=0)


# ================================================================================================================
# data.py: every layout draws the same samples; text is read as it is


PARAGRAPHS = "\n\n".join(f"paragraph {i}: " + "ab " * (i % 7) for i in range(40))  # 40 of 13 to 33 bytes


def test_copy_task_samples_depend_only_on_seed_and_index():
    """The same (seed, index) gives the same sample, whoever draws it; the copy is labelled, the random half not;
    the micro-batches of every (micro-step, DP rank) of one step tile the step's samples without overlap."""
    tokens, labels, position_ids = data.make_sample(5, 33, seed=1)
    again = data.make_sample(5, 33, seed=1)
    assert all(torch.equal(a, b) for a, b in zip((tokens, labels, position_ids), again))
    assert not torch.equal(tokens, data.make_sample(6, 33, seed=1)[0])
    n = (33 + 2) // 2  # the random block; the copy starts right after it
    assert torch.equal(tokens[n:], tokens[:33 - n]) and torch.equal(position_ids, torch.arange(33))
    assert (labels[:n - 1] == -100).all() and torch.equal(labels[n - 1:-1], tokens[n:])  # only the copy is scored
    drawn = [i for micro in range(2) for dp_rank in range(3)
             for i in data.micro_batch_indices(4, micro, grad_accum=2, dp_rank=dp_rank, dp=3, batch_size=5)]
    assert sorted(drawn) == list(range(4 * 30, 5 * 30))


def test_text_samples_are_windows_or_paragraphs(tmp_path):
    """--data: a window of the bytes with the next byte as label; or (--pack) paragraphs back to back, positions
    restarting at each, and no label across a document's end."""
    text = tmp_path / "text.txt"
    text.write_text(PARAGRAPHS)
    raw = PARAGRAPHS.encode()
    tokens, labels, position_ids = data.make_sample(3, 64, data.read_documents(text, pack=False, seq_len=64))
    start = raw.find(bytes(tokens.tolist()))
    assert start >= 0 and bytes(labels.tolist()) == raw[start + 1:start + 65]  # shifted by one, never past
    documents = data.read_documents(text, pack=True, seq_len=64)
    assert len(documents) == 40 and bytes(documents[0].tolist()).startswith(b"paragraph 0: ")
    tokens, labels, position_ids = data.make_sample(0, 64, documents, pack=True)
    starts = (position_ids == 0).nonzero().flatten().tolist()
    assert starts[0] == 0 and len(starts) > 1
    for start in starts[1:]:  # a document's last token predicts nothing; the next starts at position 0
        assert labels[start - 1] == -100 and position_ids[start - 1] > 0


def _read_text(tmp_path, raw, pack=True, seq_len=8):
    path = tmp_path / "text.txt"
    path.write_bytes(raw)
    return data.read_documents(path, pack, seq_len)


@pytest.mark.parametrize("raw, expected", [
    (b"one a\r\none b\r\n\r\ntwo\r\n\r\n\r\nthree\r\n", [b"one a\r\none b\r\n", b"two\r\n", b"three\r\n"]),
    (b"one\r\rtwo a\rtwo b\r\r\rthree", [b"one\r", b"two a\rtwo b\r", b"three"]),
    (b"one\n \t \ntwo\n  indented\n\t\nthree", [b"one\n", b"two\n  indented\n", b"three"]),
    (b"\r\n\r\none\r\ntwo\n\nthree\r\rfour\r\n  \r\n", [b"one\r\ntwo\n", b"three\r", b"four\r\n"]),
], ids=["crlf", "cr", "whitespace-line", "mixed"])
def test_paragraphs_split_at_blank_lines_in_any_line_ending(tmp_path, raw, expected):
    """A paragraph is its lines, bytes as in the file; only blank lines (empty or spaces and tabs) separate, and
    the \\r\\n that ends a line is never read as \\r and then an empty line."""
    documents = _read_text(tmp_path, raw)
    assert [bytes(d.tolist()) for d in documents] == expected


@pytest.mark.parametrize("raw", [b"line one\r\nline two\r\n", b"one paragraph", b"\n\n  \none paragraph\n\n"])
def test_pack_refuses_a_file_without_paragraph_breaks(tmp_path, raw):
    message = ("has no blank line between paragraphs, so --pack would make one document of it; separate documents "
               "with blank lines, or drop --pack")
    with pytest.raises(ValueError, match=re.escape(message)):
        _read_text(tmp_path, raw)
    assert bytes(_read_text(tmp_path, raw, pack=False, seq_len=4)[0].tolist()) == raw  # unpacked, the file is the text


def test_read_documents_keeps_its_errors(tmp_path):
    with pytest.raises(ValueError, match="^no such file or directory$"):
        data.read_documents(tmp_path / "missing.txt", True, 8)
    for pack in (True, False):
        with pytest.raises(ValueError, match="^holds no text$"):
            _read_text(tmp_path, b"" if not pack else b"\r\n \r\n\t\n", pack)
    with pytest.raises(ValueError, match=re.escape("has 8 bytes; sequences of 8 tokens need 9 (or packing)")):
        _read_text(tmp_path, b"12345678", pack=False)


STREAM_PARAGRAPHS = [b"a first paragraph, longer than one sequence of 16 tokens\r\n",
              b"short\r\n",
              b"a paragraph of three lines\nline two\nline three\n",
              b"x"]  # one byte, the file's last, with no line break: it starts and ends at once


def _expected_stream(documents):
    """The obvious computation: for every byte of the stream, the byte, its label and its position."""
    tokens, labels, positions = [], [], []
    for d in documents:
        tokens += list(d)
        labels += list(d[1:]) + [-100]
        positions += range(len(d))
    return tokens, labels, positions


@pytest.mark.parametrize("seq_len", [16, 23, 300], ids=["16", "23", "longer-than-the-stream"])
def test_packed_samples_are_consecutive_windows_of_the_stream(tmp_path, seq_len):
    """Samples 0, 1, 2, ... tile the documents in file order, repeated: a paragraph longer than a sequence goes on
    in the next sample with its positions counting on, positions are 0 exactly where a document starts, labels
    -100 exactly at a document's last token; one pass reads every byte of the file but the blank lines."""
    first, second, third, fourth = STREAM_PARAGRAPHS
    raw = first + b"\r\n" + second + b" \t\n" + third + b"\r\r\n" + fourth
    documents = _read_text(tmp_path, raw, seq_len=seq_len)
    assert [bytes(d.tolist()) for d in documents] == STREAM_PARAGRAPHS
    tokens, labels, positions = _expected_stream(STREAM_PARAGRAPHS)
    n = len(tokens)
    k = 3 * -(-n // seq_len)  # three passes and more
    samples = [data.make_sample(i, seq_len, documents, pack=True, seed=i) for i in range(k)]
    got = [torch.cat([s[j] for s in samples]).tolist() for j in range(3)]
    cycled = [(column * (k * seq_len // n + 1))[:k * seq_len] for column in (tokens, labels, positions)]
    assert got == cycled
    assert bytes(got[0][:n]) == b"".join(STREAM_PARAGRAPHS)  # one pass: every byte of the file but the blank lines
    starts = {sum(map(len, STREAM_PARAGRAPHS[:d])) for d in range(len(STREAM_PARAGRAPHS))}
    assert [i for i, p in enumerate(got[2]) if p == 0] == [i for i in range(k * seq_len) if i % n in starts]
    assert [i for i, l in enumerate(got[1]) if l == -100] == [i for i in range(k * seq_len) if (i + 1) % n in starts]
    if seq_len == 16:  # sample 1 starts inside the first paragraph, at its byte 16
        assert samples[1][2][:3].tolist() == [16, 17, 18] and samples[0][1][-1].item() == STREAM_PARAGRAPHS[0][16]


def test_packed_sample_depends_on_index_alone(tmp_path):
    documents = _read_text(tmp_path, b"\n".join(STREAM_PARAGRAPHS))
    for i in (5, 0, 1_000_003):
        a, b = data.make_sample(i, 16, documents, pack=True, seed=0), data.make_sample(i, 16, documents, True, 7)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(data.make_sample(1, 16, documents, True)[0], data.make_sample(2, 16, documents, True)[0])


def test_the_banner_describes_the_text(tmp_path):
    """37 paragraphs of 13,824 bytes read 346 times 128 tokens, packed; the same bytes as one document."""
    paragraphs = [b"a" * 373 + b"\n"] * 36 + [b"b" * 359 + b"\n"]
    packed = _read_text(tmp_path, b"\n".join(paragraphs), pack=True)
    assert data.describe(packed, True, 128, 346) == (
        "37 documents, 13,824 bytes; a pass is 108 sequences of 128 tokens, this run reads 3.2 passes")
    plain = _read_text(tmp_path, b"".join(paragraphs), pack=False)
    assert data.describe(plain, False, 128, 443) == (
        "1 document, 13,824 bytes; windows start anywhere, so every byte can be trained on; this run reads 4.1x its "
        "bytes")
    assert data.describe(packed, True, 100, 1) == (
        "37 documents, 13,824 bytes; a pass is 139 sequences of 100 tokens, this run reads 0.007 passes")


@pytest.mark.parametrize("pack", [[], ["--pack"]], ids=["plain", "packed"])
def test_training_on_text_learns(tmp_path, pack):
    """40 steps on the paragraphs take the loss from ln 256 = 5.55 (uniform over bytes) to below 2.7."""
    text = tmp_path / "text.txt"
    text.write_text(PARAGRAPHS)
    history = train.main(["--data", str(text), "--seq-len", "64", "--steps", "40", "--n-embd", "32", "--lr", "3e-3"]
                         + pack)
    assert history[0]["loss"] > 5.4 and history[-1]["loss"] < 2.7, [r["loss"] for r in history]


# ================================================================================================================
# train.py: the same global batch gives the same training, whatever the layout; memory as predicted

TRAIN_ARGS = ["--steps", "20", "--n-layer", "2", "--n-embd", "32", "--lr", "3e-3", "--grad-clip", "0.2"]
# a key head for every two value heads (Qwen3-Next: 16 and 32), and value heads wider than key heads (12 and 8)
GDN_SHAPE = ["--gdn-k-heads", "2", "--gdn-v-heads", "4", "--gdn-v-dim", "12"]
LAYOUTS = {  # each with a global batch of 8 sequences: dp * batch-size * grad-accum
    "sp4": ["--sp", "4", "--batch-size", "8"],  # --zero 3 is the default with 4 ranks
    "dp2xsp2 accum": ["--sp", "2", "--batch-size", "2", "--grad-accum", "2"],
    "dp2xsp2 zero0": ["--sp", "2", "--batch-size", "4", "--zero", "0"],
    "dp2xsp2 fsdp2": ["--sp", "2", "--batch-size", "4", "--zero", "fsdp2"],
    "dp2xsp2 tiles recompute": ["--sp", "2", "--batch-size", "4", "--tiles", "3", "--recompute"],
}


def _train_rank(rank, world_size, runs):
    """Run train.main once per (argv, out_dir); return each run's metrics and its final model (if saved)."""
    results = []
    for argv, out_dir in runs:
        history = train.main(argv + (["--out-dir", out_dir] if out_dir else []))
        final = train.newest_checkpoint(out_dir) if out_dir else None
        results.append((history, train.checkpoint_weights(final) if final else None))
    return results


def _assert_same_training(history, reference, where):
    for key in ("loss", "grad_norm", "accuracy"):
        torch.testing.assert_close([r[key] for r in history], [r[key] for r in reference], rtol=0, atol=1e-5,
                                   msg=lambda m: f"{where}, {key}: {m}")


@pytest.mark.parametrize("extra", [["--seq-len", "64"], ["--seq-len", "101", "--n-kv-head", "2"]],
                         ids=["seq64", "seq101-kv2"])
def test_training_is_the_same_for_every_layout(extra, tmp_path):
    """Same global batch, same training: sp, dp x sp, gradient accumulation, ZeRO-3, plain all-reduce, FSDP2,
    tiles and recomputation all give the one-process losses, gradient norms and final weights."""
    one_process = ["--sp", "1", "--batch-size", "8"] + TRAIN_ARGS + extra
    [(reference, reference_model)] = run_ranks(1, _train_rank, [(one_process, str(tmp_path / "one"))])[0]
    runs = [(argv + TRAIN_ARGS + extra, str(tmp_path / name.replace(" ", "_"))) for name, argv in LAYOUTS.items()]
    per_rank = run_ranks(4, _train_rank, runs)
    losses = lambda rank_results: [[r["loss"] for r in history] for history, _ in rank_results]
    assert all(losses(rank_results) == losses(per_rank[0]) for rank_results in per_rank)  # one global loss
    assert sum(r["grad_norm"] > 0.2 for r in reference) >= 2  # clipping really happens
    for name, (history, model) in zip(LAYOUTS, per_rank[0]):
        _assert_same_training(history, reference, name)
        assert_all_close(model, reference_model, rtol=0, atol=1e-5, where=name)


@pytest.mark.parametrize("world_size, layout, model", [
    (8, ["--sp", "4", "--ring", "2", "--batch-size", "4"], ["--n-kv-head", "2"]),  # ZeRO-3, the default
    (4, ["--sp", "4", "--ring", "2", "--batch-size", "8", "--zero", "fsdp2"], ["--n-head", "2", "--n-embd", "16"]),
    (4, ["--sp", "4", "--ring", "4", "--batch-size", "8", "--zero", "0"], ["--window", "20"]),
], ids=["dp2xulysses2xring2-zero3-kv2", "ulysses2xring2-nhead2-fsdp2", "ring4-zero0-window"])
def test_ring_training_matches_one_device(world_size, layout, model, tmp_path):
    """Ulysses x Ring training equals one process step by step (losses, gradient norms, final weights within 1e-5
    over 20 steps), with padding (101 tokens into 2 x sp chunks): dp 2 x Ulysses 2 x ring 2 with ZeRO-3 and GQA;
    more SP ranks than heads (n_head 2, sp 4 = Ulysses 2 x ring 2) with FSDP2; a ring of 4 with a sliding window."""
    extra = TRAIN_ARGS + ["--seq-len", "101"] + model
    one_process = ["--sp", "1", "--batch-size", "8"] + extra
    [(reference, reference_model)] = run_ranks(1, _train_rank, [(one_process, str(tmp_path / "one"))])[0]
    per_rank = run_ranks(world_size, _train_rank, [(layout + extra, str(tmp_path / "ring"))])
    history, trained = per_rank[0][0]
    _assert_same_training(history, reference, " ".join(layout))
    assert_all_close(trained, reference_model, rtol=0, atol=1e-5, where=" ".join(layout))


def test_ring_summary_plan_and_memory(capsys, monkeypatch):
    """Under torchrun, a Ulysses 2 x ring 2 run prints the ring's bytes equal to their formula; --plan names the
    ring and fits 1M tokens of an 8-kv-head model on 64 GPUs; the predicted peak per rank of a ring run is within
    20% of the measured one."""
    done = subprocess.run(torchrun(4) + ["--sp", "4", "--ring", "2", "--n-head", "2", "--steps", "2", "--seq-len", "32",
                                         "--n-embd", "32"], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"ring of rank 0 per step: ([\d,]+) bytes sent \(formula \1 bytes\); sends per layer per "
                     r"micro-step: 1 forward, 3 backward", done.stdout), done.stdout
    assert train.main(["--plan", "64x80", "--sp", "64", "--ring", "8", "--n-layer", "32", "--n-embd", "4096",
                       "--n-head", "32", "--n-kv-head", "8", "--batch-size", "1", "--tiles", "64", "--recompute",
                       "--offload",
                       "--seq-len", "1048576"])
    assert re.match(r"plan: 64 GPUs, sp 64 \(ulysses 8 x ring 8\), seq 1,048,576: fits: ", capsys.readouterr().out)
    argv = ["--sp", "4", "--ring", "2", "--seq-len", "4096", "--batch-size", "1"]
    peak = max(peaks[0] for peaks in run_ranks(4, _memory_rank, [argv]))
    args = train.parse_args(argv)
    train.check_args(args, 4)
    assert abs(train.predicted(args, 4)["peak"] / peak - 1) < 0.2, (train.predicted(args, 4)["peak"], peak)


@pytest.mark.parametrize("kv", ["6", "2"])
def test_training_with_uneven_heads(kv):
    """6 heads on sp 4 (ranks hold 2, 2, 1, 1; with 2 kv heads, kv head 0 goes to ranks 0 and 1): the same
    losses as one process, with ZeRO-3."""
    argv = TRAIN_ARGS + ["--n-head", "6", "--n-embd", "48", "--n-kv-head", kv, "--seq-len", "30", "--batch-size"]
    [(reference, _)] = run_ranks(1, _train_rank, [(argv + ["8"], None)])[0]
    [(history, _)] = run_ranks(4, _train_rank, [(argv + ["8", "--sp", "4"], None)])[0]
    _assert_same_training(history, reference, f"6 heads, {kv} kv heads, sp 4")


def _bf16_rank(rank, world_size, runs):
    """train.main once per argv. Returns each run's metrics, the dtypes the gradients were summed in (ZeRO-3's
    reduce-scatter) and the (parameter, gradient) dtypes the optimizer's step received, and what it printed."""
    results = []
    reduce_scatter = zero3.reduce_scatter
    for argv in runs:
        received = set()
        hook = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: received.update(
            (p.dtype, p.grad.dtype) for group in optimizer.param_groups for p in group["params"]))
        summed_in = set()

        def recording_reduce_scatter(output, input, **kwargs):
            summed_in.add(input.dtype)
            return reduce_scatter(output, input, **kwargs)
        zero3.reduce_scatter = recording_reduce_scatter
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            history = train.main(argv)
        hook.remove()
        zero3.reduce_scatter = reduce_scatter
        results.append((history, summed_in, received, printed.getvalue()))
    return results


def test_bf16_training_matches_one_device(tmp_path):
    """--dtype bfloat16 on a hybrid model (softmax attention and Gated DeltaNet): dp 2 x sp 2 with ZeRO-3 and sp 4
    with FSDP2 train as one bf16 process does; the all-to-alls send half of float32's bytes, as the formula says;
    ZeRO-3 sums gradients in float32, and the optimizer gets float32 parameters and gradients; the checkpoint is
    float32 and resumes in float32.

    The tolerance: bf16 keeps 8 significant bits, so a matmul output is rounded to within 2^-8 of itself. Other
    layouts add up the same float32 numbers in another order before that rounding, and a value near a rounding
    boundary lands one bf16 step (2^-7 relative) away; and ZeRO-3 and FSDP2 round the norm weights, the embedding
    and Gated DeltaNet's small per-head parameters to bf16 where one process (--zero 0) keeps them float32. A loss
    averages hundreds of such values and moves far less: we allow 2^-9 of it. A gradient norm follows single
    gradients more closely: 2^-6. A real mistake (a gradient summed twice, a head on the wrong rank) moves both by
    tens of percent."""
    argv = TRAIN_ARGS + ["--seq-len", "32", "--layer-pattern", "da", "--steps", "10"]
    bf16, out_dir = argv + ["--dtype", "bfloat16"], str(tmp_path / "one")
    [(reference, _, received, _), (resumed, _, _, printed)] = run_ranks(1, _bf16_rank, [
        bf16 + ["--batch-size", "8", "--out-dir", out_dir],
        argv + ["--batch-size", "8", "--dtype", "float32", "--out-dir", out_dir, "--resume", "--steps", "12",
                "--new-schedule"]])[0]
    assert received == {(torch.float32, torch.float32)}
    saved = train.checkpoint_weights(os.path.join(out_dir, "step_000010"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert "carried over" in printed and [r["step"] for r in resumed] == [11, 12]
    layouts = {"dp2xsp2 zero3": ["--sp", "2", "--batch-size", "4"], "sp4 fsdp2": ["--sp", "4", "--zero", "fsdp2"]}
    float32 = argv + layouts["dp2xsp2 zero3"] + ["--steps", "1", "--dtype", "float32"]
    runs = [bf16 + layout for layout in layouts.values()] + [float32]
    *per_layout, (_, _, _, printed_float32) = run_ranks(4, _bf16_rank, runs)[0]
    sent = lambda printed: [int(n.replace(",", "")) for n in re.search(
        r"all-to-all of rank 0 per step: ([\d,]+) bytes sent \(formula ([\d,]+) bytes\)", printed).groups()]
    assert per_layout[0][1] == {torch.float32}  # the dtype of every gradient ZeRO-3 reduce-scattered
    for name, (history, _, received, printed) in zip(layouts, per_layout):
        assert received == {(torch.float32, torch.float32)}, name
        for key, rtol in (("loss", 2**-9), ("grad_norm", 2**-6)):
            torch.testing.assert_close([r[key] for r in history], [r[key] for r in reference], rtol=rtol, atol=0,
                                       msg=lambda m: f"{name}, {key}: {m}")
    measured, formula = sent(per_layout[0][3])
    assert measured == formula == sent(printed_float32)[0] // 2


def test_bf16_loss_follows_float32(tmp_path):
    """50 steps on text, bf16 against float32, a hybrid model on one process (Gated DeltaNet with a key head for
    every two value heads, value dim 12): the loss falls from 5.55 to about 1.8 nats in both, and the curves never part by
    more than 0.01 nats (bf16 rounding moves a step's loss by about 1e-4 of itself; AdamW's updates let that grow
    a little over the steps)."""
    text = tmp_path / "text.txt"
    text.write_text(PARAGRAPHS)
    argv = ["--data", str(text), "--seq-len", "64", "--steps", "50", "--n-embd", "32", "--lr", "3e-3",
            "--layer-pattern", "da"] + GDN_SHAPE
    float32, bf16 = ([r["loss"] for r in train.main(argv + ["--dtype", dtype])] for dtype in ("float32", "bfloat16"))
    assert float32[-1] < 2.0 and bf16[-1] < 2.0
    torch.testing.assert_close(bf16, float32, rtol=0, atol=0.01)


@pytest.mark.parametrize("world_size, layout", [(2, ["--sp", "2"]), (4, ["--sp", "2", "--batch-size", "4"])],
                         ids=["sp2", "dp2xsp2"])
def test_compiled_training_inductor(world_size, layout):
    """--compile (each block through inductor, ZeRO-3's hooks eager) trains as eager does: 20 steps, same losses,
    gradient norms and accuracy (slow: inductor compiles the blocks on every rank)."""
    argv = TRAIN_ARGS + ["--seq-len", "32"] + layout
    eager, compiled = run_ranks(world_size, _train_rank, [(argv, None), (argv + ["--compile"], None)])[0]
    _assert_same_training(compiled[0], eager[0], f"--compile on {world_size} ranks")


@pytest.mark.parametrize("model", [["--layer-pattern", "dda", "--n-layer", "3"] + GDN_SHAPE,
                                   ["--layer-pattern", "ddda", "--n-layer", "4", "--pack"]],
                         ids=["dda-2k-4v-heads", "ddda-packed"])
def test_training_a_hybrid_model(model):
    """Hybrid models: two Gated DeltaNet layers to one softmax layer with Qwen3-Next's ratios (a key head for
    every two value heads, convolution 4; value dim 12, key dim 8), and three to one with packed documents:
    sp 4 and dp 2 x sp 2 give the one-process losses and gradient norms over 20 steps, with ZeRO-3. At
    train.py's learning rate for Gated DeltaNet models, 5e-4: at 3e-3, AdamW grows the float32 rounding of
    different summation orders (gradients summed over ranks where one device sums over tokens; a key head's
    gradient summed over its value heads before the convolution's backward on one device, after it under SP) to
    1e-5 to 5e-5 in the gradient norm by step 15, where the layer itself agrees to 1e-10 in float64 (above)."""
    argv = TRAIN_ARGS + ["--seq-len", "64", "--lr", "5e-4"] + model
    [(reference, _)] = run_ranks(1, _train_rank, [(argv + ["--batch-size", "8"], None)])[0]
    layouts = {"sp4": ["--sp", "4", "--batch-size", "8"], "dp2xsp2": ["--sp", "2", "--batch-size", "4"]}
    results = run_ranks(4, _train_rank, [(argv + layout, None) for layout in layouts.values()])[0]
    for name, (history, _) in zip(layouts, results):
        _assert_same_training(history, reference, name)


def test_a_long_step_says_where_it_is(monkeypatch):
    """StepProgress: a step that runs for longer than its interval shows the step, its time and the layer on the
    progress bar, forward and backward, and nothing once the step has ended."""
    model = GPT(GPTConfig(n_layer=2, n_embd=32))
    bar = train.tqdm(total=1, file=io.StringIO(), mininterval=0)
    progress = train.StepProgress(model, bar, every=0.05)
    for block in model.blocks:  # slow layers: 0.3 s each, forward and backward
        block.register_forward_pre_hook(lambda *args: time.sleep(0.3))
        next(block.parameters()).register_hook(lambda grad: time.sleep(0.3))
    progress.begin(4)
    idx = torch.zeros(1, 8, dtype=torch.long)
    model(idx, torch.arange(8)[None], idx)[0].backward()
    progress.end()
    time.sleep(0.2)
    progress.close()
    shown = bar.fp.getvalue()
    for where in ("layer 1/2 forward", "layer 2/2 forward", "layer 2/2 backward", "layer 1/2 backward"):
        assert re.search(rf"step 5: \d+ s in, {where}", shown), (where, shown)
    assert shown.rstrip().endswith("layer 1/2 backward]")  # the step ended: nothing more


def test_torchrun_train_exits_zero(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    done = subprocess.run(torchrun(2) + ["--steps", "3", "--seq-len", "32", "--n-embd", "32", "--metrics",
                                         str(metrics)], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"all-to-all of rank 0 per step: ([\d,]+) bytes sent \(formula \1 bytes\)", done.stdout)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


MEMORY_RUNS = {1: [["--seq-len", "1024"], ["--seq-len", "4096", "--tiles", "4", "--recompute"]],
               2: [["--seq-len", "4096"], ["--seq-len", "1024", "--tiles", "4", "--recompute"]],
               4: [["--seq-len", "4096", "--recompute"], ["--seq-len", "4096", "--tiles", "4"]]}


def _memory_rank(rank, world_size, runs):
    return [train.main(argv + ["--steps", "2", "--batch-size", "1"])[-1]["peak_bytes"] for argv in runs]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_memory_prediction_is_within_20_percent(world_size):
    """train.py's predicted peak per rank against the peak MemTracker measures, for sp 1, 2 and 4, with and
    without tiles and recomputation, at 1k and 4k tokens (configurations of the README's memory table)."""
    per_rank = run_ranks(world_size, _memory_rank, MEMORY_RUNS[world_size])
    for argv, peak in zip(MEMORY_RUNS[world_size], map(max, zip(*per_rank))):  # the busiest rank
        args = train.parse_args(argv + ["--batch-size", "1"])
        train.check_args(args, world_size)
        predicted = train.predicted(args, world_size)["peak"]
        assert abs(predicted / peak - 1) < 0.2, (argv, predicted, peak)


def test_a_run_that_cannot_fit_is_refused_and_a_plan_is_printed(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "1")
    start = time.time()
    with pytest.raises(SystemExit, match=r"this run would need [\d,.]+ GiB per rank for 100,000,000 tokens a rank "
                                         r"\(model state .*\), against [\d,.]+ GiB; about [\d,]+ tokens would fit; "
                                         r"--recompute: [\d,.]+ GiB; --tiles 16: [\d,.]+ GiB$"):
        train.main(["--seq-len", "100000000"])
    assert time.time() - start < 5
    assert train.main(["--plan", "8x80", "--n-layer", "32", "--n-embd", "4096", "--n-head", "32", "--n-kv-head", "8",
                       "--seq-len", "1048576", "--batch-size", "1", "--tiles", "64", "--recompute", "--offload"])
    plan = re.search(r"^plan: 8 GPUs, sp 8, seq 1,048,576: fits: ([\d.]+) GiB per rank for 131,072 tokens a rank "
                     r"\(model state ([\d.]+) GiB \+ the larger of activations ([\d.]+) GiB and AdamW's step "
                     r"temporaries ([\d.]+) GiB; [\d.]+ GiB more in CPU memory\), against "
                     r"80.0 GiB; about [\d,]+ tokens would fit", capsys.readouterr().out)
    peak, state, activations, adamw = map(float, plan.groups())
    assert abs(state + max(activations, adamw) - peak) <= 0.1  # the parts add up, to the printed rounding
    for plan in ("8", "8xinf", "8x0", "0x80", "8xnan"):
        with pytest.raises(SystemExit, match=rf"--plan {plan}: write it as GPUSxGIB, at least one GPU of more than 0 "
                                             rf"GiB, e.g. 8x80"):
            train.main(["--plan", plan])
    with pytest.raises(SystemExit, match=r"^1$"):  # a plan that does not fit fails, after its line
        train.main(["--plan", "1x1", "--seq-len", "10000000"])
    assert "plan: 1 GPU, sp 1, seq 10,000,000: does NOT fit" in capsys.readouterr().out
    # Gated DeltaNet layers alone split by their value heads, so sp may pass n_head: checked and planned
    assert train.main(["--plan", "4x80", "--layer-pattern", "d", "--n-head", "2", "--gdn-v-heads", "4"])
    assert "plan: 4 GPUs, sp 4, seq 128: fits" in capsys.readouterr().out


def test_readme_plans_run_as_written(capsys):
    """Every `python train.py --plan ...` line of README runs as written and prints its plan: the line README
    quotes where it quotes one."""
    with open(os.path.join(HERE, "README.md")) as f:
        readme = f.read()
    commands = re.findall(r"^python train\.py (--plan .*)$", readme, re.M)
    assert len(commands) == 3
    for command in commands:
        capsys.readouterr()
        try:
            train.main(command.split())
        except SystemExit as e:
            assert e.code == 1  # a plan that does not fit
        printed = capsys.readouterr().out.strip()
        assert printed.startswith("plan: "), command
        if "--ring" in command:
            assert f"```\n{printed}\n```" in readme


@pytest.mark.parametrize("script, argv", [("train.py", []), ("bench.py", []), ("bench.py", ["attention"]),
                                          ("bench.py", ["ring"])], ids=["train", "bench", "bench attention", "bench ring"])
def test_help_shows_the_defaults(capsys, script, argv):
    """`python X.py --help` answers at once, exit 0, with every default that a flag has."""
    with pytest.raises(SystemExit, match="^0$"):
        {"train.py": train.main, "bench.py": bench.main}[script](argv + ["--help"])
    printed = capsys.readouterr().out
    if script == "train.py":
        for flag, default in (("--seq-len", "128"), ("--steps", "600"), ("--batch-size", "8"), ("--n-embd", "128"),
                              ("--timeout", "300"), ("--seed", "0"), ("--keep", "0")):
            text = re.search(rf"\n  {flag} (.*?)(?=\n  -|\Z)", printed, re.S).group(1)  # the flag's help
            assert f"(default: {default})" in " ".join(text.split()), flag
    else:  # bench.py lists its benchmarks; each of them, its flags
        assert "(default: " in printed if argv else "attention,tiled" in printed


# ================================================================================================================
# checkpoints: resume exactly, on the same or any other layout

RESUME_ARGS = ["--steps", "40", "--save-every", "20", "--n-layer", "2", "--n-embd", "32", "--seq-len", "32"]
DP2XSP2 = ["--sp", "2", "--batch-size", "4"]  # the layout that writes the checkpoint; global batch 8


def _resume_rank(rank, world_size, runs):
    """Each run: (argv, out_dir, checkpoint to start from or None). Returns each run's metrics."""
    results = []
    for argv, out_dir, start in runs:
        if start and rank == 0:
            shutil.copytree(start, os.path.join(out_dir, os.path.basename(start)))
        if dist.is_initialized():
            dist.barrier()
        results.append(train.main(argv + RESUME_ARGS + ["--out-dir", out_dir] + (["--resume"] if start else [])))
    return results


def test_resume_on_any_layout(tmp_path, capsys):
    """40 steps on dp 2 x sp 2; its step-20 checkpoint resumed on the same layout (bit for bit), on sp 4, with
    --zero 0 and --zero fsdp2, and in one process: steps 21-40 equal the straight run, and so do the final
    weights. FSDP2 writes checkpoints too, and resumes from its own."""
    written = str(tmp_path / "dp2xsp2" / "step_000020")
    four = [(DP2XSP2, str(tmp_path / "dp2xsp2"), None),
            (DP2XSP2, str(tmp_path / "same"), written),
            (["--sp", "4", "--batch-size", "8"], str(tmp_path / "sp4"), written),
            (DP2XSP2 + ["--zero", "0"], str(tmp_path / "zero0"), written),
            (DP2XSP2 + ["--zero", "fsdp2"], str(tmp_path / "fsdp2"), written),
            (DP2XSP2 + ["--zero", "fsdp2"], str(tmp_path / "fsdp2_again"), str(tmp_path / "fsdp2" / "step_000020"))]
    straight, same, *others = run_ranks(4, _resume_rank, four)[0]
    one_process = _resume_rank(0, 1, [(["--batch-size", "8"], str(tmp_path / "one"), written)])[0]
    assert "model and AdamW state carried over" in capsys.readouterr().out
    model = lambda name: train.checkpoint_weights(tmp_path / name / "step_000040")
    assert [r["loss"] for r in same] == [r["loss"] for r in straight[20:]]  # the same layout: bit for bit
    assert_all_close(model("same"), model("dp2xsp2"), rtol=0, atol=0)
    for name, history in zip(["sp4", "zero0", "fsdp2", "fsdp2_again", "one"], others + [one_process]):
        assert [r["step"] for r in history] == list(range(21, 41))
        _assert_same_training(history, straight[20:], name)
        assert_all_close(model(name), model("dp2xsp2"), rtol=0, atol=1e-5, where=name)


# ================================================================================================================
# failures: mistakes get one line and a non-zero exit, before any collective; broken runs end cleanly


@pytest.mark.parametrize("world_size, argv, message", [
    (4, ["--sp", "3"], r"--sp 3 does not divide the world size 4; choose --sp in \{1, 2, 4\}"),
    (4, ["--n-head", "2", "--n-embd", "32"], r"--sp 4 with --ring 1 puts 4 ranks in each Ulysses group, more than "
                                             r"--n-head 2: a rank would hold no head; choose --sp in \{1, 2\}, or "
                                             r"--ring in \{2, 4\}"),
    (4, ["--n-head", "2", "--n-embd", "32", "--layer-pattern", "da"],  # a ring cannot carry Gated DeltaNet
     r"a rank would hold no head; choose --sp in \{1, 2\}$"),
    (4, ["--ring", "3"], r"--ring 3 does not divide --sp 4; choose --ring in \{1, 2, 4\}"),
    (1, ["--layer-pattern", "da", "--gdn-k-heads", "4", "--gdn-v-heads", "6"],
     r"gdn_v_heads=6 is not a multiple of gdn_k_heads=4; choose gdn_v_heads in \{4, 8, 12, 16, \.\.\.\}"),
    (4, ["--layer-pattern", "d", "--gdn-k-heads", "1", "--gdn-v-heads", "2"],
     r"--sp 4 is larger than the 2 value heads of a Gated DeltaNet layer: a rank would hold none; choose --sp in "
     r"\{1, 2\} or more --gdn-v-heads"),
    (4, ["--ring", "2", "--layer-pattern", "da"], r"--ring 2 cannot be used with --gdn-parallel ulysses: its Gated "
                                                  r"DeltaNet layers need whole heads of the whole sequence "
                                                  r"\(--gdn-parallel context runs beside a ring\); use --ring 1"),
    (4, ["--ring", "2", "--pack"], r"--ring 2 cannot be used with --pack: the ring attends one document a row"),
    (4, ["--n-head", "8", "--n-kv-head", "6"], r"n_head=8 is not a multiple of n_kv_head=6"),
    (1, ["--metrics", "{empty}/metrics.jsonl"],
     r"--metrics: cannot make the folder .*empty.txt \(File exists\)"),
    (4, ["--seq-len", "3"], r"--seq-len 3 is smaller than --sp 4"),
    (1, ["--data", "/no/such/file.txt"], r"--data /no/such/file.txt: no such file"),
    (1, ["--batch-size", "0"], r"--batch-size 0 must be at least 1"),
    (1, ["--tiles", "0"], r"--tiles 0 must be at least 1"),
    (1, ["--data", "{empty}"], r"--data .*empty.txt: holds no text"),
    (1, ["--data", "{empty}", "--pack"], r"--data .*empty.txt: holds no text"),
    (1, ["--save-every", "5"], r"--resume, --save-every and --keep need --out-dir"),
    (1, ["--offload"], r"--offload keeps the block inputs that --recompute saves in CPU memory; add --recompute"),
    (1, ["--layer-pattern", "adx"], r"layer_pattern='adx': use the letters a \(softmax attention\) and d"),
    (1, ["--lr", "nan"], r"--lr nan must be a finite number above 0"),
    (1, ["--lr=-1e-3"], r"--lr -0.001 must be a finite number above 0"),
    (1, ["--weight-decay", "inf"], r"--weight-decay inf must be a finite number of 0 or more"),
    (1, ["--grad-clip", "-1"], r"--grad-clip -1 must be a finite number of 0 or more"),
    (1, ["--timeout", "0"], r"--timeout 0 must be a finite number above 0"),
    (1, ["--warmup", "-2"], r"--warmup -2 must be at least 0"),
    (1, ["--keep", "-1"], r"--keep -1 must be at least 0"),
    (1, ["--timeout", "1e20"], r"--timeout 1e\+20 must be at most 604800 seconds \(a week\)"),
    (1, ["--seed", str(10**16)], r"--seed 10000000000000000 must be in \[0, 2\*\*32\)"),
    (1, ["--metrics", "{tmp}"], r"--metrics \S+ is a directory; give a file name, e.g. \S+metrics.jsonl"),
    (1, ["--data", "{one_paragraph}", "--pack"], r"has no blank line between paragraphs, so --pack would make one "
                                                 r"document of it; separate documents with blank lines, or drop "
                                                 r"--pack"),
])
def test_bad_input_is_refused(monkeypatch, tmp_path, world_size, argv, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "one.txt").write_text("one paragraph\r\nof two lines\r\n")
    argv = [a.format(empty=tmp_path / "empty.txt", tmp=tmp_path, one_paragraph=tmp_path / "one.txt") for a in argv]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit, match=message):
        train.main(argv)
    assert not dist.is_initialized()


def test_torchrun_shows_the_error_line_once(tmp_path):
    """Under torchrun every rank finds the mistake; its line is printed once, before torchrun's own report."""
    done = subprocess.run(torchrun(4) + ["--lr", "nan"], cwd=HERE, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert output.count("train.py: error: --lr nan must be a finite number above 0") == 1
    assert output.index("train.py: error:") < output.index("FAILED")


def _unequal_shards_rank(rank, world_size):
    model = GPT(GPTConfig(n_layer=1, n_embd=32), sp_group=dist.group.WORLD)
    idx = torch.zeros(2, 3 + rank, dtype=torch.long)  # rank 0: 3 tokens, rank 1: 4
    try:
        model(idx, torch.arange(3 + rank).expand(2, -1))
    except ValueError as e:
        return str(e)


def test_shards_of_different_lengths_are_refused():
    """Shards made by hand with different lengths: a clear error on every rank, not an abort inside gloo."""
    for message in run_ranks(2, _unequal_shards_rank):
        assert message.startswith("the ranks of the SP group hold [batch, tokens] shards of different shapes, "
                                  "[(2, 3), (2, 4)] by rank")


SHORT_RUN = ["--steps", "6", "--save-every", "3", "--n-layer", "2", "--n-embd", "32", "--seq-len", "32"]


def _flip(data, n=64):
    """data with n bytes in its middle inverted."""
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + n]) + data[middle + n:]


@pytest.mark.parametrize("name, damage, problem", [
    ("trainer.pt", lambda data: b"", r"trainer.pt has 0 bytes, not [\d,]+"),
    ("shard_00000-of-00001.pt", lambda data: data[:len(data) // 2],
     r"shard_00000-of-00001.pt has [\d,]+ bytes, not [\d,]+"),
    ("shard_00000-of-00001.pt", _flip, r"shard_00000-of-00001.pt does not match its SHA-256 \(changed on the disk\)"),
], ids=["empty", "truncated", "flipped"])
def test_a_damaged_checkpoint_falls_back_to_the_one_before(tmp_path, monkeypatch, capsys, name, damage, problem):
    """A checkpoint file emptied, cut short, or with 64 bytes flipped fails verification against the manifest: one
    line says so, the run resumes from the checkpoint before it, and its steps equal the run that never stopped."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    out_dir = tmp_path / "run"
    straight = train.main(SHORT_RUN + ["--out-dir", str(out_dir)])
    part = out_dir / "step_000006" / name
    part.write_bytes(damage(part.read_bytes()))
    capsys.readouterr()
    resumed = train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    printed = capsys.readouterr().out
    assert re.search(rf"^note: checkpoint \S+step_000006 fails verification \({problem}\); trying the one before "
                     rf"it$", printed, re.M), printed
    assert f"resuming from {out_dir / 'step_000003'} after step 3" in printed
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    assert train.verify(out_dir / "step_000006", 0, 1) is None  # written anew over the damaged one


def test_checkpoints_that_cannot_be_used_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    out_dir = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"--resume: no complete checkpoint in --out-dir"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    train.main(SHORT_RUN + ["--out-dir", str(out_dir)])
    with pytest.raises(SystemExit, match=r"already holds checkpoints; add --resume to continue from step_000006"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir)])  # never overwritten by accident
    with pytest.raises(SystemExit, match=r"holds a model with .*'n_embd': 32.*the flags ask for .*'n_embd': 64"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--n-embd", "64"])
    # a longer run would move the learning rate of step 7 (the cosine restretched): refused unless asked for
    with pytest.raises(SystemExit, match=r"--steps 6 -> 12 against checkpoint \S+step_000006 would move the learning "
                                         r"rate of step 7 from 0.0001 to 0.000[\d]+; resume with the checkpoint's "
                                         r"values, or add --new-schedule to accept it$"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--steps", "12"])
    assert [r["step"] for r in train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--steps", "7",
                                                       "--new-schedule"])] == [7]
    with train.lock_out_dir(str(out_dir)):  # another live run
        with pytest.raises(SystemExit, match=r"--out-dir \S+ is in use by another run \(pid \d+ on \S+\); wait for it "
                                             r"to end, or choose another directory"):
            train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    with pytest.raises(SystemExit, match=r"checkpoint \S+step_000007 is past --steps 6: it has done 7 steps$"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--new-schedule"])
    # torchrun restarting a run (--max-restarts) resumes by itself, but only from its own checkpoints
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-run")
    with pytest.raises(SystemExit, match=r"already holds checkpoints of another run; add --resume to continue from "
                                         r"step_000007"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--steps", "7"])
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    (out_dir / "step_000009").mkdir()  # a copy cut short, or a checkpoint of an older train.py
    with pytest.raises(SystemExit, match=r"holds step_000009 without a manifest.json \(from an older train.py, or a "
                                         r"copy cut short\); move it out of the directory$"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    (out_dir / "step_000009").rmdir()
    for path in train.checkpoints(out_dir):
        (out_dir / path / "trainer.pt").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"no checkpoint in --out-dir \S+ passes verification"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    kept = tmp_path / "kept"  # --keep 2: the newest two of the six
    train.main(SHORT_RUN[:2] + ["--save-every", "1", "--keep", "2"] + SHORT_RUN[4:] + ["--out-dir", str(kept)])
    assert sorted(os.listdir(kept)) == [".lock", "step_000005", "step_000006"]


def test_metrics_lines_cut_short_are_dropped_on_resume(tmp_path, monkeypatch, capsys):
    """A blank line and a line cut short (a full disk, two runs on one file) in --metrics: a resume drops them,
    says how many, and writes every step's line again."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    out_dir, metrics = tmp_path / "run", tmp_path / "logs" / "metrics.jsonl"  # its folder made by the run
    argv = SHORT_RUN + ["--out-dir", str(out_dir), "--metrics", str(metrics)]
    train.main(argv)
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:2] + ["", lines[2][:20]] + lines[3:]) + "\n")
    shutil.rmtree(out_dir / "step_000006")
    capsys.readouterr()
    train.main(argv + ["--resume"])
    assert f"note: --metrics {metrics}: dropped 2 line(s) that were not whole records" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 4, 5, 6]


def _torchrun_patched(tmp_path, patch, argv, timeout=120):
    """train.py's main under torchrun on 2 ranks, after `patch` (Python source) ran on rank 1 alone. Returns
    (exit status, output, seconds)."""
    script = tmp_path / "patched_train.py"
    script.write_text(f"import os, sys, time\nsys.path.insert(0, {HERE!r})\nimport data, train\n"
                      f"if os.environ['RANK'] == '1':\n" + "".join(f"    {line}\n" for line in patch.splitlines())
                      + "train.main()\n")
    start = time.time()
    done = subprocess.run(torchrun(2)[:-1] + [str(script), *argv], cwd=HERE, capture_output=True, text=True,
                          timeout=timeout)
    return done.returncode, done.stdout + done.stderr, time.time() - start


def test_an_error_on_one_rank_stops_every_rank_with_its_line(tmp_path):
    """The data file missing on one machine: that rank's line, printed once, and every rank stops at once, not
    after --timeout."""
    text = tmp_path / "text.txt"
    text.write_text(PARAGRAPHS)
    status, output, seconds = _torchrun_patched(tmp_path, "def read_documents(*args):\n"
                                                "    raise ValueError('no such file or directory')\n"
                                                "data.read_documents = read_documents", ["--data", str(text)])
    assert status != 0 and seconds < 30, output[-3000:]
    assert output.count(f"train.py: error: rank 1: --data {text}: no such file or directory") == 1, output[-3000:]


def test_a_save_slower_than_the_timeout_completes(tmp_path):
    """A rank that takes 9 s to write its checkpoint files, with --timeout 4: the others wait for it, as no
    collective deadline applies to the writing, and the run completes."""
    status, output, _ = _torchrun_patched(tmp_path, "write_files = train.write_files\n"
                                          "train.write_files = lambda path, files: time.sleep(9 * any(name.startswith("
                                          "'shard') for name in files)) or write_files(path, files)",
                                          ["--steps", "2", "--n-embd", "32", "--seq-len", "32", "--timeout", "4",
                                           "--out-dir", str(tmp_path / "run")])
    assert status == 0, output[-3000:]
    assert [os.path.basename(p) for p in train.checkpoints(tmp_path / "run")] == ["step_000002"]


def test_a_rank_that_hangs_while_saving_ends_the_run(tmp_path):
    """A rank stuck in its writing, its heartbeat stopped too: the rank waiting for it names it after --timeout
    seconds and the run fails, rather than waiting for ever."""
    status, output, seconds = _torchrun_patched(tmp_path, "import contextlib\n"
                                                "train.heartbeat = lambda path, every: contextlib.nullcontext()\n"
                                                "train.write_files = lambda path, files: time.sleep(1000)",
                                                ["--steps", "2", "--n-embd", "32", "--seq-len", "32", "--timeout", "4",
                                                 "--out-dir", str(tmp_path / "run")])
    assert status != 0 and seconds < 60, output[-3000:]
    assert output.count("train.py: error: rank 0: checkpoint ") == 1, output[-3000:]
    assert re.search(r"step_000002.tmp: ranks \[1\] gave no sign of life for --timeout 4 s", output)


def test_a_full_disk_says_so(tmp_path, monkeypatch):
    """torch.save on a full disk fails in its zip writer ("unexpected pos ..."); the line says the disk is full."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    def full_disk(*args):
        raise RuntimeError("unexpected pos 797312 vs 797204")
    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: argparse.Namespace(free=0))
    with pytest.raises(SystemExit, match=r"train.py: error: no space left on the device of \S+step_000003.tmp "
                                         r"\(0.0 MiB free\) for shard_00000-of-00001.pt; free some, or keep fewer "
                                         r"checkpoints \(--keep\)$"):
        train.main(SHORT_RUN + ["--out-dir", str(tmp_path / "run")])
    assert train.checkpoints(tmp_path / "run") == []


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    out_dir = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"step 2: loss nan, gradient norm nan; stopped before the update"):
        train.main(["--lr", "1e30", "--warmup", "1", "--save-every", "1", "--out-dir", str(out_dir)] + SHORT_RUN[4:])
    assert sorted(os.listdir(out_dir)) == [".lock", "step_000001"]


def _launch(tmp_path, extra, timeout=300):
    """torchrun with 2 ranks on a tiny model, saving every 10 steps; returns (process, out_dir, its worker pids)."""
    out_dir = tmp_path / "run"
    cmd = torchrun(2, *extra) + ["--steps", "300", "--seq-len", "32", "--n-embd", "32", "--save-every", "10",
                                 "--out-dir", str(out_dir), "--timeout", str(timeout)]
    launcher = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 90
    while not (out_dir / "step_000010").exists() and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.05)
    workers = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[1] == str(launcher.pid):
                workers.append(int(pid))
    assert len(workers) == 2, "the workers were not found"
    return launcher, out_dir, sorted(workers)


def test_killed_rank_restarts_from_the_last_checkpoint(tmp_path):
    """torchrun --max-restarts=1: kill one rank mid-run; the group restarts, resumes and finishes."""
    launcher, out_dir, workers = _launch(tmp_path, ["--max-restarts=1"])
    os.kill(workers[1], signal.SIGKILL)
    output, _ = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, output[-3000:]
    assert "resuming from" in output and (out_dir / "step_000300").exists()


def test_hung_rank_ends_the_run_within_the_timeout(tmp_path):
    """A peer that stops answering: the others give up after --timeout seconds, naming the collective."""
    launcher, _, workers = _launch(tmp_path, [], timeout=8)  # long enough for both ranks to start up
    os.kill(workers[1], signal.SIGSTOP)
    stopped = time.time()
    for line in launcher.stdout:
        if "train.py: error:" in line:
            break
    waited = time.time() - stopped
    os.kill(workers[1], signal.SIGKILL)  # torchrun would wait 30 s for a stopped process to take its SIGTERM
    launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    named = r"(\w+|the collective waited on at [\w.]+:\d+)"  # a call, or the line that waited on an async one
    assert re.search(rf"rank \d+, step \d+: {named} failed \(a peer process died, or waited longer than "
                     r"--timeout 8 s\)", line)
    assert waited < 8 + 10
