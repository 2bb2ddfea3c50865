"""
Every measurement of the project, one sub-command per topic of BENCHMARKS.md. Measuring lives here, never in the files
that teach a concept, so those read as their lesson. Run it from the repository's root:

    python -m harness.bench attention  # one attention layer: ulysses_attention against the kernel alone, three
                                       # all-to-alls (DeepSpeed's DistributedAttention) and all-gathered k, v; weak
                                       # scaling; --check-cost: what ulysses_attention's input check costs a call;
                                       # --versus FILE: beside another copy of ulysses.py, in the same processes
    python -m harness.bench tiled      # what sequence tiling saves in the MLP and the loss (tiled.py)
    python -m harness.bench deltanet   # the gated delta rule, chunked against the token-by-token recurrence; the
                                       # layer under SP, Ulysses against context parallelism (deltanet.py)
    python -m harness.bench memory     # train.py's measured peak memory per rank, and what measuring costs
    python -m harness.bench plans      # ALST's table: Llama-3-8B's longest sequence on 1, 8 and 32 GPUs, by the
                                       # traced step (train.py --plan); the peaks at ALST's lengths
    python -m harness.bench compile    # train.py eager against --compile: the first step (which compiles), the rest
    python -m harness.bench ring       # Ulysses, ring and Ulysses x Ring on the same ranks: time, bytes, calls,
                                       # memory; the ring's fused block kernel against its einsum tiles and one
                                       # process's SDPA; causal work per rank, contiguous against zigzag
    python -m harness.bench balance    # packed documents under a ring: each rank's causal work and the step time,
                                       # zigzag against per-document balance
    python -m harness.bench gpu        # on a CUDA GPU: the ring's block kernel and ulysses_attention against SDPA,
                                       # the chunked gated delta rule against FLA's Triton kernel; --profile S: a
                                       # 0.7B model's compiled step under torch.profiler

Multi-rank measurements start their own gloo processes on this machine; `python -m harness.bench CMD --help` lists
the options of each.
"""

import argparse
import contextlib
import json
import math
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._library.custom_ops import _maybe_get_opdef
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

import deltanet as gdn
import documents
import gpt
import ring
import ulysses
from harness import launch, memory
from tiled import tiled_lm_loss, tiled_mlp
from zero3 import all_gather, reduce_scatter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository's, where train.py is


def _rank_main(rank, P, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(P),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(P))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))  # the processes share this machine's cores
    dist.init_process_group("gloo", rank=rank, world_size=P)
    result = fn(rank, P, *args)
    if rank == 0:
        results.put(result)
    dist.destroy_process_group()


def run_ranks(P, fn, *args):
    """fn(rank, P, *args) on P new gloo processes; returns what rank 0 returned."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank_main, args=(P, port, fn, args, results), nprocs=P, start_method="spawn")
    return results.get()


@contextlib.contextmanager
def measuring(what, every=5.0):
    """Says on stderr what is being measured and for how long, every `every` seconds, so that a measurement of
    minutes never sits silent: on a terminal one line, redrawn and cleared before the row is printed; into a file
    or a pipe, a line each time."""
    terminal = sys.stderr.isatty()
    line = tqdm(desc=what, bar_format="{desc}: {elapsed_s:.0f} s", leave=False, dynamic_ncols=True,
                disable=not terminal)
    start = time.monotonic()

    def redraw():
        if terminal:
            line.refresh()  # the elapsed time moves on
        else:
            print(f"{what}: {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

    try:
        with launch.repeating(redraw, every):
            yield
    finally:
        line.close()  # after the last redraw


def peak_bytes(run, *existing):
    """Peak tensor memory (bytes) while run() runs: every storage made inside, the temporaries of the all-to-all
    and ring operators included, and those of the `existing` tensors made before (memory.StorageBytes)."""
    with memory.StorageBytes(existing, inside_operators=True) as storages:
        run()
    return storages.peak


def median_seconds(run, repetitions):
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ----------------------------------------------------------------------------------------------------------------
# python -m harness.bench attention: one attention layer, forward + backward, against what else could carry it
#
# (a) the kernel alone on the full sequence for H/P heads, the floor; with 4 barriers: (a) plus a barrier before
#     and after the kernel, forward and backward, the price of synchronization alone;
# (b) ulysses_attention, as gpt.py runs it;
# (c) q, k and v in three all-to-alls, with the copies DeepSpeed's DistributedAttention makes;
# (d) every rank all-gathers k and v and attends with its own queries; backward reduce-scatters dk and dv.
# Each is timed, and its bytes sent, its bytes copied outside the collective and its peak memory are counted.

sent_stats = {"bytes": 0}  # what (c) and (d) have sent; ulysses_attention counts its own in ulysses.all_to_all_stats


def three_all_to_alls(q, k, v, group, attn_fn=ulysses.causal_attention):
    """(c): attention with q, k and v in three all-to-alls and the output in a fourth (P must divide both head
    counts)."""
    q, k, v = (_DeepSpeedAllToAll.apply(t, group, 2, 1) for t in (q, k, v))  # (B, S, heads/P, D)
    return _DeepSpeedAllToAll.apply(attn_fn(q, k, v), group, 1, 2)  # (B, S/P, H, D)


class _DeepSpeedAllToAll(torch.autograd.Function):
    """The all-to-all of one tensor as DeepSpeed's DistributedAttention makes it: x cut into P equal pieces along
    scatter_dim, piece j sent to rank j, the pieces received joined along gather_dim, rank i's at place i. Two
    copies: the pieces into one send buffer, and the pieces received into one tensor. With B = 1 one is free: the
    pieces of the sequence lie in order already, whether sent (no copy before) or received (none after).
    Backward: the same exchange, the two dimensions swapped."""

    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.reverse = (group, gather_dim, scatter_dim)
        return _deepspeed_exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _deepspeed_exchange(grad, *ctx.reverse), None, None, None


def _deepspeed_exchange(x, group, scatter_dim, gather_dim):
    """The shape comments follow seq_to_heads (scatter 2, gather 1), with H/P the heads of each rank."""
    P = dist.get_world_size(group)
    send = x.unflatten(scatter_dim, (P, -1)).movedim(scatter_dim, 0)  # (B, S/P, H, D) -> (P, B, S/P, H/P, D)
    send = send.contiguous()  # the first copy: row j, my tokens of rank j's heads, goes to rank j
    received = torch.empty_like(send)  # (P, B, S/P, H/P, D): row i, rank i's tokens of my heads
    dist.all_to_all_single(received, send, group=group)
    sent_stats["bytes"] += send.nbytes // P * (P - 1)  # row `rank` stays here
    joined = received.movedim(0, gather_dim)  # (P, B, S/P, H/P, D) -> (B, P, S/P, H/P, D)
    return joined.contiguous().flatten(gather_dim, gather_dim + 1)  # -> (B, S, H/P, D), the second copy (B = 1: none)


class _GatherSequence(torch.autograd.Function):
    """All-gather [B, S/P, H, D] along the sequence into [B, S, H, D]; backward reduce-scatters (sums) the full
    gradient back to each rank's tokens. Every rank sends (P-1)/P of the gathered tensor each way."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        P, (B, S_local, H, D) = dist.get_world_size(group), x.shape
        full = x.new_empty(P * B, S_local, H, D)  # rank j's tokens in rows j*B .. (j+1)*B - 1
        with CopiedBytes.collective():
            all_gather(full, x.contiguous(), group=group)
        sent_stats["bytes"] += x.nbytes * (P - 1)
        return full.view(P, B, S_local, H, D).transpose(0, 1).reshape(B, P * S_local, H, D)  # (B, S, H, D)

    @staticmethod
    def backward(ctx, grad):
        P, (B, S, H, D) = dist.get_world_size(ctx.group), grad.shape
        mine = grad.new_empty(B, S // P, H, D)
        rows = grad.reshape(B, P, S // P, H, D).transpose(0, 1).reshape(P * B, S // P, H, D)  # rank j's: rows j*B..
        with CopiedBytes.collective():  # gloo copies its result into `mine` as the caller waits
            reduce_scatter(mine, rows, group=ctx.group)
        sent_stats["bytes"] += mine.nbytes * (P - 1)
        return mine, None


def gathered_kv(q, k, v, group):
    """(d): all of k and v, this rank's queries."""
    k, v = (_GatherSequence.apply(t, group) for t in (k, v))  # (B, S, Hkv, D)
    i = torch.arange(q.shape[1]) + dist.get_rank(group) * q.shape[1]  # global positions of my queries
    allowed = i[:, None] >= torch.arange(k.shape[1])[None, :]  # (S/P, S): causal
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=allowed,
                                          enable_gqa=k.shape[2] != q.shape[2]).transpose(1, 2)  # (B, S/P, H, D)


class _Barrier(torch.autograd.Function):
    """Identity on tensors that waits for every rank of the group, in forward and again in backward."""

    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group = group
        dist.barrier(group=group)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        dist.barrier(group=ctx.group)
        return None, *grads


class _CopyQ(torch.autograd.Function):
    """--kernel copy: a stand-in kernel that only copies q, into [B, S, H, D] memory as attention kernels return
    their output, so that the exchange is all there is to time. Backward hands the gradient to q and zeros to k
    and v, so that every all-to-all of backward runs, as it does with a real kernel."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.kv = [(t.shape, t.dtype) for t in (k, v)]
        return q.clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx, grad):
        return grad, *(grad.new_zeros(shape, dtype=dtype) for shape, dtype in ctx.kv)


KERNELS = {"sdpa": ulysses.causal_attention, "copy": _CopyQ.apply}


def _variants(group, args):
    """name -> (its forward on the tensors of _attention_inputs, the names of the tensors it reads, and of those
    its backward returns gradients for)."""
    kernel = KERNELS[args.kernel]
    heads, qkv = ("q_heads", "k_heads", "v_heads"), ("q", "k", "v")
    variants = {
        "(a) kernel alone": (lambda t: kernel(*(t[n] for n in heads)), heads, heads),
        "(a) with 4 barriers": (lambda t: _Barrier.apply(group, kernel(*_Barrier.apply(group, *(t[n] for n in heads)))
                                                         )[0], heads, heads),
        "(b) ulysses_attention": (lambda t: ulysses.ulysses_attention(t["q"], t["k"], t["v"], group, kernel), qkv, qkv),
        "(c) 3 all-to-alls": (lambda t: three_all_to_alls(t["q"], t["k"], t["v"], group, kernel), qkv, qkv),
        "(d) all-gather k, v": (lambda t: gathered_kv(t["q"], t["k"], t["v"], group), qkv, qkv)}
    if args.kernel == "copy":  # (d) has its own kernel
        del variants["(d) all-gather k, v"]
    if args.versus:  # (b) as another copy of ulysses.py runs it, with the same kernel
        other = _other_ulysses(args.versus)
        variants[VERSUS] = (lambda t: other.ulysses_attention(t["q"], t["k"], t["v"], group, kernel), qkv, qkv)
    return variants


VERSUS = "(b) --versus"
EXCHANGES = [ulysses]  # the copies of ulysses.py whose all-to-alls count: this one, and --versus's


def _other_ulysses(path):
    """--versus FILE: another copy of ulysses.py (another checkout's), loaded beside this one in the same process,
    its operators renamed (else torch lets the copy's replace this one's). Its bytes sent count with this one's."""
    with open(path) as f:
        source = f.read().replace('"ulysses::', '"ulysses_versus::')
    module = sys.modules["ulysses_versus"] = types.ModuleType("ulysses_versus")
    exec(compile(source, path, "exec"), module.__dict__)
    EXCHANGES.append(module)
    return module


def _forward(variant, tensors):
    """A variant's output and the fresh leaves its backward differentiates (no gradient is accumulated into
    .grad, which would copy (a)'s into the layout of its inputs, a copy no other variant makes)."""
    forward, read, differentiated = variant
    leaves = {name: tensors[name].detach().requires_grad_(name in differentiated) for name in read}
    return forward(leaves), [leaves[name] for name in differentiated]


def _forward_backward(variant, tensors):
    out, leaves = _forward(variant, tensors)
    return torch.autograd.grad(out, leaves, torch.ones_like(out))


def _attention_inputs(rank, P, S, args):
    """This rank's tensors, by name: q, k, v [B, S/P, heads, D]; and (a)'s q, k, v of H/P heads of the whole
    sequence [B, S, heads/P, D], token-major as (c)'s all-to-alls leave them."""
    g = torch.Generator().manual_seed(rank)
    B, H, Hkv, D, dtype = args.batch_size, args.heads, args.kv_heads, args.head_dim, getattr(torch, args.dtype)
    tensors = {name: torch.randn(B, S // P, h, D, generator=g) for name, h in zip(("q", "k", "v"), (H, Hkv, Hkv))}
    tensors.update({f"{name}_heads": torch.randn(B, S, h // P, D, generator=g)
                    for name, h in zip(("q", "k", "v"), (H, Hkv, Hkv))})
    return {name: t.to(dtype) for name, t in tensors.items()}


class CopiedBytes(TorchDispatchMode):
    """Counts the bytes that copying ops write while it is entered (.bytes): copies and clones (what contiguous
    and reshape make), casts, joins, pads, gathers by index, and the backward of slicing (not writes by index into a
    tensor in place, which return the whole tensor; no variant makes one). Sums are arithmetic, not
    copies: a kv head's gradient added up from the ranks it went to, or from the query heads it was expanded for.
    What the collective copies inside (gloo's own block, from the send to the receive buffer; a reduce-scatter's
    result into its output) is not counted (`collective`), nor what a kernel copies inside its own op; an operator
    written in Python (ulysses' exchange) runs its code under the count, so its copies count."""

    COPYING = {torch.ops.aten.copy_.default, torch.ops.aten.clone.default, torch.ops.aten._to_copy.default,
               torch.ops.aten.cat.default, torch.ops.aten.stack.default, torch.ops.aten.index.Tensor,
               torch.ops.aten.index_select.default, torch.ops.aten.gather.default,
               torch.ops.aten.slice_backward.default, torch.ops.aten.select_backward.default,
               torch.ops.aten.slice_scatter.default, torch.ops.aten.select_scatter.default,
               torch.ops.aten.as_strided_scatter.default, torch.ops.aten.repeat.default, torch.ops.aten.flip.default,
               torch.ops.aten.roll.default, torch.ops.aten.index_put.default, torch.ops.aten.scatter.src,
               torch.ops.aten.constant_pad_nd.default, torch.ops.aten.narrow_copy.default,
               torch.ops.aten.masked_select.default, torch.ops.aten.cat.out,
               torch.ops.aten.split_with_sizes_copy.default}
    inside_collective = False

    def __init__(self):
        super().__init__()
        self.bytes = 0

    @classmethod
    @contextlib.contextmanager
    def collective(cls):
        """A collective call runs inside: what it copies is its own."""
        before, cls.inside_collective = cls.inside_collective, True
        try:
            yield
        finally:
            cls.inside_collective = before

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        custom = _maybe_get_opdef(func)
        if custom is not None:
            with self:
                return custom._init_fn(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func in self.COPYING and not self.inside_collective:
            self.bytes += sum(t.nbytes for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def _sent():
    return sent_stats["bytes"] + sum(c["bytes"] for m in EXCHANGES for c in m.all_to_all_stats.values())


def _moved(variant, tensors):
    """(bytes sent, bytes copied outside the collective), forward and backward: four numbers of this rank."""
    for module in EXCHANGES:
        module.reset_all_to_all_stats()
    sent_stats["bytes"] = 0
    with CopiedBytes() as forward:
        out, leaves = _forward(variant, tensors)
    sent_forward = _sent()
    with CopiedBytes() as backward:
        torch.autograd.grad(out, leaves, torch.ones_like(out))
    return sent_forward, _sent() - sent_forward, forward.bytes, backward.bytes


def _attention_rank(rank, P, S, args):
    """{variant: [seconds per repetition]}, and, at the main sequence length, {variant: (bytes sent forward,
    backward, bytes copied forward, backward, peak bytes)} of this rank."""
    group = dist.group.WORLD
    variants = _variants(group, args)
    names = list(variants) if P > 1 else ["(a) kernel alone"]
    tensors = _attention_inputs(rank, P, S, args)
    times = {name: [] for name in names}
    for repetition in range(args.reps + 1):  # the first is a warm-up
        for name in names:  # interleaved, so that a slow moment of the machine hits every variant alike
            dist.barrier()
            start = time.perf_counter()
            _forward_backward(variants[name], tensors)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    counts = {}
    for name in names:  # what each moves, and its peak memory with every storage counted, inside operators too
        read = [tensors[n] for n in variants[name][1]]
        peak = peak_bytes(partial(_forward_backward, variants[name], tensors), *read) if args.memory else 0
        counts[name] = (*_moved(variants[name], tensors), peak)
    return times, counts


def _attention_bytes(name, P, S, args):
    """What a rank sends, forward + backward, in closed form (P divides the heads)."""
    B, H, Hkv, D, e = args.batch_size, args.heads, args.kv_heads, args.head_dim, getattr(torch, args.dtype).itemsize
    if name.startswith("(d)"):  # k and v gathered forward, their gradients reduce-scattered backward
        return 4 * B * S * Hkv * D * (P - 1) // P * e
    return 0 if name.startswith("(a)") else 2 * (2 * H + 2 * Hkv) * B * S * D * (P - 1) // P**2 * e


def _check_rank(rank, P, args):
    """Seconds of ulysses_attention forward and backward, with its input check and without, interleaved."""
    q, k, v = (_attention_inputs(rank, P, args.seq_len, args)[name] for name in ("q", "k", "v"))
    seconds = {True: [], False: []}
    for repetition in range(args.reps + 1):  # the first is a warm-up
        for check in (True, False):
            inputs = [t.detach().requires_grad_() for t in (q, k, v)]
            dist.barrier()
            start = time.perf_counter()
            out = ulysses.ulysses_attention(*inputs, dist.group.WORLD, check=check)
            torch.autograd.grad(out, inputs, torch.ones_like(out))
            seconds[check].append(time.perf_counter() - start)
    return {check: statistics.median(times[1:]) for check, times in seconds.items()}


def check_cost(args):
    for P in args.sp:
        with measuring(f"P={P}: ulysses_attention with and without its input check"):
            seconds = run_ranks(P, _check_rank, args)
        print(f"P={P} S={args.seq_len} H={args.heads} D={args.head_dim}, {args.dtype}, forward and backward, median "
              f"of {args.reps}: {seconds[True] * 1e3:.1f} ms with the check, {seconds[False] * 1e3:.1f} ms without: "
              f"{(seconds[True] / seconds[False] - 1) * 100:+.1f}%", flush=True)


BASELINE = {"(b) ulysses_attention": "(c) 3 all-to-alls"}


def attention(args):
    if args.check_cost:
        return check_cost(args)
    B, H, D, Hkv, S = args.batch_size, args.heads, args.head_dim, args.kv_heads, args.seq_len
    kernel = {"sdpa": "causal SDPA", "copy": "a kernel that only copies q (the exchange alone)"}[args.kernel]
    print(f"one attention layer, forward + backward: B={B} H={H} kv heads={Hkv} D={D}, {args.dtype}, {kernel}, gloo, "
          f"{os.cpu_count()} cores shared by the P processes; median of {args.reps}; overhead = time - (a), paired by "
          f"repetition; middle half: its quartiles; vs: (b)'s overhead over (c)'s")
    print(f"{'P':>2} {'S':>6}  {'variant':<22} {'ms':>8} {'overhead ms':>12} {'middle half':>12} {'vs':>6} "
          f"{'bytes sent/rank':>16} {'formula':>13}", flush=True)
    measured = {}
    for P in args.sp:
        with measuring(f"P={P} S={S}: {args.reps + 1} repetitions of every variant"):
            times, counts = measured[P, S] = run_ranks(P, _attention_rank, S, args)
        floor = times["(a) kernel alone"][1:]  # the first repetition is a warm-up
        overheads = {name: [b - a for a, b in zip(floor, t[1:])] for name, t in times.items()}
        overhead = {name: statistics.median(o) for name, o in overheads.items()}
        for name, t in times.items():
            versus = f"{overhead[name] / overhead[BASELINE[name]]:.2f}x" if name in BASELINE else ""
            low, _, high = statistics.quantiles(overheads[name], n=4)
            print(f"{P:>2} {S:>6}  {name:<22} {statistics.median(t[1:]) * 1e3:8.1f} {overhead[name] * 1e3:12.1f} "
                  f"{f'{low * 1e3:.0f} to {high * 1e3:.0f}':>12} {versus:>6} {sum(counts[name][:2]):>16,} "
                  f"{_attention_bytes(name, P, S, args):>13,}", flush=True)
        if VERSUS in times:
            paired = [b / v for b, v in zip(times["(b) ulysses_attention"][1:], times[VERSUS][1:])]
            print(f"{P:>2} {S:>6}  (b) over {args.versus}'s, the median of the ratios paired by repetition: "
                  f"{statistics.median(paired):.3f}x", flush=True)
        q_mib = B * S // P * H * D * getattr(torch, args.dtype).itemsize / 2**20
        print(f"what each variant moves, rank 0: bytes sent, bytes copied outside the collective (copy ops counted "
              f"by a dispatch mode), copies per byte sent, and the peak tensor memory of forward + backward (every "
              f"storage counted, inside the operators too; q on this rank: {q_mib:.1f} MiB)")
        print(f"{'':10}{'variant':<22} {'sent fwd':>12} {'sent bwd':>12} {'copied fwd':>12} {'copied bwd':>12} "
              f"{'per byte fwd':>12} {'per byte bwd':>12} {'peak MiB':>9}")
        for name, (sent_fwd, sent_bwd, copied_fwd, copied_bwd, peak) in counts.items():
            per_byte = [f"{c / s:.2f}" if s else "" for c, s in ((copied_fwd, sent_fwd), (copied_bwd, sent_bwd))]
            peak_mib = f"{peak / 2**20:.1f}" if args.memory else ""  # --no-memory: not measured
            print(f"{'':10}{name:<22} {sent_fwd:>12,} {sent_bwd:>12,} {copied_fwd:>12,} {copied_bwd:>12,} "
                  f"{per_byte[0]:>12} {per_byte[1]:>12} {peak_mib:>9}", flush=True)
    if args.weak_seq_len:
        weak_scaling(args, measured)
    if args.plot:
        plot_attention(args, measured)


def weak_scaling(args, measured):
    print(f"weak scaling, S = {args.weak_seq_len} x P: bytes each rank sends (formula) and time")
    print(f"{'P':>2} {'S':>6}  {'(b) bytes (formula)':>24} {'(d) bytes (formula)':>24} {'(a) ms':>8} {'(b) ms':>8} "
          f"{'(d) ms':>8}", flush=True)
    for P in (1, 2, 4):
        S = args.weak_seq_len * P
        if (P, S) not in measured:
            with measuring(f"P={P} S={S}: {args.reps + 1} repetitions of every variant"):
                measured[P, S] = run_ranks(P, _attention_rank, S, args)
        times, counts = measured[P, S]
        b, d = ("(b) ulysses_attention", "(d) all-gather k, v") if P > 1 else ("(a) kernel alone",) * 2
        columns = [f"{sum(counts[name][:2]):,} ({_attention_bytes(name, P, S, args):,})" for name in (b, d)]
        ms = [statistics.median(times[name][1:]) * 1e3 for name in ("(a) kernel alone", b, d)]
        print(f"{P:>2} {S:>6}  {columns[0]:>24} {columns[1]:>24} {ms[0]:8.1f} {ms[1]:8.1f} {ms[2]:8.1f}", flush=True)


def plot_attention(args, measured):
    """--plot FILE: the weak-scaling bytes, and each variant's copies and peak memory at --seq-len."""
    if not (plt := pyplot("--plot")):
        return
    mib = lambda b: b / 2**20
    fig, (weak, copies, peaks) = plt.subplots(1, 3, figsize=(15, 4.2))
    sizes = [P for P in (1, 2, 4) if (P, args.weak_seq_len * P) in measured]
    for name, label in (("(b) ulysses_attention", "Ulysses (b)"), ("(d) all-gather k, v", "all-gathered k, v (d)")):
        key = lambda P: name if P > 1 else "(a) kernel alone"
        weak.plot(sizes, [mib(sum(measured[P, args.weak_seq_len * P][1][key(P)][:2])) for P in sizes], "o-",
                  label=f"{label}, measured")
        weak.plot(sizes, [mib(_attention_bytes(key(P), P, args.weak_seq_len * P, args)) for P in sizes], "k:")
    weak.set(title=f"weak scaling, {args.weak_seq_len:,} tokens per rank: bytes each rank sends\n(forward + backward; "
                   f"dotted: the formula)", xlabel="P (ranks)", ylabel="MiB", xticks=sizes)
    weak.legend()
    names = ["(b) ulysses_attention", "(c) 3 all-to-alls"]
    width = 0.8 / len(args.sp)
    for i, P in enumerate(args.sp):
        counts = measured[P, args.seq_len][1]
        x = [j + i * width for j in range(len(names))]
        copies.bar(x, [mib(counts[n][2]) for n in names], width, label=f"P={P} forward")
        copies.bar(x, [mib(counts[n][3]) for n in names], width, bottom=[mib(counts[n][2]) for n in names],
                   label=f"P={P} backward", alpha=0.6)
        peaks.bar(x, [mib(counts[n][4]) for n in names], width, label=f"P={P}")
    for ax, title in ((copies, "bytes copied outside the collective, rank 0"), (peaks, "peak tensor memory, rank 0")):
        ax.set(title=f"{title}\nS {args.seq_len:,}, {args.dtype}", ylabel="MiB")
        ax.set_xticks([j + width * (len(args.sp) - 1) / 2 for j in range(len(names))],
                      [n.replace(" ", "\n", 1) for n in names])
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"--plot: {args.plot}")


# ----------------------------------------------------------------------------------------------------------------
# python -m harness.bench tiled: what tiling saves in one layer (every storage counted)


def _kept_and_peak(run, *inputs):
    """MiB above the inputs: (kept from forward for backward, peak over forward + backward)."""
    with memory.StorageBytes(inputs) as storages:
        base = storages.now  # the inputs
        out = run()
        kept = storages.now - base - out.nbytes  # saved for backward
        out.sum().backward()
        del out
    for t in inputs:
        t.grad = None
    return kept / 2**20, (storages.peak - base) / 2**20


def tiled(args):
    torch.manual_seed(0)
    B, S, h, vocab = 1, args.seq_len, args.hidden, args.vocab
    x = torch.randn(B, S, h, requires_grad=True)
    fc, proj, head = (torch.randn(shape).mul_(0.02).requires_grad_() for shape in ((4 * h, h), (h, 4 * h), (vocab, h)))
    labels = torch.randint(0, vocab, (B, S))

    def logits(t, head):
        return F.linear(t, head)

    def mlp(T):
        return gpt.gelu_mlp(x, fc, proj) if T == 1 else tiled_mlp(gpt.gelu_mlp, x, (fc, proj), T)

    def loss(T):
        if T == 1:
            return F.cross_entropy(logits(x, head).flatten(0, 1), labels.flatten(), reduction="sum")
        return tiled_lm_loss(logits, x, labels, (head,), T)[0]

    print(f"B={B} S={S} h={h} vocab={vocab}, float32; MiB above the inputs (x is {x.nbytes / 2**20:.0f} MiB)")
    print(f"{'layer':6} {'tiles':>5} {'kept for backward':>18} {'peak fwd+bwd':>13} {'peak falls':>11}", flush=True)
    for layer in (mlp, loss):
        untiled_peak = None
        for T in (1, 4, 8, 16):
            kept, peak = _kept_and_peak(partial(layer, T), x, fc, proj, head, labels)
            untiled_peak = untiled_peak or peak
            print(f"{layer.__name__:6} {T:5} {kept:18.1f} {peak:13.1f} {untiled_peak / peak:10.1f}x", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# python -m harness.bench deltanet: the gated delta rule, chunked against the recurrence


def deltanet(args):
    torch.manual_seed(0)
    B, S, H, D = 1, args.seq_len, args.heads, args.head_dim
    q, k = (F.normalize(torch.randn(B, S, H, D), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(B, S, H, D), -torch.rand(B, S, H) / 4, torch.rand(B, S, H)

    def forward(kernel):
        with torch.no_grad():
            kernel(q, k, v, g, beta)

    def forward_backward(kernel):
        inputs = [t.clone().requires_grad_() for t in (q, k, v, g, beta)]
        kernel(*inputs).sum().backward()

    print(f"gated delta rule, B={B} S={S} H={H} D={D}, float32, {torch.get_num_threads()} threads; "
          f"median of {args.reps}", flush=True)
    for name, run in (("forward", forward), ("forward + backward", forward_backward)):
        with measuring(f"{name}: {args.reps} repetitions of each kernel"):
            recurrence, chunked = (median_seconds(partial(run, kernel), args.reps)
                                   for kernel in (gdn.gated_delta_rule, gdn.chunk_gated_delta_rule))
        print(f"{name:18} recurrence {recurrence * 1e3:8.1f} ms   chunked {chunked * 1e3:7.1f} ms   "
              f"{recurrence / chunked:5.1f}x faster", flush=True)
    deltanet_ways(args)


def _deltanet_ways_rank(rank, P, args):
    """{(way, S): (median seconds, bytes this rank sent, peak bytes)}: one Gated DeltaNet layer, forward and
    backward, on this rank's S/P tokens, each way, every S."""
    cfg = dict(n_head=args.heads, n_kv_head=args.heads,  # unused by the layer, but GPTConfig checks it divides n_head
               n_embd=args.heads * args.head_dim, gdn_k_heads=args.heads // 2,
               gdn_v_heads=args.heads)  # Qwen3-Next's ratio: a key head for every two value heads
    layers = {}
    for way in ("ulysses", "context"):
        torch.manual_seed(0)
        layers[way] = gdn.GatedDeltaNet(gpt.GPTConfig(**cfg, gdn_parallel=way), dist.group.WORLD)
    results = {}
    for S in args.seq_lens:
        x = torch.randn(1, S // P, cfg["n_embd"], requires_grad=True)  # (B, S/P, h)
        for way, layer in layers.items():
            def step():
                out = layer(x, None, None, gdn.gated_delta_net)
                torch.autograd.grad(out, [x, *layer.parameters()], torch.ones_like(out))
            ulysses.reset_all_to_all_stats()
            gdn.reset_context_stats()
            step()  # a warm-up, whose bytes are counted
            sent = sum(c["bytes"] for c in ulysses.all_to_all_stats.values()) + sum(gdn.context_stats.values())
            dist.barrier()
            seconds = median_seconds(step, args.reps)
            results[way, S] = seconds, sent, peak_bytes(step, x, *layer.parameters())
    return results


def deltanet_ways(args):
    print(f"\none Gated DeltaNet layer under SP, forward + backward: {args.heads // 2} key and {args.heads} value "
          f"heads of {args.head_dim}, B=1, float32, gloo; median of {args.reps}; ulysses (all-to-alls of q, k, v, "
          f"b, a and o) against context (gathered summaries and left context)", flush=True)
    print(f"{'P':>2} {'S':>6}  {'ulysses ms':>10} {'context ms':>10} {'ulysses bytes':>14} {'context bytes':>14} "
          f"{'ulysses MiB':>11} {'context MiB':>11}", flush=True)
    for P in (2, 4):
        with measuring(f"P={P}: both ways at S = {', '.join(map(str, args.seq_lens))}"):
            results = run_ranks(P, _deltanet_ways_rank, args)
        for S in args.seq_lens:
            (u_s, u_b, u_m), (c_s, c_b, c_m) = results["ulysses", S], results["context", S]
            print(f"{P:>2} {S:>6}  {u_s * 1e3:10.1f} {c_s * 1e3:10.1f} {u_b:14,} {c_b:14,} {u_m / 2**20:11.1f} "
                  f"{c_m / 2**20:11.1f}", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# python -m harness.bench memory: train.py's measured peak, the busiest rank's, and what measuring costs


def train_run(P, argv):
    """train.py on P processes (torchrun on this machine), its output kept back; its --metrics records, one dict
    a step (the last with the measured step's peak_bytes, the largest over the ranks), or with --plan the plan's."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "metrics.jsonl")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={P}",
                   os.path.join(ROOT, "train.py"), *argv, "--metrics", metrics]
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        planned = "--plan" in argv and os.path.exists(metrics) and os.path.getsize(metrics)  # exits 1 if not fits
        if done.returncode and not planned:  # train.py's own error line, else the end of what torchrun reports
            errors = [line for line in done.stderr.splitlines() if "train.py: error:" in line]
            why = "\n".join(dict.fromkeys(errors)) or done.stderr[-2000:]  # each line once, though every rank says it
            raise SystemExit(f"harness.bench: train.py {' '.join(argv)} failed on {P} ranks:\n{why}")
        with open(metrics) as f:
            return [json.loads(line) for line in f]


def memory_(args):
    print(f"peak tensor memory per rank, MiB, measured (the last of 2 steps, busiest rank; test_memory.py holds the "
          f"trace to it); train.py --batch-size 1 --steps 2 {' '.join(args.flags)}")
    rows = [(S, extra) for S in args.seq_lens for extra in ([], ["--tiles", "4"], ["--recompute"],
                                                             ["--tiles", "4", "--recompute"])]
    print(f"{'seq len':>8} {'flags':<24}" + "".join(f"{f'sp {P}':>16}" for P in args.sp), flush=True)
    for S, extra in rows:
        cells = []
        for P in args.sp:
            argv = ["--seq-len", str(S), *extra, *args.flags]
            with measuring(f"{' '.join([f'seq len {S:,}', *extra])}: train.py on sp {P}"):
                measured = train_run(P, argv + ["--steps", "2", "--batch-size", "1"])[-1]["peak_bytes"]
            cells.append(f"{measured / 2**20:.1f}")
        print(f"{S:>8,} {' '.join(extra):<24}" + "".join(f"{cell:>16}" for cell in cells), flush=True)
    if not args.depths:  # --depths with none: the cost of measuring skipped
        return
    print("\nwhat measuring costs: train.py --n-embd 32 --steps 6 --n-layer L, one process; seconds of the measured "
          "(last) step against the median of steps 2 to 5")
    print(f"{'layers':>6} {'ordinary step s':>16} {'measured step s':>16} {'ratio':>6}", flush=True)
    for layers in args.depths:
        with measuring(f"{layers} layers: train.py, 6 steps"):
            seconds = [r["seconds"] for r in train_run(1, ["--n-embd", "32", "--steps", "6", "--n-layer", str(layers)])]
        ordinary = statistics.median(seconds[1:-1])
        print(f"{layers:>6} {ordinary:16.3f} {seconds[-1]:16.3f} {seconds[-1] / ordinary:5.1f}x", flush=True)


# ----------------------------------------------------------------------------------------------------------------
# python -m harness.bench plans: ALST's table, row for row: Llama-3-8B on 1, 8 and 32 GPUs, the longest sequence by
# the traced step (train.py --plan's trace and search), and the peaks at ALST's lengths

ALST = {1: 500_000, 8: 3_700_000, 32: 15_000_000}  # its longest sequences for Llama-8B (arXiv 2506.13996)


def alst_flags(gpus, gib, S):
    """train.py's flags for Llama-3-8B on `gpus` GPUs of `gib` GiB with ALST's settings: ZeRO-3 with the optimizer in
    CPU memory, recomputation with the block inputs in CPU memory, the MLP in tiles of about 4,096 tokens and the
    loss in tiles of 2,048 (a tile's float32 logits: 1 GiB), Ulysses over every GPU."""
    local = math.ceil(S / gpus)
    return ["--model", "llama3-8b", "--plan", f"{gpus}x{gib}", "--seq-len", str(S), "--batch-size", "1",
            "--recompute", "--offload", "--offload-optimizer", "--tiles", str(math.ceil(local / 4096)),
            "--loss-tiles", str(math.ceil(local / 2048))]


def plans(args):
    gib, settings = args.gib, " ".join(alst_flags(1, args.gib, 1)[6:-4])
    print(f"Llama-3-8B on GPUs of {gib} GiB with ALST's settings (train.py --model llama3-8b {settings}, the tiles as "
          f"S/4,096 and S/2,048 tokens per rank at ALST's S): the longest sequence by train.py --plan's search on "
          f"traced steps (within 1%; +: or more, as far as this machine traces), and at ALST's length "
          f"the traced GPU and CPU memory per GPU, GiB", flush=True)
    rows = []
    for gpus in args.gpus:
        start = time.perf_counter()
        with measuring(f"{gpus} GPUs: train.py --plan, its trace and its search"):
            plan = train_run(1, alst_flags(gpus, gib, ALST[gpus]))[0]  # --plan --metrics: one line, the plan's
        rows.append((gpus, plan["longest"]))
        print(f"{gpus:>3} GPUs: ALST {ALST[gpus]:>10,} | traced {plan['longest']:>10,}{'+' * plan['or_more']} "
              f"({time.perf_counter() - start:.0f} s) | at {ALST[gpus]:,}: {plan['peak_bytes'] / 2**30:.1f} GPU, "
              f"{plan['host_peak_bytes'] / 2**30:.1f} CPU" + " (does not fit)" * (plan["peak_bytes"] > gib * 2**30),
              flush=True)
    if args.figure:
        draw_plans(rows, gib, args.figure)


def draw_plans(rows, gib, path):
    """Longest sequence against GPU count, ours beside ALST's, as a picture (needs matplotlib; skipped without)."""
    if not (plt := pyplot("--figure")):
        return
    gpus = [g for g, _ in rows]
    series = [("ALST (reported)", "s-", [ALST[g] for g in gpus]),
              ("this project, traced (--plan)", "o-", [n for _, n in rows])]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, (label, style, tokens) in enumerate(series):
        ax.plot(gpus, tokens, style, label=label)
        for g, n in zip(gpus, tokens):
            ax.annotate(f"{n / 1e6:.2f}M", (g, n), textcoords="offset points", xytext=(6, 4 if i else -12), fontsize=8)
    ax.set(xscale="log", yscale="log", xlabel=f"GPUs of {gib} GiB (H100)", ylabel="longest sequence, tokens",
           title="Llama-3-8B: the longest sequence that trains")
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.minorticks_off()
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"picture: {path}")


# ----------------------------------------------------------------------------------------------------------------
# python -m harness.bench compile: train.py eager against --compile, the first step (which compiles) and the rest


def compile_(args):
    argv = [*args.flags, "--steps", str(args.steps)]  # --steps last: the flags' own --steps would win
    print(f"train.py {' '.join(argv)} [--compile], seconds per step on rank 0; eager and compiled alternate, "
          f"{args.runs} runs each", flush=True)
    print(f"{'P':>2} {'mode':<9} {'first step s':>13} {'later steps, median s':>22} {'later vs eager':>15}", flush=True)
    for P in args.sp:
        seconds = {"eager": [], "compiled": []}
        for _ in range(args.runs):  # interleaved, so that a busy moment of the machine hits both alike
            for mode, extra in (("eager", []), ("compiled", ["--compile"])):
                with measuring(f"P={P} {mode}: train.py, {args.steps} steps"):
                    seconds[mode].append([record["seconds"] for record in train_run(P, argv + extra)])
        eager_later = statistics.median(s for run in seconds["eager"] for s in run[1:])
        for mode, runs in seconds.items():
            later = statistics.median(s for run in runs for s in run[1:])
            first = statistics.median(run[0] for run in runs)
            print(f"{P:>2} {mode:<9} {first:13.2f} {later:22.3f} {later / eager_later:14.2f}x", flush=True)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help shows every default, and the module docstring as it is written."""


# ----------------------------------------------------------------------------------------------------------------
# python -m harness.bench ring: every way to split one attention layer over P ranks, U Ulysses ranks x R ring ranks
# (U <= heads), forward + backward, with ring.py's two block kernels (R = 1: one block): the fused one and the einsum
# tiles; on one rank also SDPA's causal kernel, called directly


def _usp_rank(rank, P, args):
    """{(U, R, kernel): (median seconds, all-to-all bytes, all-to-all calls, ring bytes, ring sends, peak bytes)} of
    this rank; every row is timed interleaved with the others."""
    splits = [(U, P // U) for U in range(P, 0, -1) if P % U == 0 and U <= args.heads]  # Ulysses alone first
    groups = {}
    for U, R in splits:  # every rank builds every group, in the same order
        mesh = init_device_mesh("cpu", (R, U), mesh_dim_names=("ring", "ulysses"))
        groups[U, R] = (mesh.get_group("ulysses"), mesh.get_group("ring"))
    layouts = [(U, R, kernel) for U, R in splits for kernel in ("fused", "einsum")] + [(1, 1, "sdpa")] * (P == 1)
    g = torch.Generator().manual_seed(rank)
    B, S, H, D = args.batch_size, args.seq_len, args.heads, args.head_dim
    tensors = [torch.randn(B, S // P, H, D, generator=g) for _ in range(3)]  # q, k, v: this rank's tokens

    def step(U, R, kernel):
        ulysses_group, ring_group = groups[U, R]
        inputs = [t.detach().requires_grad_() for t in tensors]
        attend = (ulysses.causal_attention if kernel == "sdpa" else
                  partial(ring.ring_attention, group=ring_group, layout="zigzag", fused=kernel == "fused"))
        out = ulysses.ulysses_attention(*inputs, ulysses_group, attend)
        return torch.autograd.grad(out, inputs, torch.ones_like(out))

    times = {layout: [] for layout in layouts}
    for repetition in range(args.reps + 1):  # the first is a warm-up
        for layout in layouts:
            dist.barrier()
            start = time.perf_counter()
            step(*layout)
            if repetition:
                times[layout].append(time.perf_counter() - start)
    results = {}
    for layout in layouts:
        ulysses.reset_all_to_all_stats()
        ring.reset_ring_stats()
        peak = peak_bytes(partial(step, *layout), *tensors)
        a2a, sent = ulysses.all_to_all_stats, ring.ring_stats
        total = lambda stats, key: stats["forward"][key] + stats["backward"][key]
        results[layout] = (statistics.median(times[layout]), total(a2a, "bytes"), total(a2a, "calls"),
                           total(sent, "bytes"), total(sent, "calls"), peak)
    return results


def ring_(args):
    B, S, H, D = args.batch_size, args.seq_len, args.heads, args.head_dim
    print(f"one attention layer, forward + backward: B={B} S={S} heads={H} head_dim={D} float32, causal; the median "
          f"of {args.reps}, every row of a P interleaved; rank 0's bytes, calls and peak tensor memory; "
          f"kernel: ring.py's fused block kernel, or its einsum tiles (fused=False), or SDPA alone", flush=True)
    print(f"{'P':>2} {'layout':20} {'kernel':>6} {'ms':>8} {'/ fused':>7} {'all-to-all bytes':>17} {'calls':>5} "
          f"{'ring bytes':>11} {'sends':>5} {'peak MiB':>9}", flush=True)
    for P in args.ranks:
        with measuring(f"P={P}: {args.reps + 1} repetitions of every layout and kernel"):
            layouts = run_ranks(P, _usp_rank, args)
        for (U, R, kernel), (seconds, a2a, calls, sent, sends, peak) in layouts.items():
            name = " x ".join([f"ulysses {U}"] * (U > 1) + [f"ring {R}"] * (R > 1)) or "one rank"
            print(f"{P:2} {name:20} {kernel:>6} {seconds * 1e3:8.1f} {seconds / layouts[U, R, 'fused'][0]:7.2f} "
                  f"{a2a:17,} {calls:5} {sent:11,} {sends:5} {peak / 2**20:9.1f}", flush=True)
    kv_bytes = 2 * B * S * H * D * 4  # k and v of the whole sequence, float32
    print(f"where each stops: Ulysses at P = heads = {H} ranks a sequence, its bytes per rank falling as (P-1)/P^2; "
          f"a ring never, but each rank sends (R-1)/R of the sequence's k and v twice and all their float32 "
          f"gradients once, which grows towards {kv_bytes * 3 / 2**20:,.0f} MiB per layer with R "
          f"(ring.ring_bytes); USP: Ulysses up to {H} ranks, times a ring of any R", flush=True)
    print(f"\ncausal work per ring rank, query-key pairs in the cut of each block over the R steps "
          f"(documents.ring_work), S={S}:")
    print(f"{'R':>2} {'contiguous: least':>18} {'most':>12} {'zigzag: every rank':>19}")
    for R in (R for R in (2, 4, 8) if S % (2 * R) == 0):  # zigzag's 2R chunks
        contiguous, zigzag = (documents.ring_work(R, S // R, layout) for layout in ("contiguous", "zigzag"))
        print(f"{R:2} {min(contiguous):18,} {max(contiguous):12,} {zigzag[0]:19,}" + ("" if len(set(zigzag)) == 1
                                                                                    else f" (not equal: {zigzag})"))


# ----------------------------------------------------------------------------------------------------------------
# python -m harness.bench balance: packed documents under a ring of R, each rank's share of the causal work and the
# time of one attention layer, in zigzag's layout and per document (documents.document_layout)


def long_document_mix(S, share=0.6, seed=0):
    """Position ids [1, S] of one packed row: one document of share x S tokens between short ones (8 to 119
    tokens, half of them before it)."""
    g = torch.Generator().manual_seed(seed)
    long, short = int(share * S), []
    while sum(short) < S - long:
        short.append(int(torch.randint(8, 120, (1,), generator=g)))
    short[-1] -= sum(short) - (S - long)
    lengths = short[:len(short) // 2] + [long] + short[len(short) // 2:]
    return torch.cat([torch.arange(n) for n in lengths])[None]  # (1, S)


def balance_layouts(positions, R):
    """{name: [B, R, S/R], the positions each ring rank holds} for zigzag and per-document balance."""
    B, S = positions.shape
    zigzag = torch.stack([ring.token_index("zigzag", r, R, S // R) for r in range(R)])  # (R, S/R)
    return {"zigzag": zigzag.expand(B, R, S // R), "documents": documents.document_layout(positions, R)}


def _balance_rank(rank, R, args):
    """{layout: (median seconds of the step, [each rank's median CPU seconds in it])} of one ring attention layer,
    forward + backward, over the packed mix; the two layouts timed interleaved. A rank's CPU time leaves out its
    waits for the others: what its step would take on a core of its own."""
    positions = long_document_mix(args.seq_len, args.share)  # (1, S)
    g = torch.Generator().manual_seed(0)
    B, S, H, D = 1, args.seq_len, args.heads, args.head_dim
    tensors = [torch.randn(B, S, H, D, generator=g) for _ in range(3)]  # q, k, v of the whole sequence
    layouts = {name: layout[:, rank] for name, layout in balance_layouts(positions, R).items()}  # (1, S/R) each

    def step(index):
        inputs = [t[:, index[0]].requires_grad_() for t in tensors]  # (1, S/R, H, D): my tokens
        out = ring.ring_attention(*inputs, dist.group.WORLD, index, position_ids=positions[:, index[0]])
        return torch.autograd.grad(out, inputs, torch.ones_like(out))

    times, cpu = {name: [] for name in layouts}, {name: [] for name in layouts}
    for repetition in range(args.reps + 1):  # the first is a warm-up
        for name, index in layouts.items():
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            step(index)
            mine = time.process_time() - start_cpu
            dist.barrier()  # the step of the slowest rank
            if repetition:
                times[name].append(time.perf_counter() - start)
                cpu[name].append(mine)
    every = [None] * R
    dist.all_gather_object(every, {name: statistics.median(t) for name, t in cpu.items()})
    return {name: (statistics.median(times[name]), [ranks[name] for ranks in every]) for name in layouts}


def balance(args):
    positions = long_document_mix(args.seq_len, args.share)
    print(f"one packed row of S={args.seq_len}: one document of {args.share:.0%} of the tokens, the rest 8 to 119 "
          f"tokens; each ring rank's causal work (query-key pairs its queries see, documents.document_work) as "
          f"max/mean, and one attention layer forward + backward (heads={args.heads}, head_dim={args.head_dim}, "
          f"float32, gloo on this machine's cores), the median of {args.reps}, the two layouts interleaved: the "
          f"step's time and the CPU time of the busiest rank (its waits left out)", flush=True)
    print(f"{'R':>2} {'layout':>10} {'work per rank (million pairs)':>40} {'max/mean':>9} {'step ms':>8} "
          f"{'busiest CPU ms':>15}", flush=True)
    works = {}
    for R in args.ranks:
        with measuring(f"R={R}: {args.reps + 1} repetitions of both layouts"):
            seconds = run_ranks(R, _balance_rank, args)
        for name, layout in balance_layouts(positions, R).items():
            works[R, name] = work = documents.document_work(positions, layout)
            per_rank = " ".join(f"{w / 1e6:.2f}" for w in work)
            step, cpu = seconds[name]
            print(f"{R:2} {name:>10} {per_rank:>40} {max(work) / (sum(work) / R):9.3f} {step * 1e3:8.1f} "
                  f"{max(cpu) * 1e3:15.1f}", flush=True)
    if args.picture and (plt := pyplot("--picture")):
        figure, axes = plt.subplots(1, len(args.ranks), figsize=(4 * len(args.ranks), 3), sharey=True)
        for ax, R in zip(figure.axes, args.ranks):
            for offset, name in ((-0.2, "zigzag"), (0.2, "documents")):
                work = works[R, name]
                ax.bar([r + offset for r in range(R)], [w / (sum(work) / R) for w in work], width=0.4, label=name)
            ax.axhline(1.0, color="black", linewidth=0.5)
            ax.set(title=f"ring of {R}", xlabel="ring rank", xticks=range(R))
        figure.axes[0].set_ylabel("causal work / mean")
        figure.axes[0].legend()
        figure.tight_layout()
        figure.savefig(args.picture)
        print(f"picture: {args.picture}")


# ----------------------------------------------------------------------------------------------------------------
# python -m harness.bench gpu: on one CUDA GPU, the attention kernels and the gated delta rule beside their fast peers


def gpu(args):
    """The ring's block kernel (ring_attention without a group) and ulysses_attention without a group, against SDPA's
    causal kernel, forward and backward; the chunked gated delta rule's forward against FLA's Triton kernel (the
    fla-core package), outputs compared. Medians of --reps, timed with CUDA events."""
    if not torch.cuda.is_available():
        raise SystemExit("harness.bench gpu: needs a CUDA GPU; this machine has none")

    def milliseconds(run):
        run()
        times = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; bf16, B 1, 16 query and 4 kv heads of 128; "
          f"forward + backward; median of {args.reps}", flush=True)
    for S in args.seq_lens:
        q = torch.randn(1, S, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(1, S, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        sdpa = lambda q, k, v: F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True,
                                                              enable_gqa=True).transpose(1, 2)
        grad_out = torch.randn_like(q)
        times = [milliseconds(lambda: attend(q, k, v).backward(grad_out))
                 for attend in (sdpa, ring.ring_attention, ulysses.ulysses_attention)]
        print(f"S {S:6}: SDPA {times[0]:7.2f} ms ({7 * S * S * 16 * 128 / times[0] / 1e9:.0f} TFLOP/s)   "
              f"ring_attention {times[1]:7.2f} ms ({times[1] / times[0]:.2f}x)   ulysses_attention "
              f"{times[2]:7.2f} ms ({times[2] / times[0]:.2f}x)", flush=True)
    if args.profile:
        profile_step(args.profile, milliseconds)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        print("the gated delta rule against FLA: install fla-core to compare")
        return
    print("gated delta rule, forward: H 16, Dk = Dv = 128; ours in float32, FLA's in bf16", flush=True)
    with torch.no_grad():
        for S in args.seq_lens:
            q, k = (F.normalize(torch.randn(1, S, 16, 128, device="cuda"), dim=-1) for _ in range(2))
            v = torch.randn(1, S, 16, 128, device="cuda")
            g = -F.softplus(torch.randn(1, S, 16, device="cuda")) / 10  # log decays
            beta = torch.rand(1, S, 16, device="cuda").sigmoid()
            theirs = lambda: chunk_gated_delta_rule(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta)[0]
            ours = lambda: gdn.chunk_gated_delta_rule(q, k, v, g, beta)
            difference = (theirs().float() - ours()).norm() / ours().norm()
            print(f"S {S:6}: ours {milliseconds(ours):7.2f} ms   FLA {milliseconds(theirs):6.2f} ms   outputs "
                  f"{difference:.1e} apart (relative)", flush=True)


def profile_step(S, milliseconds):
    """One training step of README's 0.7B model (16 layers, n_embd 2048, 16 query and 4 kv heads, vocab 256) at S
    tokens, bf16, each block compiled as train.py --compile does, under torch.profiler: its time, and the kernels that
    take it, by GPU time. FLOPs as BENCHMARKS.md's throughput table counts them (6 x parameters + 12 x layers x S x
    n_embd a token, attention in full), and with the causal half of attention's."""
    from torch.profiler import ProfilerActivity, profile
    cfg = gpt.GPTConfig(n_layer=16, n_embd=2048, n_head=16, n_kv_head=4)
    model = gpt.GPT(cfg).cuda()
    for block in model.blocks:
        block.forward = torch.compile(block.forward)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    idx = torch.randint(0, cfg.vocab_size, (1, S), device="cuda")
    positions = torch.arange(S, device="cuda")[None]  # (1, S)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_sum, _ = model(idx, positions, idx)
        (loss_sum / S).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for _ in range(2):  # compiles
        step()
    seconds = milliseconds(step) / 1e3
    n = sum(p.numel() for p in model.parameters())
    full = (6 * n + 12 * cfg.n_layer * S * cfg.n_embd) * S
    half = full - 6 * cfg.n_layer * S * cfg.n_embd * S
    print(f"\n0.7B model, S {S}, compiled, one step: {seconds * 1e3:.1f} ms, {S / seconds:,.0f} tokens/s, MFU "
          f"{half / seconds / 989e12:.1%} (causal attention at half), {full / seconds / 989e12:.1%} (in full), "
          f"against 989 TFLOP/s", flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in kernels)
    kinds = {"attention (cuDNN)": "sdpa|attention|flash", "matmuls (cuBLAS)": "nvjet|gemm|cutlass|xmma",
             "the rest": ""}
    shares = dict.fromkeys(kinds, 0.0)
    for e in kernels:
        shares[next(kind for kind, names in kinds.items() if re.search(names, e.key))] += e.self_device_time_total
    print(f"GPU time {total / 1e3:.1f} ms: " + ", ".join(f"{kind} {t / total:.0%}" for kind, t in shares.items()))
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:10]:
        print(f"{e.self_device_time_total / 1e3:8.1f} ms {e.self_device_time_total / total:6.1%} x{e.count:<4} "
              f"{e.key[:100]}", flush=True)


def pyplot(flag):
    """matplotlib's pyplot, drawing to files; None, with a line that says so, where matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        print(f"{flag}: matplotlib is not installed, so no picture; the tables above are the figures")
        return None


def at_least(least):
    """argparse's type of a count flag: an int not below `least`, else one line naming the value."""
    def count(text):
        if int(text) < least:  # not an int at all: argparse's "invalid count value"
            raise argparse.ArgumentTypeError(f"{text}: must be at least {least}")
        return int(text)
    return count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter, allow_abbrev=False)
    subparsers = parser.add_subparsers(dest="command", required=True)
    command = lambda name, help: subparsers.add_parser(name, help=help, formatter_class=_HelpFormatter,
                                                       allow_abbrev=False)
    p = command("attention", "one Ulysses attention layer against its alternatives")
    p.add_argument("--seq-len", type=at_least(1), default=4096, help="tokens per sequence for the main table")
    p.add_argument("--weak-seq-len", type=at_least(0), default=1024, help="tokens per rank in the weak-scaling rows "
                   "(0: none)")
    p.add_argument("--sp", type=at_least(2), nargs="+", default=[2, 4], help="SP sizes of the main table")
    p.add_argument("--heads", type=at_least(1), default=8, help="query heads")
    p.add_argument("--kv-heads", type=at_least(0), default=0, help="key/value heads; 0: as many as --heads")
    p.add_argument("--head-dim", type=at_least(1), default=64, help="dimensions per head")
    p.add_argument("--batch-size", type=at_least(1), default=1, help="sequences")
    p.add_argument("--reps", type=at_least(2), default=25, help="timed repetitions (after one warm-up; 2 at least: "
                   "the table gives the quartiles of the overhead)")
    p.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True, help="measure peak memory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="of every tensor but RoPE's "
                   "tables")
    p.add_argument("--kernel", choices=list(KERNELS), default="sdpa", help="sdpa: causal attention; copy: a kernel "
                   "that only copies q, to time the exchange alone ((d) left out)")
    p.add_argument("--plot", metavar="FILE", help="also draw the weak-scaling bytes and each variant's copies and "
                   "peak memory into FILE (a .png; needs matplotlib)")
    p.add_argument("--versus", metavar="FILE", help="also time (b) as another copy of ulysses.py runs it (another "
                   "checkout's), interleaved with the rest in the same processes")
    p.add_argument("--check-cost", action="store_true", help="instead: ulysses_attention with its input check "
                   "(one all-gather a call) against without it")
    p = command("tiled", "memory of the MLP and the loss, tiled and not")
    p.add_argument("--seq-len", type=at_least(1), default=16384, help="tokens")
    p.add_argument("--hidden", type=at_least(1), default=128, help="hidden size h (the MLP's is 4h)")
    p.add_argument("--vocab", type=at_least(1), default=2048, help="vocabulary of the loss")
    p = command("deltanet", "the gated delta rule, chunked against the recurrence; "
                            "the layer under SP, Ulysses against context")
    p.add_argument("--seq-len", type=at_least(1), default=4096, help="tokens")
    p.add_argument("--heads", type=at_least(1), default=4, help="heads")
    p.add_argument("--head-dim", type=at_least(1), default=64, help="dimensions per head")
    p.add_argument("--reps", type=at_least(1), default=3, help="timed repetitions")
    p.add_argument("--seq-lens", type=at_least(1), nargs="+", default=[1024, 4096, 16384], help="the layer under SP: "
                   "sequence lengths, one row each (P = 2 and 4)")
    p = command("memory", "train.py's measured peak memory per rank, and what measuring costs")
    p.add_argument("--seq-lens", type=at_least(1), nargs="+", default=[1024, 4096], help="sequence lengths, one row "
                   "each")
    p.add_argument("--sp", type=at_least(1), nargs="+", default=[1, 2, 4], help="SP sizes, one column each")
    p.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="more train.py flags, last on the line, "
                   "e.g. --flags --layer-pattern ddda")
    p.add_argument("--depths", type=at_least(1), nargs="*", default=[2, 50, 200], help="layer counts of a tiny model "
                   "whose measured step is timed against an ordinary one (none: skip)")
    p = command("plans", "ALST's table: Llama-3-8B's longest sequence on 1, 8 and 32 GPUs, by the traced step")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 8, 32], choices=sorted(ALST), help="GPU counts, a row "
                   "each")
    p.add_argument("--gib", type=at_least(1), default=80, help="memory of a GPU")
    p.add_argument("--figure", metavar="FILE", help="also draw the table into FILE (a .png; needs matplotlib)")
    p = command("compile", "train.py eager against --compile: compile time and step time")
    p.add_argument("--sp", type=at_least(1), nargs="+", default=[2, 4], help="ranks (all sequence-parallel), one row "
                   "pair each")
    p.add_argument("--steps", type=at_least(2), default=30, help="steps of each run (2 at least: the first compiles)")
    p.add_argument("--runs", type=at_least(1), default=2, help="runs of each mode")
    p.add_argument("--flags", nargs=argparse.REMAINDER, default=[], help="more train.py flags, last on the line")
    p = command("ring", "Ulysses, ring and Ulysses x Ring on the same ranks; work per rank")
    p.add_argument("--seq-len", type=at_least(1), default=4096, help="tokens per sequence")
    p.add_argument("--ranks", type=at_least(1), nargs="+", default=[1, 2, 4], help="numbers of ranks P, one block of "
                   "rows each")
    p.add_argument("--heads", type=at_least(1), default=8, help="query heads (= key/value heads)")
    p.add_argument("--head-dim", type=at_least(1), default=64, help="dimensions per head")
    p.add_argument("--batch-size", type=at_least(1), default=1, help="sequences")
    p.add_argument("--reps", type=at_least(1), default=5, help="timed repetitions (after one warm-up)")
    p = command("balance", "packed documents under a ring: work per rank and step time, zigzag against per document")
    p.add_argument("--seq-len", type=at_least(1), default=4096, help="tokens of the packed row")
    p.add_argument("--share", type=float, default=0.6, help="the long document's share of the tokens, above 0, "
                   "below 1")
    p.add_argument("--ranks", type=at_least(1), nargs="+", default=[2, 4], help="ring sizes R, one pair of rows each")
    p.add_argument("--heads", type=at_least(1), default=8, help="query heads (= key/value heads)")
    p.add_argument("--head-dim", type=at_least(1), default=64, help="dimensions per head")
    p.add_argument("--reps", type=at_least(1), default=5, help="timed repetitions (after one warm-up)")
    p.add_argument("--picture", help="also draw each rank's work into this image file (matplotlib)")
    p = command("gpu", "on a CUDA GPU: the attention kernels and the gated delta rule beside their fast peers")
    p.add_argument("--seq-lens", type=at_least(1), nargs="+", default=[8192, 32768], help="tokens, one row each")
    p.add_argument("--reps", type=at_least(1), default=5, help="timed repetitions (after one warm-up)")
    p.add_argument("--profile", type=at_least(1), metavar="S", help="also one training step of a 0.7B model at S "
                   "tokens, compiled, under torch.profiler: its MFU and the kernels that take its time")
    args = parser.parse_args(argv)
    if args.command in ("ring", "balance") and any(args.seq_len % (2 * P) for P in args.ranks):
        parser.error(f"--seq-len {args.seq_len}: must be a multiple of 2 x every P in --ranks (the zigzag chunks)")
    if args.command == "balance" and not 0 < args.share < 1:
        parser.error(f"--share {args.share}: must be above 0 and below 1 (short documents fill the rest)")
    if args.command == "attention":
        args.kv_heads = args.kv_heads or args.heads
        if args.heads % args.kv_heads:
            parser.error(f"--kv-heads {args.kv_heads}: must divide --heads {args.heads} (0: as many as --heads)")
        for P in args.sp:
            if args.heads % P or args.kv_heads % P:
                parser.error(f"--sp {P}: must divide --heads {args.heads} and --kv-heads {args.kv_heads} ((c) splits "
                             f"the heads evenly)")
            if args.seq_len % P:
                parser.error(f"--seq-len {args.seq_len}: must be a multiple of every P in --sp, {P} too (a rank "
                             f"holds S/P tokens)")
        if args.check_cost and (args.plot or args.versus):  # its own table alone, of one variant
            parser.error("--check-cost measures the input check alone: it draws no --plot and times no --versus")
        if args.weak_seq_len and not args.check_cost and (args.heads % 4 or args.kv_heads % 4):
            parser.error(f"--heads {args.heads} and --kv-heads {args.kv_heads}: the weak-scaling rows run on 2 and 4 "
                         f"ranks, so 4 must divide both; or --weak-seq-len 0 for none")
    if args.command == "deltanet":  # the layer runs on 2 and 4 ranks
        if any(S % 4 for S in args.seq_lens):
            parser.error(f"--seq-lens {' '.join(map(str, args.seq_lens))}: each must be a multiple of 4 (the layer "
                         f"runs on P = 2 and 4)")
        if args.heads % 2 or args.heads < 4:
            parser.error(f"--heads {args.heads}: choose an even count of 4 or more (H/2 key heads, each for 2 value "
                         f"heads, over up to 4 ranks)")
        if args.head_dim % 2:
            parser.error(f"--head-dim {args.head_dim}: must be even (the layer's GPTConfig takes heads of even size)")
    for flag in ("plot", "figure", "picture"):  # before minutes of measuring
        folder = os.path.dirname(os.path.abspath(getattr(args, flag, None) or "."))
        if getattr(args, flag, None) and not os.path.isdir(folder):
            parser.error(f"--{flag} {getattr(args, flag)}: there is no folder {folder} to write it into")
    if getattr(args, "versus", None):
        try:
            with open(args.versus, errors="replace") as f:
                found = "def ulysses_attention(" in f.read()
        except OSError as e:
            parser.error(f"--versus {args.versus}: {e.strerror}")
        if not found:
            parser.error(f"--versus {args.versus}: defines no ulysses_attention; give another copy of ulysses.py")
    measure = {"attention": attention, "tiled": tiled, "deltanet": deltanet, "memory": memory_, "plans": plans,
               "compile": compile_, "ring": ring_, "balance": balance, "gpu": gpu}
    measure[args.command](args)


if __name__ == "__main__":
    main()
