"""
Memory: what one rank will hold in a training step, predicted before anything is allocated, what it held,
measured, and what it would hold at a scale this machine cannot run, traced.

A rank's peak is its model state plus the larger of two things that never coexist: the activations autograd
keeps until backward (with the backward's own working set on top), and the optimizer step's gradients and
temporaries. Backward frees a layer's activations as it makes the layer's gradients, so the two peak apart: the
activations as backward starts (or, when recomputation leaves little to free, as it ends, beside the gradients
already made), the gradients at the step.

    peak = state + max(activations, step)
    state        ZeRO-3: 12 bytes a parameter / N ranks (float32 param, two AdamW moments), plus two gathered
                 units in the compute dtype; unsharded: 12 bytes a parameter; --offload-optimizer: in CPU memory
    activations  per local token (S/P of them): what each layer keeps for backward, counted tensor by tensor,
                 plus the largest backward working set (the head's logits, or one block's)
    step         the float32 gradients and AdamW's float32 temporaries, the size of this rank's shard
    host         CPU memory: the block inputs --offload keeps there, and what --offload-optimizer does

`predict_memory` builds the model on the meta device (shapes, no memory) and counts. `check` refuses a run
that would not fit before it starts, with what would; `plan` (--plan NxG) prints the prediction for N GPUs of
G GiB. `PeakMemory` measures the real peak of one step: torch.cuda.max_memory_allocated on CUDA; on CPU, which
has no such counter, the tensors made while it runs (`StorageBytes`); `python -m harness.bench memory` sets the two
side by side. `dry_run` (--plan NxG --dry-run) runs the real step at the planned scale on fake tensors, which have
shapes and no storage, and counts its tensors as StorageBytes counts a real step's.
"""

import argparse
import dataclasses
import functools
import math
import os
import time
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from unittest.mock import patch

import torch
import torch.distributed as dist
import torch.optim.adam as torch_adam
import torch.utils._pytree as pytree
from torch._library.custom_ops import _maybe_get_opdef
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode, unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import gpt
import ring
import ulysses
from gpt import GPT, GPTConfig
from harness.launch import agreed, check_args, device_mesh, fail, model_config, ring_refusal
from tiled import at_least_float32


def local_tokens(args):
    """This rank's tokens per micro-step: batch_size * S_pad/sp, S padded to a multiple of sp (of 2 sp with a ring,
    whose zigzag order cuts it into 2 x ring chunks)."""
    multiple = args.sp * (2 if args.ring > 1 else 1)
    return args.batch_size * math.ceil(args.seq_len / multiple) * multiple // args.sp



def predict_memory(cfg, tokens, batch, sp, ring_size, world_size, zero, cuda, bf16, accumulate=False,
                   offload_optimizer=False, packed=False):
    """This rank's peak tensor memory in one training step of GPT(cfg), in bytes, before anything is allocated:
    {"peak", "state", "activations", "step" (the optimizer step's gradients and temporaries), "host" (the peak in
    CPU memory, where cfg.offload and offload_optimizer keep theirs)}, peak = state + the larger of activations and
    step. tokens: this rank's per micro-step (batch * S/sp); ring_size: the ring degree R (1: Ulysses alone over sp
    ranks); zero: "0", "3" or "fsdp2" (counted as ZeRO-3) over world_size ranks; accumulate: gradient accumulation,
    whose micro-steps after the first run beside the gradients; packed: packed documents. The model is built on the
    meta device: shapes, no memory (cfg.sinks adds a sink logit a query head a layer, a parameter like any other).

    What a layer keeps for backward is counted tensor by tensor, in elements per local token, as autograd saves
    it on CPU in float32 (torch.autograd.graph.saved_tensors_hooks, storages counted once); bf16 takes the same
    counts at two bytes each, but four for what stays float32 (the residual stream, the norms, Gated DeltaNet's
    kernel). On CPU that comes out between 6% below and 14% above the measured peak (a ring run: 18% above, for
    its operator's own buffers, which it counts and the measurement does not see; test_memory.py checks both; the
    ring's fused block kernel holds no scores, its einsum tiles, with a window, hold a query tile's, counted at
    their largest). For a GPU (cuda), what an H100 showed (BENCHMARKS.md, the GPU section)
    and what the dry run traces at full scale: within 5% of the dry run for Llama-3-8B from 1 to 32 GPUs, and the
    dry run within 0.6% of the H100's measured peaks (`python -m harness.bench plans`, BENCHMARKS.md)."""
    units, kinds = unit_sizes(dataclasses.astuple(cfg))  # what ZeRO-3 gathers: embed, blocks, head; "a" or "d" a block
    n_params, block = sum(units), max(units[1:-1])
    e, h, V, H, D = (2 if bf16 else 4), cfg.n_embd, cfg.vocab_size, cfg.n_head, cfg.n_embd // cfg.n_head
    U = sp // ring_size  # Ulysses ranks: the attention kernel sees U * tokens tokens of its heads
    q = kv = 0  # the softmax kernel's q and (expanded) kv elements per local token, busiest rank; none without "a"
    if "a" in cfg.layer_pattern:
        kernel_kv = max(len(ulysses.kernel_kv_heads(H, cfg.n_kv_head, U, r)) for r in range(U))
        q, kv = (n * U * D for n in (max(map(len, ulysses.head_layout(H, cfg.n_kv_head, U)[0])), kernel_kv))
    wide = 4 / e  # a float32 number in elements of e bytes: in bf16 the residual stream and the norms stay float32
    # the MLP: its input in the compute dtype (SwiGLU's twice: autocast casts it for gate and for up), and the hidden
    # layers: GELU's fc output and GELU of it, SwiGLU's gate and up outputs, silu of the gate and the product; tiled,
    # its input alone, the norm's float32 output
    swiglu = cfg.mlp == "swiglu"
    mlp = (1 + swiglu) * h + (2 + 2 * swiglu) * cfg.intermediate_size if cfg.tiles == 1 else wide * h
    # norm1: input, input * rstd, output; norm2: input, input * rstd; one rstd each (all float32 but the output).
    # On CUDA RMSNorm is one fused kernel, which keeps its input and rstd, not their product.
    norms = wide * ((2 if cuda else 4) * h + 2) + h
    # softmax attention: the kernel's q, k, v and output, its logsumexp (one a head), and the projection's input,
    # which without all-to-alls is the kernel's output itself, but keeps the whole qkv output alive (v is a view of
    # it) beside the rotated q and k; the all-to-alls make new tensors of them all
    attention = (q + 2 * kv) + q + H + (q + kv if U == 1 else h)
    # a window (without the ring's kernel, which takes sinks): SDPA gets an [S, S] mask, one for the batch, and keeps
    # it for backward in the compute dtype; packed documents, one [n, n] a document, at most [S, S] a row (a document
    # as long as the sequence)
    S = tokens // batch * U  # the tokens of a sequence the kernel sees
    masked = cfg.window and ring_size == 1 and not cfg.sinks
    attention += S * S * (batch if packed else 1) / tokens if masked else 0
    # a ring's backward holds dq in float32 (in bf16 also float32 copies of q, of the output's gradient and of the
    # output); the key/value block and the one arriving, three float32 dk/dv accumulators (this step's, the one
    # arriving, the one still being sent), and in bf16 the block's keys and values in float32. The fused block
    # kernel holds no scores; with a window the einsum tiles do: for one query tile at a time, float32
    # probabilities, their gradient and a copy einsum makes of one of them, against a key block
    tile = min(ring.QUERY_TILE, tokens // batch * U) if cfg.window else 0  # queries: a tile, or the whole sequence
    bf16_copies = 1 if e == 2 else 0
    ring_backward = (12 * tile * q / D + 4 * q * (1 + 3 * bf16_copies) + 2 * kv * (2 * e + 12 + 4 * bf16_copies)
                     if ring_size > 1 else 0)
    # Gated DeltaNet (chunks of C = 64 tokens), per local token: kd and vd, the key and value elements (heads x
    # dim) of the local token; kd_ and vd_, those the kernel's heads hold on this rank (heads x sp x dim, the
    # busiest rank, key heads that go to several ranks counted on each); kv = vd_ / Dv x Dk, q or k for each
    # value head. The in_proj output (z is a view of it), o, o * rstd, norm(o), silu(z) and the projection's input
    # (2kd + 7vd); the conv's padded input, output and silu (3 x (2kd_ + vd_)); the chunked kernel's scaled,
    # padded and gated q and k, the solve's k half and k * decay (5kv), and its padded v, the solve's v half, u
    # and U (4vd_), which autograd keeps, and 2kv + 2vd_ more that its backward holds at once at its peak (a
    # measurement: `python -m harness.bench memory --seq-lens 4096 --flags --layer-pattern ddda` is 2% to 7% under
    # the peak without them); seven C x C matrices a head (the decays, k k^T and its gated forms, the solve's input,
    # q k^T and q k^T * decay); 16 numbers a head (gates, norms, decays); the carried state [Dk, Dv] a head once a
    # chunk, twice; C + 2 masks of one byte. All but the first 2kd + 7vd are float32 in bf16 too:
    # gated_delta_net runs with autocast off.
    # The context-parallel way keeps every head of the local tokens, its kernel's v has Dk zero columns more, and
    # it adds what a starting state gives each output (2vd_).
    C, Dk, Dv = 64, cfg.gdn_k_dim, cfg.gdn_v_dim
    kd, vd = cfg.gdn_k_heads * Dk, cfg.gdn_v_heads * Dv
    ranks = 1 if cfg.gdn_parallel == "context" else sp  # the ranks a layer's heads are split over
    layout = ulysses.head_layout(cfg.gdn_v_heads, cfg.gdn_k_heads, ranks if "d" in cfg.layer_pattern else 1)
    hv, hk = (max(map(len, heads)) * ranks for heads in layout)  # the kernel's value and key heads, per local token
    kd_, vd_, kv = hk * Dk, hv * Dv, hv * Dk
    context = cfg.gdn_parallel == "context"
    v_width = hv * (Dv + Dk) if context else vd_  # the kernel's v elements per local token
    kernel = ((5 + 2) * kv + (4 + 2) * v_width + 7 * C * hv + 16 * hv + 2 * Dk * v_width / C +
              (2 * vd_ if context else 0))
    deltanet = 2 * kd + 7 * vd + wide * (3 * (2 * kd_ + vd_) + kernel) + (C + 2) / e
    kept = {"a": norms + attention + mlp, "d": norms + deltanet + mlp}
    layers = [kept[kind] for kind in kinds]
    blocks = tokens * e * (cfg.n_layer * h * wide if cfg.recompute else sum(layers))  # kept until backward
    # --offload keeps them in CPU memory, and with them RoPE's float32 cos and sin, a copy for each block
    offloaded = tokens * 4 * cfg.n_layer * (h + 2 * D) if cfg.offload and cuda else 0
    # The head's backward: the final norm's three [h] tensors, then the softmax's float32 output, the loss's gradient
    # and the logits', 4 bytes each per vocabulary entry; tiled, its float32 input and that input's gradient, those
    # three for one tile, and the head's weight gradient summed over the tiles (`gradient`, below)
    tiled = cfg.loss_tiles > 1
    head = tokens * e * (2 * wide * h if tiled else (2 * wide + 1) * h) + tokens * V * 12 / cfg.loss_tiles
    # A block's backward (after its recomputation, if any) holds about four float32 [h] gradients at once on CPU,
    # two on CUDA, whose fused kernels make fewer temporaries (an H100: BENCHMARKS.md, the GPU section), and in bf16
    # the copy of one in the compute dtype that enters the MLP's (or attention's) bf16 output
    gradients = (2 if cuda else 4) * h * wide + (h if bf16 else 0)
    layer = tokens * e * ((max(layers) if cfg.recompute else 0) + gradients) + tokens * ring_backward
    # A unit's backward makes its whole gradient, in bf16 beside a float32 copy (6 bytes a parameter: the sum over the
    # ranks, the parameters' float32 gradients, the sum over the tiles), in float32 beside this rank's slice of the sum.
    # On CPU gloo's reduce-scatter (torch's path for it) copies the float32 gradient once more, once the bf16 one is
    # gone: the sum then holds 8 bytes a parameter and the slice.
    gradient = lambda n: n * (6 if bf16 else 4 + 4 / world_size)
    summed = lambda n: max(gradient(n), n * (8 + 4 / world_size) if zero != "0" and not cuda else 0)
    # The model state: float32 parameters and AdamW's two moments, 12 bytes a parameter, on every rank or in shards,
    # with two gathered units, the one computing and the one prefetched, and the copy the prefetch sends from.
    # --offload-optimizer keeps the shards in CPU memory with a copy of them in the compute dtype (zero3.py): on a
    # GPU none of it is on the device; on a CPU, the same memory, the copy is all it adds.
    local = n_params if zero == "0" else n_params / world_size
    on_host = offload_optimizer and cuda
    if zero == "0":
        state = 12 * n_params
    else:
        state = (0 if on_host else (12 + e * offload_optimizer) * local) + e * (
            max(map(sum, zip(units, units[1:]))) + max(units) / world_size)
    # The float32 gradients exist from backward on, in shards or whole: the activations peak as backward starts,
    # with every kept block input and the head's backward, or as it ends, in block 0's, with the gradients of every
    # unit after it (with --offload-optimizer they go to CPU memory; with gradient accumulation, the previous
    # micro-step's are there all along). The optimizer step holds them all beside AdamW's float32 temporaries: two
    # on the device (foreach kernels, unsharded the gradients' flat copy for the all-reduce beside one), two of the
    # largest shard on the host, where it steps one tensor at a time.
    # A tiled loss sums the head's weight gradient over its tiles; untiled, the head's gradient comes once its
    # logits are gone. Unsharded in bf16, autocast's bf16 copy of the weights is there until backward has run
    # (unless --recompute makes it anew for each block).
    after_block_0 = 0 if on_host or accumulate else 4 * (n_params - units[0] - units[1]) * local / n_params
    head = head + gradient(units[-1]) if tiled else max(head, gradient(units[-1]))
    block_phase = max(layer + gradient(block), summed(block))
    activations = tokens * 4 * 2 * D + max(  # RoPE's cos and sin
        (0 if offloaded else blocks) + max(head, block_phase), after_block_0 + block_phase)
    activations += (4 * local if accumulate and not on_host else 0) + (
        2 * n_params if zero == "0" and bf16 and not cfg.recompute else 0)
    # Each token's index in the sequence (shard_for_sp's token_index, int64, 8 bytes). With packed documents in
    # ring.py's kernel (a ring, or sinks): under a ring of R > 1 the layout, each token's position, which the
    # Ulysses group gathers (8 x U bytes a local token); and every softmax layer keeps for backward the document of
    # each token of the ring's U x R x tokens, and under a ring its position too (8 bytes each; on CUDA in CPU memory)
    softmax_layers = kinds.count("a")
    saved_per_layer = 0 if cuda else 8 * sp * (2 if ring_size > 1 else 1) * softmax_layers
    layout_bytes = (8 * U * (ring_size > 1) + saved_per_layer) if packed and (ring_size > 1 or cfg.sinks) else 0
    activations += tokens * (8 + layout_bytes)
    state += 64 * 2**20 if cuda else 0  # cuBLAS's and cuDNN's workspaces: 64 to 80 MiB a GPU (an H100, torch 2.11)
    step = 0 if on_host else (4 + (8 if zero == "0" else 4)) * local
    # CPU memory: the offloaded block inputs go back as backward runs, while the offloaded gradients come
    host = ((12 + e) * local if on_host else 0) + max(offloaded, (4 * local + 8 * max(units) / world_size) * on_host)
    return {"peak": state + max(activations, step), "state": state, "activations": activations, "step": step,
            "host": host}


@functools.cache
def unit_sizes(cfg_fields):
    """The parameters of each unit ZeRO-3 gathers (the embedding, each block, the head) of GPT(cfg), built on the
    meta device (shapes, no memory), and each block's kind. cfg_fields: dataclasses.astuple(cfg), hashable, so that
    a plan's search, which asks about one model at many lengths, builds it once."""
    with torch.device("meta"):
        model = GPT(GPTConfig(*cfg_fields))
    return tuple(sum(p.numel() for p in u.parameters()) for u in model.units()), tuple(b.kind for b in model.blocks)


def predicted(args, world_size, cuda=None, **changed):
    """predict_memory for a run with these flags (some of them changed)."""
    args = argparse.Namespace(**{**vars(args), **changed})
    return predict_memory(model_config(args), local_tokens(args), args.batch_size, args.sp, args.ring, world_size,
                          args.zero, args.device == "cuda" if cuda is None else cuda, args.dtype == "bfloat16",
                          args.grad_accum > 1, args.offload_optimizer, args.pack)


def memory_verdict(args, world_size, memory, cuda):
    """(fits, one line): this run's predicted peak per rank against `memory` bytes, the longest sequence that
    would fit, and what --recompute, --tiles 16 or the largest sp would make of it."""
    peak = lambda **changed: predicted(args, world_size, cuda, **changed)["peak"]
    longest = args.sp if peak(seq_len=args.sp) <= memory else 0  # doubled while it fits, then grown by halves
    while longest and peak(seq_len=2 * longest) <= memory:
        longest *= 2
    for step in (longest // 2**k for k in range(1, 7)):  # to within 1/64
        longest += step if peak(seq_len=longest + step) <= memory else 0
    # the most ranks in one SP group: all of them, with the smallest ring that leaves every Ulysses rank a head,
    # where a ring can run; else as many as there are heads
    if not ring_refusal(args):
        sp = world_size
        rings = min(r for r in range(1, sp + 1) if sp % r == 0 and sp // r <= args.n_head)
    else:  # Gated DeltaNet layers split their value heads
        heads = min([args.n_head] * ("a" in args.layer_pattern) + [model_config(args).gdn_v_heads] *
                    ("d" in args.layer_pattern))
        sp, rings = max(p for p in range(1, min(world_size, heads) + 1) if world_size % p == 0), 1
    options = {"--recompute": {"recompute": True}, "--tiles 16": {"tiles": max(16, args.tiles)},
               f"--sp {sp}" + f" --ring {rings}" * (rings > 1): {"sp": sp, "ring": rings}}
    others = [f"{flags}: {peak(**change) / 2**30:,.1f} GiB" for flags, change in options.items()
              if any(getattr(args, k) != v for k, v in change.items())]  # those that change something
    m, gib = predicted(args, world_size, cuda), lambda b: f"{b / 2**30:,.1f} GiB"
    return m["peak"] <= memory, (
        f"{gib(m['peak'])} per rank for {local_tokens(args) // args.batch_size:,} tokens a rank (model state "
        f"{gib(m['state'])} + the larger of activations {gib(m['activations'])} and the optimizer step's gradients "
        f"and temporaries {gib(m['step'])}; {gib(m['host'])} more in CPU memory), against "
        f"{gib(memory)}; {f'about {longest:,} tokens would fit' if longest else 'no sequence fits'}; "
        f"{'; '.join(others) or 'nothing else to try'}")


def check(args, run):
    """check_memory on every rank of the run (launch.started's), agreed: a rank that lacks the memory stops them all."""
    agreed(run.control, functools.partial(check_memory, args, run.world_size))


def check_memory(args, world_size):
    """Refuse a run whose predicted peak exceeds the free GPU memory, or this rank's share of the machine's
    available RAM, before anything is allocated."""
    if args.device == "cuda":
        have = torch.cuda.mem_get_info()[0]  # of the GPU this rank uses (launch set it)
    elif os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            have = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
        have //= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    else:
        return
    if predicted(args, world_size)["peak"] > have:  # only then what would fit: that search takes about a second
        fail(f"this run would need {memory_verdict(args, world_size, have, args.device == 'cuda')[1]}")


def plan(args, build=None):
    """--plan NxGIB: the predicted memory of this run on N GPUs of GIB GiB, without running it; with --dry-run, also
    the peak of its real step traced on fake tensors (dry_run, of what train.py's build makes), which then decides
    whether it fits. True if it fits; SystemExit(1) if not."""
    try:
        gpus, gib = args.plan.lower().split("x")
        world_size, memory = int(gpus), float(gib) * 2**30
        if world_size < 1 or not (math.isfinite(memory) and memory > 0):
            raise ValueError
    except ValueError:
        fail(f"--plan {args.plan}: write it as GPUSxGIB, at least one GPU of more than 0 GiB, e.g. 8x80 for 8 GPUs "
             f"of 80 GiB")
    check_args(args, world_size)
    fits, verdict = memory_verdict(args, world_size, memory, cuda=True)
    usp = f" (ulysses {args.sp // args.ring} x ring {args.ring})" if args.ring > 1 else ""
    print(f"plan: {world_size} GPU{'s' * (world_size > 1)}, sp {args.sp}{usp}, seq {args.seq_len:,}: "
          f"{'fits' if fits else 'does NOT fit'}: {verdict}", flush=True)
    if args.dry_run:
        traced, m = dry_run(args, world_size, build), predicted(args, world_size, cuda=True)
        fits, gib = traced["device"] <= memory, lambda b: f"{b / 2**30:,.1f} GiB"
        print(f"dry run: rank {traced['rank']} of {world_size}, the training step traced on fake tensors in "
              f"{traced['seconds']:.0f} s: {'fits' if fits else 'does NOT fit'}: {gib(traced['device'])} per GPU "
              f"(predicted {gib(m['peak'])}, {m['peak'] / traced['device'] - 1:+.1%}), {gib(traced['host'])} in CPU "
              f"memory (predicted {gib(m['host'])})")
    if not fits:
        raise SystemExit(1)  # after its line
    return fits


class PeakMemory:
    """The peak tensor memory of one training step, in bytes, the largest over the ranks (`.bytes`):
    torch.cuda.max_memory_allocated on CUDA; on CPU, which has no such counter, StorageBytes. On CUDA with host=True
    (--offload or --offload-optimizer) also the host memory (`.host_bytes`: the CPU storages they keep), by
    StorageBytes; otherwise `.host_bytes` is None (on CPU the host is the device). Only the measured step pays for
    the counting."""

    def __init__(self, model, optimizer, zero, device, host=False):
        self.model, self.optimizer, self.zero, self.device = model, optimizer, zero, device
        self.host = host and device.type == "cuda"
        self.bytes = self.host_bytes = None

    def existing(self):
        """The tensors made before the step that it may hold: the model's, the optimizer's parameters (under ZeRO-3
        its shards, which the model no longer holds) and their gradients, AdamW's moments, and ZeRO-3's gathered
        units (their storage is 0 bytes while freed) and host buffers (--offload-optimizer)."""
        optimized = [p for group in self.optimizer.param_groups for p in group["params"]]
        units = self.zero.units if self.zero else []
        return [*self.model.parameters(), *self.model.buffers(), *optimized,
                *(p.grad for p in [*self.model.parameters(), *optimized] if p.grad is not None),
                *(t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)),
                *(unit.full for unit in units), *(unit.staging for unit in units if unit.staging is not None)]

    @contextmanager
    def measure(self, enabled=True):
        if not enabled:
            yield
            return
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        counting = not cuda or self.host  # on a GPU without offloads, nothing to count: the step runs as any other
        with StorageBytes(self.existing(), host="cpu" if cuda else None) if counting else nullcontext() as counter:
            yield
        peaks = torch.tensor([float(torch.cuda.max_memory_allocated(self.device) if cuda else counter.peak),
                              float(counter.host_peak if self.host else 0)], device=self.device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        self.bytes, host = (int(b) for b in peaks.tolist())
        self.host_bytes = host if self.host else None


class StorageBytes(TorchDispatchMode):
    """Counts the bytes of tensor storage alive while it is entered, and keeps the largest count (`.peak`). Every
    op's outputs pass through it: a storage it has not seen adds its bytes, and subtracts them when it is freed
    (a finalizer). The storages of `existing` tensors are counted once at the start. ZeRO-3 frees and refills its
    gathered units by resizing their storage, which no op shows, so UntypedStorage.resize_ is watched while it is
    entered (Tensor.resize_ of a storage already counted, and out= ops that grow one, are not: nothing here uses
    them). The cost is a few dictionary operations an op, whatever the model's depth. host: a device type ("cpu"
    beside a GPU) whose storages count apart, in `.host_peak` (`.now` and `.peak`: the rest).

    An operator of its own (ulysses' all-to-all, the ring) is one op to a dispatch mode: what it makes inside and
    frees before it returns (the send and receive buffers, the ring's blocks) is not seen, and the predictor
    leaves it out too. inside_operators=True runs such an operator's Python code under the count, so that its
    temporaries count (bench.py measures a layer so)."""

    def __init__(self, existing, inside_operators=False, host=None):
        super().__init__()
        self.inside_operators, self.host = inside_operators, host
        self.sizes = WeakIdKeyDictionary()  # storage -> [its bytes, as counted; "host" or "device"]
        self.finalizers, self.alive, self.peaks = [], {"device": 0, "host": 0}, {"device": 0, "host": 0}
        self.depth = 0  # entries: an operator's code, counted inside the count, enters it again
        for t in existing:
            self._see(t)

    @property
    def now(self):
        return self.alive["device"]

    @property
    def peak(self):
        return self.peaks["device"]

    @property
    def host_peak(self):
        return self.peaks["host"]

    def _see(self, t):
        t = t.to_local() if isinstance(t, DTensor) else t
        storage = t.untyped_storage()
        if storage not in self.sizes:  # (a fake tensor's storage is on the meta device, whatever the tensor's)
            self.sizes[storage] = size = [0, "host" if t.device.type == self.host else "device"]
            self.finalizers.append(weakref.finalize(storage, self._free, size))
            self._grow(size, storage.nbytes())

    def _grow(self, size, nbytes):
        size[0] += nbytes
        self.alive[size[1]] += nbytes
        self.peaks[size[1]] = max(self.peaks[size[1]], self.alive[size[1]])

    def _free(self, size):
        self._grow(size, -size[0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:
            return NotImplemented  # DTensor runs first, and its local ops come through here
        custom = _maybe_get_opdef(func) if self.inside_operators else None  # an operator written in Python (the
        if custom is not None:  # all-to-all, the ring): its own code runs under the count, so its buffers count
            with self:
                out = custom._init_fn(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and (t.device.type != "meta" or self.host == "meta"):  # a dry run's host
                self._see(t)
        return out

    def __enter__(self):
        self.depth += 1
        if self.depth == 1:  # the count starts: watch resizes (an operator's code, entered again, changes nothing)
            resize = self.resize = torch.UntypedStorage.resize_

            def counted_resize(storage, nbytes):
                resize(storage, nbytes)
                if storage in self.sizes:
                    self._grow(self.sizes[storage], storage.nbytes() - self.sizes[storage][0])
            torch.UntypedStorage.resize_ = counted_resize
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        if self.depth == 0:  # the count ends: no storage freed from now on changes it
            torch.UntypedStorage.resize_ = self.resize
            for finalizer in self.finalizers:
                finalizer.detach()
        return super().__exit__(*exc)


# ----------------------------------------------------------------------------------------------------------------
# the dry run: the real step at a scale this machine cannot run, on fake tensors


def dry_run(args, world_size, build, cuda=True):
    """The peak memory of one training step of this run, on one rank of `world_size`, traced rather than predicted:
    the real step runs on fake tensors (torch's FakeTensorMode: shapes, dtypes and devices, no storage and no
    arithmetic) in this one process, with a fake process group of world_size ranks (torch's fake_pg: its
    collectives return at once and move nothing), and StorageBytes counts its storages as it counts a real step's.
    build(world_size, mesh, device, host) makes the model, its sharding and its optimizer as the run does, and
    returns (model, zero, optimizer, parameters, step), step(i) running optimizer step i (train.py's build). The
    step traced is the one a run of --steps measures, its last: after the first, it finds AdamW's state made.
    Returns {"device", "host" (the two peaks, bytes), "rank", "seconds"}.

    It traces on CPU fake tensors (a CPU-only torch cannot fake CUDA ones), so with cuda=True the step decides as a
    GPU would (`as_on_cuda`), and host memory is the meta device: a device apart from the one computing, so that
    what --offload and --offload-optimizer move there counts apart. Fake tensors hold no numbers, so a call that
    reads one (.item(), .tolist()) reads 1 (`FakeTensors`). The rank traced is the busiest (`busiest_rank`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend (a test
    rank, start = busiest_rank(args), time.perf_counter()  # utility of torch's: imported by a dry run alone)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = device_mesh(args, world_size, "cpu")
        host = torch.device("meta" if cuda else "cpu")
        with FakeTensors(), real_meshes(), as_on_cuda() if cuda else nullcontext():
            model, zero, optimizer, _, step = build(world_size, mesh, torch.device("cpu"), host)
            last = args.steps - 1  # a run measures its last step, which after the first finds AdamW's state made:
            if last:  # here by a step on zero gradients
                for p in (p for group in optimizer.param_groups for p in group["params"]):
                    p.grad = torch.zeros_like(p)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            existing = PeakMemory(model, optimizer, zero, torch.device("cpu")).existing  # a list held no longer
            with StorageBytes(existing(), host=host.type if cuda else None) as counter:  # than needed
                step(last)
    finally:
        dist.destroy_process_group()
    return {"device": counter.peak, "host": counter.host_peak, "rank": rank, "seconds": time.perf_counter() - start}


def busiest_rank(args):
    """The rank a dry run traces, standing for all: the Ulysses rank whose attention kernel gets the most heads (query
    heads, and the kv heads it expands to; head_layout gives the first ranks one more), in the first ring and data
    group. Every rank holds as many tokens and as large a ZeRO-3 shard, and the zigzag order gives every ring rank
    the same work; Gated DeltaNet's value heads, like query heads, go to the first ranks first."""
    U = args.sp // args.ring
    if "a" not in args.layer_pattern:
        return 0
    query = ulysses.head_layout(args.n_head, args.n_kv_head, U)[0]
    heads = [len(query[r]) + 2 * len(ulysses.kernel_kv_heads(args.n_head, args.n_kv_head, U, r)) for r in range(U)]
    return heads.index(max(heads))


class FakeTensors(FakeTensorMode):
    """torch's FakeTensorMode, with an answer where a call reads a number out of a fake tensor (.item(), .tolist()),
    which holds none: 1. The shape checks then pass (every rank reports the same), and a loss and a gradient norm of
    1 are finite. No shape is read from a tensor's values in a dry run (packed documents, where one would be, are
    refused)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except DataDependentOutputException:
            return 1


def real_meshes():
    """FSDP2's device mesh (DeviceMesh.from_group) made of real tensors inside a dry run: it finds this rank in it
    (nonzero), whose result's shape depends on the values, which fake tensors do not hold."""
    from_group = DeviceMesh.from_group

    def made_outside(*args, **kwargs):
        with unset_fake_temporarily():
            return from_group(*args, **kwargs)
    return patch.object(DeviceMesh, "from_group", made_outside)


@contextmanager
def as_on_cuda():
    """The step's device decisions as a GPU takes them, while a dry run traces on CPU fake tensors. The attention
    kernels: ulysses.sdpa_takes_groups asked for "cuda" (test_kernels.py does the same; ring.block_kernel's choice
    runs inside the ring's operator, whose fake shapes stand in for it here). AdamW: its foreach kernels, which it
    takes on CUDA (`foreach_on_the_gpu`; on CPU it steps one tensor at a time). RMSNorm: CUDA runs it as one fused
    kernel (aten._fused_rms_norm, which a CPU build lacks), which keeps its input and statistic for backward and
    makes nothing else (an H100 showed it); `FusedRMSNorm` stands in for it."""
    with ExitStack() as stack:
        on_cuda = functools.partial(ulysses.sdpa_takes_groups, "cuda")
        stack.enter_context(patch.object(ulysses, "sdpa_takes_groups", lambda device_type, *rest: on_cuda(*rest)))
        stack.enter_context(patch.object(torch_adam, "_default_to_fused_or_foreach", foreach_on_the_gpu))
        stack.enter_context(patch.object(gpt, "rms_norm", fused_rms_norm))
        yield


def foreach_on_the_gpu(params, differentiable, use_fused=False):
    """AdamW's choice of kernels (torch.optim's _default_to_fused_or_foreach) as for CUDA tensors: its foreach kernels
    for the parameters on the device ("cpu" plays the GPU in a dry run), not for those in host memory."""
    return False, not differentiable and all(p is None or p.device.type == "cpu" for p in params)


def fused_rms_norm(x, weight, eps=None):
    """gpt.rms_norm as a GPU runs it: float32 statistics, the result in x's dtype."""
    return FusedRMSNorm.apply(at_least_float32(x), at_least_float32(weight)).to(x.dtype)


class FusedRMSNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm, its memory alone: it keeps its input and the statistic [..., 1] for backward, and makes
    its output, and in backward the two gradients. Empty tensors of those shapes: a dry run computes nothing."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight, x.new_empty(x.shape[:-1] + (1,)))  # the statistic, 1 / rms: (..., 1)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        x, weight, _ = ctx.saved_tensors
        return torch.empty_like(x), torch.empty_like(weight)
