"""
Memory, one model of it, the code itself: what one rank held in a training step, measured (PeakMemory: on CPU the
storages alive, counted op by op, StorageBytes), and what it will hold at a scale this machine cannot run, traced
(`planned`: train.py's real step on fake tensors, shapes without storage, in one process with a fake process group of
N ranks, counted as a measured step is). --plan NxG prints the traced peak and the longest sequence that fits; a CUDA
run is traced before it starts and refused if it would not fit. On CPU the trace equals the measured peak to the byte
in every configuration measured (the tests hold it within 1%).
"""

import argparse
import json
import math
import os
import re
import resource
import sys
import time
import weakref
from contextlib import contextmanager, nullcontext, suppress
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._library.custom_ops import _maybe_get_opdef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import ulysses
from harness.fakes import FakeTensors, as_on_cuda, peers, works_hold_tensors
from harness.launch import check_args, check_metrics, device_mesh, fail, local_gpu, read_data


def local_tokens(args):
    """This rank's tokens per micro-step: batch_size * S_pad/sp, S padded to a multiple of sp (of 2 sp with a ring)."""
    multiple = args.sp * (2 if args.ring > 1 else 1)
    return args.batch_size * math.ceil(args.seq_len / multiple) * multiple // args.sp


# ----------------------------------------------------------------------------------------------------------------
# the measured peak


class PeakMemory:
    """The peak tensor memory of one training step, in bytes, the largest over the ranks (`.bytes`): on CUDA
    torch.cuda.max_memory_allocated, on CPU StorageBytes; on CUDA with host=True (--offload, --offload-optimizer) also
    the host's (`.host_bytes`, by StorageBytes; else None). Only the measured step pays for the counting."""

    def __init__(self, model, optimizer, zero, device, host=False):
        self.model, self.optimizer, self.zero, self.device = model, optimizer, zero, device
        self.host = host and device.type == "cuda"
        self.bytes = self.host_bytes = None

    def existing(self):
        """The tensors made before the step that it may hold: the model's, the optimizer's parameters (under ZeRO-3
        its shards) and their gradients, AdamW's moments, ZeRO-3's gathered units and host buffers."""
        optimized = [p for group in self.optimizer.param_groups for p in group["params"]]
        units = self.zero.units if self.zero else []
        return [*self.model.parameters(), *self.model.buffers(), *optimized,
                *(p.grad for p in [*self.model.parameters(), *optimized] if p.grad is not None),
                *(t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)),
                *(unit.full for unit in units), *(unit.staging for unit in units if unit.staging is not None)]

    @contextmanager
    def measure(self):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        counting = not cuda or self.host  # on a GPU without offloads, nothing to count: the step runs as any other
        with (StorageBytes(self.existing(), inside_operators=True, host="cpu" if cuda else None) if counting
              else nullcontext()) as counter:
            yield
        peaks = torch.tensor([float(torch.cuda.max_memory_allocated(self.device) if cuda else counter.peak),
                              float(counter.host_peak if self.host else 0)], device=self.device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        self.bytes, host = (int(b) for b in peaks.tolist())
        self.host_bytes = host if self.host else None


class StorageBytes(TorchDispatchMode):
    """Counts the bytes of tensor storage alive while it is entered, and keeps the largest count (`.peak`). Every
    op's outputs pass through it: a storage it has not seen adds its bytes, and gives them back when it is freed
    (a finalizer); `existing` tensors count from the start. ZeRO-3 frees and refills its gathered units by resizing
    their storage, which no op shows: UntypedStorage.resize_ is watched. host: a device type ("cpu" beside a GPU)
    counted apart (`.host_peak`). An operator written in Python (the exchange, the ring) is one op to a dispatch
    mode; inside_operators=True runs its body under the count, so that its own buffers count. A collective's own
    buffers do not: gloo's reduce-scatter copies its input where no op shows it, and splits the copy."""

    def __init__(self, existing, inside_operators=False, host=None):
        super().__init__()
        self.inside_operators, self.host = inside_operators, host
        self.sizes = WeakIdKeyDictionary()  # storage -> [its bytes, as counted; "host" or "device"]
        self.finalizers, self.alive, self.peaks = [], {"device": 0, "host": 0}, {"device": 0, "host": 0}
        self.depth = 0  # an operator's body, counted inside the count, enters it again
        self.propagating = 0  # inside DTensor's sharding propagation: uncounted
        from torch.distributed.tensor import DTensor  # imported here: 0.7 s that a run ending at its flags skips
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
        self.DTensor, self.ShardingPropagator = DTensor, ShardingPropagator
        for t in existing:
            self._see(t)

    now = property(lambda self: self.alive["device"])
    peak = property(lambda self: self.peaks["device"])
    host_peak = property(lambda self: self.peaks["host"])

    def _see(self, t):
        t = t.to_local() if isinstance(t, self.DTensor) else t
        storage = t.untyped_storage()
        if storage not in self.sizes:  # (a fake tensor's storage is on the meta device, whatever the tensor's)
            self.sizes[storage] = size = [0, "host" if t.device.type == self.host else "device"]
            self.finalizers.append(weakref.finalize(storage, self._grow, size, None))
            self._grow(size, storage.nbytes())

    def _grow(self, size, nbytes):  # nbytes None: freed
        nbytes = -size[0] if nbytes is None else nbytes
        size[0] += nbytes
        self.alive[size[1]] += nbytes
        self.peaks[size[1]] = max(self.peaks[size[1]], self.alive[size[1]])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.DTensor in types:
            return NotImplemented  # DTensor runs first, and its local ops come through here
        if self.propagating:  # what DTensor makes to learn an op's output shape: no memory of a step
            return func(*args, **(kwargs or {}))
        custom = _maybe_get_opdef(func) if self.inside_operators else None
        if custom is not None:  # an operator written in Python: its body runs under the count
            with self:
                out = custom._init_fn(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.split.Tensor and args[0].untyped_storage() not in self.sizes:
            return out  # gloo's reduce-scatter splits a copy of its input that no op showed (NCCL makes none)
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and (t.device.type != "meta" or self.host == "meta"):  # a trace's host
                self._see(t)
        return out

    def __enter__(self):
        self.depth += 1
        if self.depth == 1:  # the count starts: watch resizes
            resize = self.resize = torch.UntypedStorage.resize_

            def counted_resize(storage, nbytes):
                resize(storage, nbytes)
                if storage in self.sizes:
                    self._grow(self.sizes[storage], storage.nbytes() - self.sizes[storage][0])
            torch.UntypedStorage.resize_ = counted_resize
            # DTensor (FSDP2) learns each new op's output shape on fake copies of its inputs at their global size,
            # once per shape: a trace that met the shapes before would count less. None counts
            propagate = self.propagate = self.ShardingPropagator._propagate_tensor_meta_non_cached

            def uncounted(*args, **kwargs):
                self.propagating += 1
                try:
                    return propagate(*args, **kwargs)
                finally:
                    self.propagating -= 1
            self.ShardingPropagator._propagate_tensor_meta_non_cached = uncounted
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:  # the count ends: no storage freed from now on changes it
            torch.UntypedStorage.resize_ = self.resize
            self.ShardingPropagator._propagate_tensor_meta_non_cached = self.propagate
            for finalizer in self.finalizers:
                finalizer.detach()
        return super().__exit__(*exc)


# ----------------------------------------------------------------------------------------------------------------
# the trace: the real step at the planned scale, on fake tensors


def planned(args, world_size, build, cuda=True, **changed):
    """This run's peak per rank (some flags changed), traced: {"device", "host" (bytes), "rank", "ranks", "seconds",
    "how"}: the largest of the ranks `traced_ranks` names, "rank" the one with the largest device peak. Past four
    periods of --layer-pattern it traces r + 3 and r + 4 periods (r: the layers of a period begun), so that every
    segment of `in_segments`, a middle block's too, is in both, and extends each segment's peak along its line to the
    run's depth: test_memory.py holds that equal to the full depth's trace, to the byte. --compile is traced eager."""
    args = argparse.Namespace(**{**vars(args), **changed, "compile": False})
    start, period = time.perf_counter(), len(args.layer_pattern)
    rest, periods, peaks = args.n_layer % period, args.n_layer // period, []
    for rank in traced_ranks(args, world_size):
        if periods <= 4:
            peak, how = trace(args, world_size, build, cuda, rank), f"{args.n_layer} layer{'s' * (args.n_layer > 1)}"
        else:
            three, four = (trace(argparse.Namespace(**{**vars(args), "n_layer": rest + k * period}), world_size, build,
                                 cuda, rank)["segments"] for k in (3, 4))
            peak = {key: max(three[s][key] + (periods - 3) * (four[s][key] - three[s][key])
                             for s in three.keys() & four.keys()) for key in ("device", "host")}
            how = f"{rest + 3 * period} and {rest + 4 * period} layers, extended to {args.n_layer}"
        peaks.append({"device": peak["device"], "host": peak["host"], "rank": rank})
    return {**max(peaks, key=lambda peak: peak["device"]), "host": max(peak["host"] for peak in peaks),
            "ranks": len(peaks), "seconds": time.perf_counter() - start, "how": how}


def trace(args, world_size, build, cuda, rank=None):
    """One training step's peak on one rank of `world_size` (None: the first `traced_ranks` names): {"device", "host"
    (bytes), "segments"}. build: train.py's (model, sharding, optimizer). The step is a run's measured one, its last,
    which finds AdamW's state made; the fake process group moves nothing. cuda: as on a GPU (`as_on_cuda`), host
    memory the meta device, counted apart."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    # packed --data: its own documents, whose lengths set attention's memory; unpacked text is S tokens of one
    # document at any S, the copy task's memory (plan checks that the file holds the run's own sequences)
    documents = read_data(args) if args.pack else None
    rank = traced_ranks(args, world_size)[0] if rank is None else rank
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh, host = device_mesh(args, world_size, "cpu"), torch.device("meta" if cuda else "cpu")
        with FakeTensors(), peers(mesh) if args.pack else nullcontext(), works_hold_tensors(), \
                as_on_cuda() if cuda else nullcontext():
            model, zero, optimizer, _, train_on = build(args, world_size, mesh, torch.device("cpu"), host)
            if args.steps > 1:  # AdamW's state, made by a step on zero gradients
                for p in (p for group in optimizer.param_groups for p in group["params"]):
                    p.grad = torch.zeros_like(p)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            existing = PeakMemory(model, optimizer, zero, torch.device("cpu")).existing  # a list held no longer
            with StorageBytes(existing(), inside_operators=True, host=host.type if cuda else None) as counter:
                mark, segments = in_segments(counter, model, optimizer, len(args.layer_pattern))
                train_on(args.steps - 1, documents)
                mark("end")
    finally:
        dist.destroy_process_group()
    return {key: max(peaks[key] for peaks in segments.values()) for key in ("device", "host")} | {"segments": segments}


def in_segments(counter, model, optimizer, period):
    """(mark, peaks): the step's peaks by segment, {(what, block): {"device", "host"}}, each segment begun by a block's
    forward, recomputation or backward, or the optimizer's step; a block of the first period named by its index, of
    the last counted from the end (-1 the last), any other ("middle", its place in the period): the largest of their
    peaks. mark(label) ends a segment and begins the next."""
    peaks, running, blocks = {}, ["start", "forward"], len(model.blocks)  # the segment, and forward or recompute
    where = lambda i: i if i < period else i - blocks if i >= blocks - period else ("middle", i % period)

    def mark(label, *_):
        before = peaks.setdefault(running[0], {"device": 0, "host": 0})
        before.update({key: max(before[key], counter.peaks[key]) for key in before})
        counter.peaks.update(counter.alive)  # the new segment's peak starts from what is alive
        running[0] = label
        running[1] = "recompute" if isinstance(label, tuple) and label[0] == "backward" else running[1]
    def backward_begins(i, module, inputs, out):  # once the gradient of block i's output arrives
        if out.requires_grad:
            out.register_hook(lambda grad: mark(("backward", where(i))))
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda *_, i=i: mark((running[1], where(i))))
        block.register_forward_hook(partial(backward_begins, i))
    optimizer.register_step_pre_hook(lambda *_: mark("step"))
    return mark, peaks


def traced_ranks(args, world_size):
    """The ranks traced: the busiest Ulysses rank (its attention kernel gets the most heads: query heads and the kv
    heads it expands to) of the first Ulysses group, and of every other whose work can differ. Every rank holds as
    many tokens, and zigzag evens a causal ring; but a window cuts each ring rank's blocks by their distance, and
    packed documents differ by ring rank (its share of them) and by data group (its own samples, the traced step's)."""
    U, R, busiest, attention = args.sp // args.ring, args.ring, 0, "a" in args.layer_pattern
    if attention:
        query = ulysses.head_layout(args.n_head, args.n_kv_head, U)[0]
        heads = [len(query[r]) + 2 * len(ulysses.kernel_kv_heads(args.n_head, args.n_kv_head, U, r)) for r in range(U)]
        busiest = heads.index(max(heads))
    mesh = torch.arange(world_size).view(-1, R, U)  # (dp, ring, ulysses): the ranks, as launch.device_mesh lays them
    rings = range(R if args.pack or args.window and attention else 1)
    return [mesh[d, r, busiest].item() for d in range(len(mesh) if args.pack else 1) for r in rings]


# ----------------------------------------------------------------------------------------------------------------
# the plan: --plan NxG, and the fit check of a GPU run


TOLERANCE = 0.01  # the search for the longest sequence stops this close to it


def plan(args, build):
    """--plan NxGIB: this run's traced peak per GPU on N GPUs of GIB GiB, and the longest sequence that fits, without
    running it. True if it fits; SystemExit(1), after its lines, if not."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        fail(f"--plan traces every GPU it names in one process: run python train.py --plan {args.plan}, not torchrun")
    given = re.fullmatch(r"(\d+)x(\d*\.?\d+)", args.plan.lower())
    if not given or not 1 <= int(given[1]) <= 2**20 or not 0 < float(given[2]) <= 2**20:
        fail(f"--plan {args.plan}: write it as GPUSxGIB, 1 to 1,048,576 GPUs of more than 0 and at most 1,048,576 "
             f"GiB, e.g. 8x80 for 8 GPUs of 80 GiB")
    world_size, memory = int(given[1]), float(given[2]) * 2**30
    check_args(args, world_size)
    read_data(args)  # the run's own --data, before a trace of minutes; so is --metrics
    if args.metrics:
        check_metrics(args.metrics)
    held_before = peak_resident_bytes()
    here = planned(args, world_size, build)
    fits, usp = here["device"] <= memory, f" (ulysses {args.sp // args.ring} x ring {args.ring})" * (args.ring > 1)
    eager = "; eager, as --compile is not traced" * args.compile
    several = here["ranks"] > 1  # ranks whose work differs: the GPU peak of the busiest, the most CPU memory of any
    busiest = f", the busiest of {here['ranks']} whose work differs (CPU memory: the most of theirs)" * several
    print(f"plan: {world_size} GPU{'s' * (world_size > 1)}, sp {args.sp}{usp}, seq {args.seq_len:,}: "
          f"{'fits' if fits else 'does NOT fit'}: {size(here['device'])} of {size(memory)} per GPU for "
          f"{local_tokens(args):,} tokens per rank, and {size(here['host'])} of CPU memory per GPU (the step traced on "
          f"fake tensors, rank {here['rank']}{busiest}, {here['how']}, {here['seconds']:.0f} s{eager})", flush=True)
    start, traces = time.perf_counter(), {args.seq_len: here}
    trace = lambda S: traces.get(S) or traces.setdefault(S, planned(args, world_size, build, seq_len=S))
    n = longest(lambda S: trace(S)["device"], args.seq_len, memory, TOLERANCE, args.sp,
                lambda longest_traced: traceable(held_before, traces))
    short = bool(n) and not any(S <= n * (1 + TOLERANCE) + 1 for S, t in traces.items() if t["device"] > memory)
    how = "a longer one's trace would take too long, or 2/3 of the free memory" if short else f"within {TOLERANCE:.0%}"
    print(f"longest sequence that fits: {f'{n:,} tokens' + ' or more' * short if n else 'none'} ({how}; the search "
          f"traced for {time.perf_counter() - start:.0f} s)")
    if args.metrics:  # the plan as one JSON line, for a script to read (python -m harness.bench plans)
        with open(args.metrics, "a") as f:
            f.write(json.dumps({"peak_bytes": here["device"], "host_peak_bytes": here["host"], "longest": n,
                                "or_more": short}) + "\n")
    if not fits:
        raise SystemExit(1)
    return fits


def longest(peak, S, memory, tolerance, least=1, most=lambda longest_seen: math.inf):
    """The longest sequence S >= least with peak(S) <= memory, within `tolerance` (0 if none), from a first guess S.
    A peak grows about linearly with S: each next S is where the line through the last two traces meets `memory`
    (doubled or halved until there are two), inside what is known and a third of the tolerance past the side unseen,
    and at most most(the longest S seen so far): the search ends where the longest S that fits reaches it."""
    lo, hi, seen = 0, math.inf, []  # lo fits (0: none yet), hi does not
    while hi - lo > 1 and (hi > lo * (1 + tolerance) if lo else hi > least):  # none fits yet: try down to least
        seen.append((S, peak(S)))
        lo, hi = (S, hi) if seen[-1][1] <= memory else (lo, S)
        (a, pa), (b, pb) = seen[-2:] if len(seen) > 1 and seen[-1][1] != seen[-2][1] else ((0, 0), (0, 0))
        guess = b + (memory - pb) * (b - a) / (pb - pa) if b else 2 * S if lo == S else S / 2
        guess *= 1 - tolerance / 3 if lo == 0 else 1 + tolerance / 3 if hi == math.inf else 1
        guess = min(guess, hi / (1 + tolerance / 3))
        S = min(max(round(guess), math.ceil(lo * (1 + tolerance / 3)), lo + 1, least), hi - 1)
        if lo and S > (limit := most(max(s for s, _ in seen))):  # (none fits yet: shorter traces cost less)
            if lo >= limit / (1 + tolerance / 3):  # no step of a third of the tolerance left below it
                break
            S = limit
    return lo


def traceable(held_before, traces, growth=8, minute=60):
    """The longest sequence this process may trace next, by what the traces so far took (traces: {S: planned's dict},
    the first traced first): `growth` times the longest traced; one whose trace takes 2/3 of the memory the machine
    has free, at the bytes a token took in the longest trace (its token data is real: B x S ids, labels and positions
    and their copies, so 10^9 tokens would take more than a laptop has); and one whose trace takes a minute, or twice
    the first trace's time if longer, on the line through the two longest traces' times (through 0 while there is one:
    Gated DeltaNet's chunk loop runs op by op, so its time grows with S; attention's barely does).
    held_before: this process's peak resident bytes before the first trace."""
    (a, ta), (b, tb) = ([(0, 0.0)] + sorted((S, t["seconds"]) for S, t in traces.items()))[-2:]
    budget = max(minute, 2 * next(iter(traces.values()))["seconds"])
    by_time = b + (budget - tb) * (b - a) / (tb - ta) if tb > ta else math.inf
    took = peak_resident_bytes() - held_before  # the largest trace's, about
    return int(min(growth * b, b * free_memory() * 2 / 3 / max(took, 2**20), by_time))


def peak_resident_bytes():  # this process's largest resident set so far (ru_maxrss: KiB on Linux, bytes on macOS)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def free_memory(root="/"):
    """The bytes free for a trace: Linux's MemAvailable, within the memory limits of this process's cgroup and of the
    cgroup at the root of /sys/fs/cgroup (a container's), version 2 or 1, where they set one; inf where none of this
    is found (no bound by memory). root: where to look, for tests."""
    read = lambda path: Path(root, path).read_text()
    free, own = math.inf, {"": "/", "memory": "/"}  # this process's cgroup: version 2's, version 1's memory one
    with suppress(OSError, StopIteration, ValueError):
        free = next(int(line.split()[1]) * 1024 for line in read("proc/meminfo").splitlines()
                    if line.startswith("MemAvailable:"))
    with suppress(OSError, ValueError):
        own.update(line.split(":", 2)[1:] for line in read("proc/self/cgroup").splitlines())  # "0::/a", "4:memory:/b"
    for folder, limit, used in (("", "memory.max", "memory.current"),
                                ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes")):
        for where in {Path("sys/fs/cgroup", folder), Path("sys/fs/cgroup", folder, own[folder].lstrip("/"))}:
            with suppress(OSError, ValueError):  # no such file, or "max": no limit
                free = min(free, int(read(where / limit)) - int(read(where / used)))
    return free


def check(args, build):
    """A CUDA run's fit check, before any process group (a trace makes its own): its step traced, and one line if the
    ranks that share this rank's GPU (--backend gloo lets several) would need more than its free memory. Returns the
    trace; None, not traced, on CPU (a CPU run starts at once) and inside a caller's own process group."""
    if args.device != "cuda" or dist.is_initialized():
        return None
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    check_args(args, world_size)
    traced = planned(args, world_size, build)
    gpu, sharing = local_gpu(args)
    free = torch.cuda.mem_get_info(gpu)[0]
    if sharing * traced["device"] > free:
        fail(f"this run would need {size(traced['device'])} per rank, {local_tokens(args):,} tokens on each (its step "
             f"traced on fake tensors), {sharing} rank(s) on GPU {gpu}, against {size(free)} free there; --plan "
             f"{world_size}x{math.floor(free / sharing / 2**30 * 10) / 10:g} finds the longest sequence that fits",
             alike=False)
    return traced


def size(n):  # bytes: GiB to a tenth, under 1 GiB MiB
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
