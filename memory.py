"""
Memory: what one rank will hold in a training step, predicted before anything is allocated, and what it held,
measured.

A rank's peak is its model state plus the larger of two things that never coexist: the activations autograd
keeps until backward (with the backward's own working set on top), and the optimizer step's gradients and
temporaries. Backward frees a layer's activations as it makes the layer's gradients, so the two peak apart: the
activations as backward starts, the gradients once it ends.

    peak = state + max(activations, step)
    state        ZeRO-3: 12 bytes a parameter / N ranks (float32 param, two AdamW moments), plus two gathered
                 units in the compute dtype; unsharded: 12 bytes a parameter (14 in bf16: autocast's copy)
    activations  per local token (S/P of them): what each layer keeps for backward, counted tensor by tensor,
                 plus the largest backward working set (the head's logits, or one block's)
    step         the float32 gradients and AdamW's two float32 temporaries, the size of this rank's shard

`predict_memory` builds the model on the meta device (shapes, no memory) and counts. `check_memory` refuses a run
that would not fit before it starts, with what would; `plan` (--plan NxG) prints the prediction for N GPUs of
G GiB. `PeakMemory` measures the real peak of one step: torch.cuda.max_memory_allocated on CUDA; on CPU, which
has no such counter, the tensors made while it runs. `python bench.py memory` sets the two side by side.
"""

import argparse
import math
import os
import weakref
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._library.custom_ops import _maybe_get_opdef
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

import ring
import ulysses
from gpt import GPT
from launch import check_args, fail, model_config, ring_refusal


def local_tokens(args):
    """This rank's tokens per micro-step: batch_size * S_pad/sp, S padded to a multiple of sp (of 2 sp with a ring,
    whose zigzag order cuts it into 2 x ring chunks)."""
    multiple = args.sp * (2 if args.ring > 1 else 1)
    return args.batch_size * math.ceil(args.seq_len / multiple) * multiple // args.sp



def predict_memory(cfg, tokens, batch, sp, ring_size, world_size, zero, cuda, bf16, accumulate=False,
                   packed=False):
    """This rank's peak tensor memory in one training step of GPT(cfg), in bytes, before anything is allocated:
    {"peak", "state", "activations", "step" (the optimizer step's gradients and temporaries), "offloaded" (kept in
    CPU memory by cfg.offload)}, peak = state + the larger of activations and step. tokens: this rank's per
    micro-step (batch * S/sp); ring_size: the ring degree R (1: Ulysses alone over sp ranks); zero: "0", "3" or
    "fsdp2" over world_size ranks; accumulate: gradient accumulation, whose micro-steps after the first run beside
    the gradients; packed: packed documents. The model is built on the meta device: shapes, no memory (cfg.sinks
    adds a sink logit a query head a layer, a parameter like any other). `python bench.py memory` sets the
    prediction beside the measured peak.

    What a layer keeps for backward is counted tensor by tensor, in elements per local token, as autograd saves
    it on CPU in float32 (torch.autograd.graph.saved_tensors_hooks, storages counted once); bf16 takes the same
    counts at two bytes each, but four for what stays float32 (the residual stream, the norms, Gated DeltaNet's
    kernel). On CPU that comes out between 22% below and 7% above the measured peak (a ring run: within 16%, as
    test_memory.py checks; the ring's fused block kernel holds no scores, its einsum tiles, with a window, hold a
    query tile's, counted at their largest); on an H100, for a 0.7B model at 8k to 256k tokens, within 8%."""
    with torch.device("meta"):
        model = GPT(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    unit = max(sum(p.numel() for p in u.parameters()) for u in model.units())  # the largest one ZeRO-3 gathers
    e, h, V, H, D = (2 if bf16 else 4), cfg.n_embd, cfg.vocab_size, cfg.n_head, cfg.n_embd // cfg.n_head
    U = sp // ring_size  # Ulysses ranks: the attention kernel sees U * tokens tokens of its heads
    q = kv = 0  # the softmax kernel's q and (expanded) kv elements per local token, busiest rank; none without "a"
    if "a" in cfg.layer_pattern:
        kernel_kv = max(len(ulysses.kernel_kv_heads(H, cfg.n_kv_head, U, r)) for r in range(U))
        q, kv = (n * U * D for n in (max(map(len, ulysses.head_layout(H, cfg.n_kv_head, U)[0])), kernel_kv))
    wide = 4 / e  # a float32 number in elements of e bytes: in bf16 the residual stream and the norms stay float32
    mlp = 9 * h if cfg.tiles == 1 else h  # its input, fc output and gelu output; tiled, its input alone
    # norm1: input, input * rstd, output; norm2: input, input * rstd; one rstd each (all float32 but the output).
    # On CUDA RMSNorm is one fused kernel, which keeps its input and rstd, not their product.
    norms = wide * ((2 if cuda else 4) * h + 2) + h
    # softmax attention: the kernel's q, k, v and output, its logsumexp (one a head), and the projection's input,
    # which without all-to-alls is the kernel's output itself, but keeps the whole qkv output alive (v is a view of
    # it) beside the rotated q and k; the all-to-alls make new tensors of them all
    attention = (q + 2 * kv) + q + H + (q + kv if U == 1 else h)
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
    # measurement: `python bench.py memory --seq-lens 4096 --flags --layer-pattern ddda` is 2% to 7% under the
    # peak without them); seven C x C matrices a head (the decays, k k^T and its gated forms, the solve's input,
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
    layers = [kept[block.kind] for block in model.blocks]
    blocks = tokens * e * (cfg.n_layer * h * wide if cfg.recompute else sum(layers))  # kept until backward
    offloaded = blocks if cfg.offload and cuda else 0
    # The head's backward: the final norm's three [h] tensors, then float32 logits, their gradient and the
    # softmax's output, 4 bytes each per vocabulary entry; tiled, its input and one tile's logits and gradient.
    head = tokens * e * ((2 * wide + 1) * h if cfg.tiles == 1 else (wide + 1) * h) + tokens * V * (
        12 if cfg.tiles == 1 else 8 / cfg.tiles)
    # A block's backward (after its recomputation, if any) holds about four float32 [h] gradients at once on CPU,
    # two on CUDA, whose fused kernels make fewer temporaries: measured (an H100: BENCHMARKS.md, the GPU section)
    gradients = (2 if cuda else 4) * h * wide
    layer = tokens * e * ((max(layers) if cfg.recompute else 0) + gradients) + tokens * ring_backward
    # Sharded, a unit's backward ends, its working set gone, with its whole gradient: its parameters' gradients
    # joined into one buffer (both at once: 8 bytes a parameter in float32), summed over the ranks in float32 (in
    # bf16 a float32 copy beside it: 6 bytes a parameter)
    gradient = 0 if zero == "0" else unit * (6 if bf16 else 8)
    # Each token's index in the sequence (shard_for_sp's token_index, int64, 8 bytes). With packed documents in
    # ring.py's kernel (a ring, or sinks), every softmax layer keeps for backward the document of each token of the
    # ring's U x R x tokens (8 bytes each; CPU memory on CUDA), and under a ring of R > 1 also each one's position,
    # the layout, which the Ulysses group gathers (8 x U bytes a local token)
    softmax_layers = sum(block.kind == "a" for block in model.blocks)
    kept = 0 if cuda else 8 * sp * (2 if ring_size > 1 else 1) * softmax_layers
    layout = (8 * U * (ring_size > 1) + kept) if packed and (ring_size > 1 or cfg.sinks) else 0
    activations = blocks - offloaded + tokens * 4 * 2 * D + max(head, layer, gradient)  # + RoPE's cos and sin
    activations += tokens * (8 + layout)
    # The model state: float32 parameters and AdamW's two moments, 12 bytes a parameter, on every rank (in bf16 also
    # autocast's bf16 copy of the weights, which backward keeps) or in shards (and two gathered units). The float32
    # gradients, 4 bytes more, exist from backward on: the activations peak as backward starts, before any of them
    # (beside the previous micro-step's with gradient accumulation), and the optimizer step holds them all beside
    # AdamW's two float32 temporaries.
    if zero == "0":
        state, local = (12 + (2 if bf16 else 0)) * n_params, n_params
    else:
        state, local = 12 * n_params / world_size + 2 * unit * e, n_params / world_size
    activations += 4 * local if accumulate else 0
    state += 64 * 2**20 if cuda else 0  # cuBLAS's and cuDNN's workspaces: 64 to 80 MiB a GPU (an H100, torch 2.11)
    # the gradients, beside AdamW's two temporaries the size of the parameters or shards, or, sharded, the last
    # units' whole gradients as backward ends
    step = 4 * local + max(8 * local, gradient)
    return {"peak": state + max(activations, step), "state": state, "activations": activations, "step": step,
            "offloaded": offloaded}


def predicted(args, world_size, cuda=None, **changed):
    """predict_memory for a run with these flags (some of them changed)."""
    args = argparse.Namespace(**{**vars(args), **changed})
    return predict_memory(model_config(args), local_tokens(args), args.batch_size, args.sp, args.ring, world_size,
                          args.zero, args.device == "cuda" if cuda is None else cuda, args.dtype == "bfloat16",
                          args.grad_accum > 1, args.pack)


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
        f"and temporaries {gib(m['step'])}; {gib(m['offloaded'])} more in CPU memory), against "
        f"{gib(memory)}; {f'about {longest:,} tokens would fit' if longest else 'no sequence fits'}; "
        f"{'; '.join(others) or 'nothing else to try'}")


def check_memory(args, world_size):
    """Refuse a run whose predicted peak exceeds the free GPU memory, or this rank's share of the machine's
    available RAM, before anything is allocated."""
    if args.device == "cuda":
        have = torch.cuda.mem_get_info(int(os.environ.get("LOCAL_RANK", 0)))[0]
    elif os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            have = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))
        have //= int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    else:
        return
    if predicted(args, world_size)["peak"] > have:  # only then what would fit: that search takes about a second
        fail(f"this run would need {memory_verdict(args, world_size, have, args.device == 'cuda')[1]}")


def plan(args):
    """--plan NxGIB: the predicted memory of this run on N GPUs of GIB GiB, without running it."""
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
          f"{'fits' if fits else 'does NOT fit'}: {verdict}")
    return fits


class PeakMemory:
    """The peak tensor memory of one training step, in bytes, the largest over the ranks (`.bytes`):
    torch.cuda.max_memory_allocated on CUDA; on CPU, which has no such counter, StorageBytes. Only the measured
    step pays for the counting."""

    def __init__(self, model, optimizer, zero, device):
        self.model, self.optimizer, self.zero, self.device, self.bytes = model, optimizer, zero, device, None

    def existing(self):
        """The tensors made before the step that it may hold: the model's, the optimizer's parameters (under ZeRO-3
        its shards, which the model no longer holds) and their gradients, AdamW's moments, and ZeRO-3's gathered
        units (their storage is 0 bytes while freed)."""
        optimized = [p for group in self.optimizer.param_groups for p in group["params"]]
        return [*self.model.parameters(), *self.model.buffers(), *optimized,
                *(p.grad for p in [*self.model.parameters(), *optimized] if p.grad is not None),
                *(t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)),
                *([unit.full for unit in self.zero.units] if self.zero else [])]

    @contextmanager
    def measure(self, enabled=True):
        if not enabled:
            yield
            return
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            with StorageBytes(self.existing()) as counter:
                yield
            peak = counter.peak
        peak = torch.tensor(float(peak), device=self.device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        self.bytes = int(peak.item())


class StorageBytes(TorchDispatchMode):
    """Counts the bytes of tensor storage alive while it is entered, and keeps the largest count (`.peak`). Every
    op's outputs pass through it: a storage it has not seen adds its bytes, and subtracts them when it is freed
    (a finalizer). The storages of `existing` tensors are counted once at the start. ZeRO-3 frees and refills its
    gathered units by resizing their storage, which no op shows, so UntypedStorage.resize_ is watched while it is
    entered (Tensor.resize_ of a storage already counted, and out= ops that grow one, are not: nothing here uses
    them). The cost is a few dictionary operations an op, whatever the model's depth.

    An operator of its own (ulysses' all-to-all, the ring) is one op to a dispatch mode: what it makes inside and
    frees before it returns (the send and receive buffers, the ring's blocks) is not seen, and the predictor
    leaves it out too. inside_operators=True runs such an operator's Python code under the count, so that its
    temporaries count (bench.py measures a layer so)."""

    def __init__(self, existing, inside_operators=False):
        super().__init__()
        self.inside_operators = inside_operators
        self.sizes = WeakIdKeyDictionary()  # storage -> [its bytes, as counted]
        self.finalizers, self.now, self.peak, self.depth = [], 0, 0, 0  # depth: entries (an operator's code re-enters)
        for t in existing:
            self._see(t)

    def _see(self, t):
        storage = (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()
        if storage not in self.sizes:
            self.sizes[storage] = size = [0]
            self.finalizers.append(weakref.finalize(storage, self._free, size))
            self._grow(size, storage.nbytes())

    def _grow(self, size, nbytes):
        size[0] += nbytes
        self.now += nbytes
        self.peak = max(self.peak, self.now)

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
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
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
