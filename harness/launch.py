"""
A run on many processes: how it starts, and how it ends when something is wrong.

A training run is N copies of one program (torchrun starts one a GPU, on one machine or several). They start
together, and they must end together: a copy that stops while the others wait in a collective leaves them
hanging, and a copy that exits 0 from a failed run tells its node's launcher that the run succeeded. So:

  1. every rank checks the flags on its own, before any process waits on another (`check_args`): they all find
     the same mistake, the first rank of each node prints it, and every rank exits 1 (`started` runs 1 to 3);
  2. then the process group, and the dp x ring x ulysses mesh on it (`process_groups`), plus a gloo "control"
     group whose waits have a day's deadline rather than --timeout, for agreeing on problems; every rank beats in
     the group's store. Before the mesh, the ranks compare their flags, and after reading the data its bytes
     (`same_everywhere`): nodes started with other flags, or with a stale copy of the data, stop with one line
     instead of training wrong;
  3. what one rank may find alone (its data file, its disk) is agreed in one small all-gather
     (`agreed`): if any rank found a problem, every rank exits 1. The rank that found it prints its line, naming
     itself; the first rank of every other node prints it too, so each node's log says why its run failed;
  4. a collective that fails (a peer died, or waited past --timeout) ends its rank with one line naming the
     collective and the ranks whose beat stopped (`collective_failure`), not a traceback;
  5. SIGINT (Ctrl-C) or SIGTERM ends a rank at once with one line (`one_line_errors`).

A mistake is one line, `train.py: error: ...`, never a traceback and never a hang. Each node's torchrun judges
the run by its own workers' exit statuses alone, so every rank of a failed run exits non-zero.

The file also holds what turns the flags into a model config (`model_config`), and the progress line that a long
step writes (`StepProgress`), so that no run sits silent.
"""

import argparse
import datetime
import math
import os
import re
import signal
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import data
import ulysses
from gpt import PRESETS, GPTConfig

WEEK = 7 * 24 * 3600
MODEL_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "window", "layer_pattern", "gdn_k_heads", "gdn_v_heads",
                "gdn_k_dim", "gdn_v_dim", "vocab_size", "mlp", "intermediate_size", "rope_base",
                "sinks")  # what makes the model


class Mistake(Exception):
    """A mistake the user can fix, or a run that cannot go on. alike: every rank finds the same one (the flags, a
    non-finite loss, a checkpoint all ranks read), so the first rank of each node prints it (one line a node's
    log); else the rank that found it does."""

    def __init__(self, message, alike=True):
        super().__init__(message)
        self.alike = alike


def fail(message, alike=True):
    raise Mistake(message, alike)


@contextmanager
def one_line_errors():
    """Turn a Mistake into its line and exit status 1, on every rank, running out of memory into one line and exit
    status 1 on that rank (torchrun then stops the others), and SIGINT (Ctrl-C) or SIGTERM into one line
    and exit status 128 + the signal's number. A rank that prints nothing waits a moment before it exits, so that
    one torchrun, which stops every worker as soon as one fails, lets the line out."""
    rank, once = int(os.environ.get("RANK", 0)), threading.Lock()

    def stopped(signum, frame):
        # at once, and without the cleanup a normal exit does, which could wait on peers that are already gone; a
        # checkpoint being written stays a .tmp directory, which is never taken for a complete one
        if once.acquire(blocking=False):  # the first signal, by the handler or the thread below; a second returns
            print(f"train.py: error: rank {rank}: stopped by {signal.Signals(signum).name}", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)

    def signalled():
        # a handler runs only once the main thread is back in Python: a rank waiting in a collective for a peer that
        # stopped would wait --timeout. The signal's number also comes down this pipe at once, and this thread acts
        while signum := os.read(woken, 1):
            if signum[0] in (signal.SIGINT, signal.SIGTERM):
                stopped(signum[0], None)
        os.close(woken)  # the other end was closed: the run is over
    before = {signum: signal.signal(signum, stopped) for signum in (signal.SIGINT, signal.SIGTERM)}
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    woke_before = signal.set_wakeup_fd(wake)
    threading.Thread(target=signalled, daemon=True).start()
    try:
        yield
    except Mistake as e:
        if e.alike and int(os.environ.get("LOCAL_RANK", 0)) != 0:  # each node's first rank says it, once a node
            leave_quietly(1)
        raise SystemExit(f"train.py: error: {'' if e.alike else f'rank {rank}: '}{e}") from None
    except RuntimeError as e:  # torch.OutOfMemoryError on a GPU, the CPU allocator's RuntimeError
        asked = re.search(r"tried to allocate ([\d.]+ \w+)", str(e), re.IGNORECASE)
        cpu_refused = any(words in str(e) for words in ("can't allocate memory", "not enough memory"))  # Linux, Windows
        if not (asked and (cpu_refused or isinstance(e, torch.OutOfMemoryError))):
            raise  # any other error, with its traceback
        raise SystemExit(f"train.py: error: rank {rank}: out of memory, tried to allocate {asked[1]}; choose a shorter "
                         f"--seq-len, a smaller --batch-size or model, or --tiles, --recompute, --offload (--plan "
                         f"NxG finds the longest sequence that fits)") from None
    finally:
        signal.set_wakeup_fd(woke_before)
        os.close(wake)  # the thread reads the end of the pipe, and ends
        for signum, handler in before.items():
            signal.signal(signum, handler)


def leave_quietly(status):
    """Exit with `status` and no line, a moment late: one torchrun stops every worker as soon as one fails, and the
    line that a peer is printing should get out first. Stopped meanwhile (torchrun's SIGTERM), it leaves silently."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: os._exit(status))
    signal.set_wakeup_fd(-1)  # nor does one_line_errors' thread say a line
    time.sleep(2)
    raise SystemExit(status)


# ----------------------------------------------------------------------------------------------------------------
# 1. the flags, checked on every rank alone (train.py's command line)


class Parser(argparse.ArgumentParser):
    """argparse, whose mistakes (an unknown flag, a value of the wrong type) each node's first rank alone prints;
    every rank exits 2, as argparse does."""

    def error(self, message):
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            super().error(message)
        leave_quietly(2)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default; a default of None (the help says what stands in) or a switch's False
    is left out."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def parse_args(argv=None):
    p = Parser(description="Ulysses sequence-parallel GPT training", allow_abbrev=False,
                                formatter_class=HelpFormatter)
    p.add_argument("--sp", type=int, help="sequence-parallel size (default: every rank); dp = world size / sp")
    p.add_argument("--ring", type=int, default=1, help="ring degree R: each SP group of --sp ranks is a ring of R "
                   "Ulysses groups of sp/R ranks (Ulysses x Ring, ring.py); 1: Ulysses alone")
    p.add_argument("--seq-len", type=int, default=128,
                   help="tokens per sequence, before padding to a multiple of sp (of 2 sp with --ring)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per DP rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--lr", type=float, help="peak learning rate (default 1e-3; 5e-4 with Gated DeltaNet layers)")
    p.add_argument("--warmup", type=int, help="warmup steps (default: steps/10)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay, on every parameter")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p.add_argument("--seed", type=int, default=0, help="fixes the initial model and the samples (packed text "
                   "is read in order)")
    p.add_argument("--model", choices=sorted(PRESETS), help="a real model's shape (gpt.PRESETS; llama3-8b: Llama-3-8B, "
                   "8.03B parameters); the model flags given beside it change it")
    p.add_argument("--n-layer", type=int, help="layers (default: 2, or the length of --layer-pattern)")
    p.add_argument("--n-head", type=int, default=4, help="query heads of softmax attention")
    p.add_argument("--n-kv-head", type=int, help="key/value heads (default: n_head)")
    p.add_argument("--n-embd", type=int, default=128, help="hidden size")
    p.add_argument("--vocab-size", type=int, default=256, help="tokens of the vocabulary (the data's are bytes, 0 to "
                   "255)")
    p.add_argument("--mlp", choices=["gelu", "swiglu"], default="gelu", help="the MLP: gelu, GPT-2's; swiglu, "
                   "Llama's (a gate beside the up projection)")
    p.add_argument("--intermediate-size", type=int, default=0, help="the MLP's hidden size (0: 4 x --n-embd)")
    p.add_argument("--rope-base", type=float, default=10000.0, help="RoPE's theta")
    p.add_argument("--window", type=int, default=0, help="sliding-window attention over this many tokens (0: full)")
    p.add_argument("--sinks", action="store_true", help="attention sinks (gpt-oss): a learned logit per query head "
                   "joins each query's softmax (weight-decayed as every parameter is); attention then runs in "
                   "ring.py's kernel, with or without --ring")
    p.add_argument("--layer-pattern", default="a", help="each layer's kind, repeated over the layers: a = softmax "
                   "attention, d = Gated DeltaNet (linear attention); e.g. ddda")
    for part, what in (("k-heads", "key heads (q, k)"), ("v-heads", "value heads (v, the state; a multiple of the key "
                       "heads)"), ("k-dim", "dims of a key head"), ("v-dim", "dims of a value head")):
        p.add_argument(f"--gdn-{part}", type=int, default=0, help=f"Gated DeltaNet layers: {what} (0: as for "
                       f"softmax attention, --n-head heads of --n-embd / --n-head)")
    p.add_argument("--gdn-parallel", choices=["ulysses", "context"], default="ulysses", help="how Gated DeltaNet "
                   "layers run under SP: ulysses, whole value heads of the whole sequence a rank (at most one rank a "
                   "value head, no ring); context, each rank its tokens, the state's summaries gathered (any --sp, "
                   "beside a ring)")
    p.add_argument("--data", help="a text file to train on, as bytes (default: the copy task)")
    p.add_argument("--pack", action="store_true", help="several documents in each sequence (text: its paragraphs; "
                   "copy task: documents of random lengths); attention stays inside each document")
    p.add_argument("--balance", choices=["zigzag", "documents"], help="how a ring's ranks share the tokens: zigzag "
                   "balances one sequence's causal work, documents each packed document's (default: documents with "
                   "--pack and no Gated DeltaNet layers, else zigzag)")
    p.add_argument("--zero", choices=["0", "3", "fsdp2"], help="3: zero3.py shards params, grads and AdamW state "
                   "over all ranks (the default with more than one); 0: no sharding; fsdp2: PyTorch's fully_shard")
    p.add_argument("--tiles", type=int, default=1, help="run the MLP and the loss over this many sequence tiles")
    p.add_argument("--loss-tiles", type=int, default=0, help="the loss's own tile count, where its logits (vocabulary "
                   "entries a token) want more tiles than the MLP (0: --tiles)")
    p.add_argument("--recompute", action="store_true", help="keep only block inputs for backward; recompute there")
    p.add_argument("--offload", action="store_true", help="with --recompute, on a GPU: block inputs in CPU memory")
    p.add_argument("--offload-optimizer", action="store_true", help="ZeRO-3's float32 shards, their gradients and "
                   "AdamW's state in CPU memory, and AdamW's step there; the device keeps only the gathered units")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="what matmuls, attention and the all-to-alls "
                   "compute in (default: bfloat16 on CUDA and for --plan, else float32); parameters, AdamW state, "
                   "gradient sums and checkpoints stay float32")
    p.add_argument("--compile", action="store_true", help="compile each block with torch.compile (inductor), the "
                   "all-to-alls traced through; --tiles' MLP and packed documents' attention without a ring run "
                   "eagerly between each block's graphs; the first step of each new shape compiles")
    p.add_argument("--out-dir", help="write checkpoints here (at the end, and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=0, help="also write a checkpoint every N steps (0: at the end "
                   "only)")
    p.add_argument("--keep", type=int, default=0, help="keep only the newest N checkpoints in --out-dir (0: all)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir that "
                   "passes verification")
    p.add_argument("--new-schedule", action="store_true", help="with --resume: accept --steps, --lr or --warmup "
                   "other than the checkpoint's (the learning rate moves to the new schedule at once)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait for a peer")
    p.add_argument("--backend", choices=["nccl", "gloo"], default="nccl", help="what carries the collectives of CUDA "
                   "tensors: nccl, or gloo through host memory, which lets several ranks share one GPU")
    p.add_argument("--metrics", help="write one JSON line per optimizer step to this file (its folder is made if "
                   "missing); with --plan, one line: the traced peaks and the longest sequence that fits")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the model computes; the default is cuda on a machine where torch finds a GPU")
    p.add_argument("--plan", metavar="NxG", help="trace the training step on fake tensors as on N GPUs of G GiB (one "
                   "process, no GPU): print its peak memory per GPU and the longest sequence that fits, and exit")
    p.add_argument("--dry-run", action="store_true", help="accepted with --plan, for older commands: --plan "
                   "alone traces the step and runs nothing")
    preset = p.parse_known_args(argv)[0].model  # a preset's shape stands in for the defaults of the model flags
    p.set_defaults(**PRESETS.get(preset, {}))
    return p.parse_args(argv)


def check_args(args, world_size):
    """Fill in the defaults that depend on the world size, and refuse every flag value a run cannot use."""
    preset = PRESETS.get(args.model, {})  # its values stand in for the defaults: not given
    for flag, given in (("n-kv-head", args.n_kv_head not in (None, preset.get("n_kv_head"))), ("window", args.window),
                        ("rope-base", args.rope_base not in (10000.0, preset.get("rope_base"))), ("sinks", args.sinks)):
        if given and set(args.layer_pattern) == {"d"}:  # before their values' checks
            fail(f"--{flag} shapes softmax attention, and --layer-pattern {args.layer_pattern} has no a layer; drop "
                 f"--{flag}, or put an a in --layer-pattern")
    args.sp = world_size if args.sp is None else args.sp
    args.n_kv_head = args.n_head if args.n_kv_head is None else args.n_kv_head
    args.zero = ("3" if world_size > 1 or args.offload_optimizer else "0") if args.zero is None else args.zero
    args.dtype = ("bfloat16" if args.device == "cuda" or args.plan else "float32") if args.dtype is None else args.dtype
    args.n_layer = max(2, len(args.layer_pattern)) if args.n_layer is None else args.n_layer
    args.lr = (5e-4 if "d" in args.layer_pattern else 1e-3) if args.lr is None else args.lr
    args.warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
    if args.balance and args.ring == 1:  # given, with no ring to share
        fail(f"--balance {args.balance} chooses how a ring's ranks share the tokens; add --ring 2 or more, or drop it")
    if args.ring > 1:  # a default only where a ring reads it: this check runs twice on CUDA, and it is not "given"
        args.balance = args.balance or ("documents" if args.pack and "d" not in args.layer_pattern else "zigzag")
    zero_means_default = ("window", "warmup", "save_every", "keep", "gdn_k_heads", "gdn_v_heads", "gdn_k_dim",
                          "gdn_v_dim", "intermediate_size", "loss_tiles")
    for name in ("seq_len", "batch_size", "grad_accum", "steps", "n_layer", "n_head", "n_kv_head", "n_embd", "tiles",
                 *zero_means_default):
        least = 0 if name in zero_means_default else 1  # window 0: full; save_every 0: at the end; keep 0: all
        if getattr(args, name) < least:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least {least}")
    if args.vocab_size < 256:
        fail(f"--vocab-size {args.vocab_size} must be at least 256: the data's tokens are bytes, 0 to 255")
    for name, zero_allowed in (("lr", False), ("rope_base", False), ("weight_decay", True), ("grad_clip", True),
                               ("timeout", False)):
        value = getattr(args, name)
        if not (math.isfinite(value) and (value >= 0 if zero_allowed else value > 0)):
            fail(f"--{name.replace('_', '-')} {value:g} must be a finite number "
                 f"{'of 0 or more' if zero_allowed else 'above 0'}")
    if args.timeout < 1:  # setting up the process group alone takes longer
        fail(f"--timeout {args.timeout:g} must be at least 1 second")
    if args.timeout > WEEK:  # a collective's deadline is a timedelta, which ends at 1e9 days; nobody waits a week
        fail(f"--timeout {args.timeout:g} must be at most {WEEK} seconds (a week)")
    if not 0 <= args.seed < 2**32:
        fail(f"--seed {args.seed} must be in [0, 2**32)")
    gdn = [f"--gdn-{part}" for part in ("k-heads", "v-heads", "k-dim", "v-dim")
           if getattr(args, "gdn_" + part.replace("-", "_"))]
    if set(args.layer_pattern) == {"a"} and (gdn or args.gdn_parallel != "ulysses"):  # before their values' checks
        fail(f"{(gdn or ['--gdn-parallel'])[0]} shapes Gated DeltaNet layers, and --layer-pattern {args.layer_pattern} "
             f"has no d layer; drop it, or put a d in --layer-pattern")
    try:
        cfg = model_config(args)
    except ValueError as e:
        fail(e)
    if args.sp < 1 or world_size % args.sp:
        fail(f"--sp {args.sp} does not divide the world size {world_size}; choose --sp in {divisors(world_size)}")
    if args.seq_len < args.sp:
        fail(f"--seq-len {args.seq_len} is smaller than --sp {args.sp}: every rank needs at least one token")
    if args.ring < 1 or args.sp % args.ring:
        fail(f"--ring {args.ring} does not divide --sp {args.sp}; choose --ring in {divisors(args.sp)}")
    refusal = ring_refusal(args)
    if args.ring > 1 and refusal:
        fail(f"--ring {args.ring} cannot be used with {refusal}; use --ring 1")
    if "a" in args.layer_pattern and args.sp // args.ring > args.n_head:  # a Ulysses rank would hold no head
        gdn_ulysses = "d" in args.layer_pattern and args.gdn_parallel == "ulysses"  # its layers' value heads split too
        heads = min(args.n_head, cfg.gdn_v_heads) if gdn_ulysses else args.n_head
        sps = [p for p in range(1, min(world_size, heads) + 1) if world_size % p == 0]  # each rank a head of each layer
        rings = [r for r in range(2, args.sp + 1) if args.sp % r == 0 and args.sp // r <= args.n_head]
        ring_too = "" if refusal else f", or --ring in {{{', '.join(map(str, rings))}}}"
        fail(f"--sp {args.sp} with --ring {args.ring} puts {args.sp // args.ring} ranks in each Ulysses group, more "
             f"than --n-head {args.n_head}: a rank would hold no head; choose --sp in {{{', '.join(map(str, sps))}}}"
             f"{ring_too}")
    try:
        if "a" in args.layer_pattern:
            ulysses.head_layout(args.n_head, args.n_kv_head, args.sp // args.ring)
    except ValueError as e:
        fail(e)
    if "d" in args.layer_pattern and args.gdn_parallel == "ulysses" and args.sp > cfg.gdn_v_heads:
        sps = [p for p in range(1, cfg.gdn_v_heads + 1) if world_size % p == 0]
        fail(f"--sp {args.sp} is larger than the {cfg.gdn_v_heads} value heads of a Gated DeltaNet layer: a rank would "
             f"hold none; choose --sp in {{{', '.join(map(str, sps))}}}, or more --gdn-v-heads, or --gdn-parallel "
             f"context")
    if args.balance == "documents" and not (args.pack and "d" not in args.layer_pattern):
        fail("--balance documents shares each packed document's work over a ring's ranks: it needs --pack, and no "
             "Gated DeltaNet layers (their context-parallel state runs in the zigzag order); use --balance zigzag")
    if args.offload and not args.recompute:
        fail("--offload keeps the block inputs that --recompute saves in CPU memory; add --recompute")
    if args.offload_optimizer and args.zero != "3":
        fail(f"--offload-optimizer moves ZeRO-3's shards and AdamW to CPU memory; use --zero 3, not --zero {args.zero}")
    if args.dry_run and not args.plan:
        fail("--dry-run traces the run that --plan NxG describes: add --plan, e.g. --plan 8x80")
    if args.device == "cuda" and not torch.cuda.is_available() and args.plan is None:
        fail("--device cuda, but torch sees no CUDA device; choose --device cpu")
    if (args.resume or args.save_every or args.keep) and args.out_dir is None:
        fail("--resume, --save-every and --keep need --out-dir")
    if args.new_schedule and not args.resume:
        fail("--new-schedule accepts another schedule than the checkpoint's on --resume; add --resume, or drop it")
    restarts, run_id = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)), os.environ.get("TORCHELASTIC_RUN_ID")
    if args.out_dir and restarts and run_id == "none":  # torchrun --master-addr without --rdzv-id: every run's id
        fail("--out-dir with torchrun --max-restarts needs torchrun's --rdzv-id=NAME (this run's name): a restarted "
             "run resumes only its own run's checkpoints, and without a name every run is called 'none'")


def divisors(n):
    return "{" + ", ".join(str(d) for d in range(1, n + 1) if n % d == 0) + "}"


def ring_refusal(args):
    """The flag that keeps a ring from running, with the reason; "" when a ring can run."""
    if "d" in args.layer_pattern and args.gdn_parallel == "ulysses":
        return ("--gdn-parallel ulysses: its Gated DeltaNet layers need whole heads of the whole sequence "
                "(--gdn-parallel context runs beside a ring)")
    return ""


def model_config(args):
    return GPTConfig(**{name: getattr(args, name) for name in MODEL_FIELDS}, tiles=args.tiles,
                     loss_tiles=args.loss_tiles, recompute=args.recompute, offload=args.offload,
                     gdn_parallel=args.gdn_parallel)


def model_flags(args):
    """What shapes the model, as GPTConfig resolves it (so --gdn-k-heads 0 and the head count it stands for agree)."""
    cfg = model_config(args)
    return {name: getattr(cfg, name) for name in MODEL_FIELDS}


# ----------------------------------------------------------------------------------------------------------------
# 2. the process groups and the mesh


@contextmanager
def started(args):
    """Everything a run does before it builds its model, on every rank: the flags checked on each rank alone
    (`check_args`), the process groups and the mesh (`process_groups`), then what each rank finds on its own machine,
    agreed by all (`this_machine`): --data read, the folders of --metrics and --out-dir made, and --data's bytes the
    same everywhere. Yields the run: device, mesh, control, rank, world_size, documents (None: the copy task) and
    data_sha256 (None: the copy task)."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    check_args(args, world_size)  # the flags alone: every rank finds the same mistake, before any wait
    with process_groups(args, world_size) as (device, mesh, control):
        documents, data_sha256 = agreed(control, partial(this_machine, args))  # files may differ between machines
        same_everywhere(control, {"the bytes of --data (SHA-256)": data_sha256})  # a stale copy on one node?
        yield SimpleNamespace(device=device, mesh=mesh, control=control, rank=dist.get_rank(), world_size=world_size,
                              documents=documents, data_sha256=data_sha256)


def local_gpu(args):
    """(this rank's GPU, the ranks of its machine that share it): its LOCAL_RANK's own, or with --backend gloo, the
    ranks past the GPUs sharing them in turn."""
    local_rank, ranks = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count()
    return (local_rank % gpus, math.ceil(ranks / gpus)) if args.backend == "gloo" else (local_rank, 1)


@contextmanager
def process_groups(args, world_size):
    """The device, the process group (with a timeout, so a dead peer ends the run), the dp x ring x ulysses mesh,
    and the gloo control group over every rank, whose waits have no --timeout deadline (how long a rank takes to
    check its files depends on its storage; a dead peer is ended by torchrun). While the block runs, every rank
    beats (`pulse`), and a collective that fails ends its rank with one line (`collective_failure`). At its end
    the groups are destroyed, those this run made."""
    if args.device == "cuda":
        device = torch.device("cuda", local_gpu(args)[0])
        torch.cuda.set_device(device)
    else:  # the processes of one machine share its cores, unless OMP_NUM_THREADS says how many threads each takes
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        device = torch.device("cpu")
    owns_process_group = not dist.is_initialized()
    if owns_process_group:
        backend, timeout = collectives_backend(device.type, args.backend), datetime.timedelta(seconds=args.timeout)
        if "MASTER_ADDR" in os.environ:  # torchrun
            # The processes meet through a key-value store (torchrun's agent hosts it). After torchrun restarts the
            # group, the store still holds the addresses of the processes that died; keys prefixed with the restart
            # count keep the new processes from dialling the old ones.
            rank, hosted = int(os.environ["RANK"]), os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                  is_master=rank == 0 and not hosted, timeout=timeout)
            store = dist.PrefixStore(f"restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
            try:
                dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                        device_id=device if backend == "nccl" else None)
            except RuntimeError as e:  # a rank that never came (its flags failed on its own node, say)
                fail(f"the {world_size} ranks did not all join within --timeout {args.timeout:g} s; look for the "
                     f"line of a rank that stopped ({str(e).splitlines()[0]})", alike=False)
        else:  # plain `python train.py`: a group of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    # the flags shape every collective to come, so the ranks compare them first (paths may differ by machine)
    flags = {**{f"--{name.replace('_', '-')}": value for name, value in vars(args).items()
                if name not in ("data", "metrics", "out_dir")}, "whether --out-dir is given": args.out_dir is not None,
             "whether --metrics is given": args.metrics is not None}  # rank 0 alone writes them: its node must have it
    control, mesh = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1)), None
    try:
        with pulse(dist.get_rank()):
            try:
                same_everywhere(control, flags)
                mesh = device_mesh(args, world_size, device.type)
                yield device, mesh, control
            except RuntimeError as e:  # outside the steps (report.Log names a step's failure)
                raise collective_failure(e, dist.get_rank(), args.timeout)
    finally:
        dist.destroy_process_group(control)
        if owns_process_group:
            dist.destroy_process_group()  # and every group made on it
        else:  # the caller's group lives on: the mesh's own groups go
            for group in {mesh.get_group(name) for name in mesh.mesh_dim_names} if mesh is not None else ():
                if group != dist.group.WORLD:  # a mesh dimension that spans every rank reuses the caller's group
                    dist.destroy_process_group(group)


def collectives_backend(device_type, choice):
    """gloo on CPU; on CUDA, nccl, or gloo for the CUDA tensors too (staged through host memory)."""
    return "gloo" if device_type == "cpu" else "nccl" if choice == "nccl" else "cpu:gloo,cuda:gloo"


def device_mesh(args, world_size, device_type):
    """The dp x ring x ulysses mesh over the process group. Its ranks are arange(world).view(dp, ring, ulysses): an
    SP group is sp consecutive ranks, a Ulysses group sp/ring consecutive ranks (the fastest links), and a ring the
    ranks at the same place in each Ulysses group."""
    return init_device_mesh(device_type, (world_size // args.sp, args.ring, args.sp // args.ring),
                            mesh_dim_names=("dp", "ring", "ulysses"))


def pulse(rank, every=0.5):
    """A beat of this rank while the block runs: a counter in the process group's store, one more every `every`
    seconds, so that a rank whose collective failed can tell which peers are gone (lost_ranks)."""
    store, gone = dist.distributed_c10d._get_default_store(), []

    def beat():
        if not gone:  # once the store has gone with its host (lost_ranks says so), no more beats: each would warn
            try:
                store.add(f"pulse_{rank}", 1)
            except RuntimeError:
                gone.append(True)
    return repeating(beat, every)


def lost_ranks(world_size, wait=3.0):
    """The ranks whose pulse stopped: their counters do not move for `wait` seconds. None if the store cannot be
    read (it lives with rank 0's launcher, which may be what was lost)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        count = lambda: [store.add(f"pulse_{r}", 0) for r in range(world_size)]
        before = count()
        time.sleep(wait)
        return [r for r, (b, a) in enumerate(zip(before, count())) if a == b]
    except RuntimeError:
        return None


# ----------------------------------------------------------------------------------------------------------------
# 3. what one rank finds alone, agreed by all


def this_machine(args):
    """What a rank checks on its own machine: --data, read (its documents, None for the copy task, and the SHA-256
    of the bytes read), and the folders that --metrics (rank 0 writes it) and --out-dir write into."""
    if args.out_dir is not None and args.resume and not os.path.isdir(args.out_dir):  # no folder made for nothing
        fail(f"--resume: no complete checkpoint in --out-dir {args.out_dir} (no such folder)")
    documents = read_data(args)
    if int(os.environ.get("RANK", 0)) == 0 and args.metrics:
        check_metrics(args.metrics)
    if args.out_dir is not None:
        make_folder("--out-dir", args.out_dir)
    return documents, None if documents is None else documents.sha256


def read_data(args):
    """--data's documents as a run reads them (None: the copy task); one line if it cannot."""
    try:
        return None if args.data is None else data.read_documents(args.data, args.pack, args.seq_len)
    except ValueError as e:
        fail(f"--data {args.data}: {e}")


def check_metrics(path):
    """The file --metrics names: not a directory, in a folder that can be made and written; one line if not."""
    if os.path.isdir(path):
        fail(f"--metrics {path} is a directory; give a file name, e.g. {os.path.join(path, 'metrics.jsonl')}")
    make_folder("--metrics", os.path.dirname(os.path.abspath(path)))


def make_folder(flag, folder):
    """The folder a flag writes into, made if missing; one line if it cannot be made or written."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        fail(f"{flag}: cannot make the folder {folder} ({e.strerror})")
    if not os.access(folder, os.W_OK):
        fail(f"{flag}: cannot write into {folder}")


def gathered(control, value):
    """Every rank's value, in rank order, on every rank (one small all-gather)."""
    values = [None] * dist.get_world_size(control)
    dist.all_gather_object(values, value, group=control)
    return values


def agreed(control, work):
    """Run work() on every rank and return its result; if it raises a Mistake on any rank, every rank stops."""
    try:
        result, problem = work(), None
    except Mistake as e:
        result, problem = None, str(e)
    stop_on(gathered(control, problem), dist.get_rank(control))
    return result


def stop_on(problems, rank):
    """problems: one line or None per rank, the same list on every rank. If there is one, every rank exits 1.
    The first rank with one prints it, naming itself unless every rank found the same; so does the first rank of
    every other node, so that each node's log says why its run failed. (torchrun numbers the ranks node by node,
    LOCAL_WORLD_SIZE a node.)"""
    if any(problems):
        first = next(r for r, p in enumerate(problems) if p)
        if all(p == problems[first] for p in problems):
            fail(problems[first])  # alike: each node's first rank says it
        node = lambda r: r // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        if rank == first or (int(os.environ.get("LOCAL_RANK", 0)) == 0 and node(rank) != node(first)):
            raise SystemExit(f"train.py: error: rank {first}: {problems[first]}")
        leave_quietly(1)


def same_everywhere(control, values):
    """Stop every rank unless `values`, {what: value}, are the same on every rank: nodes started by hand with other
    flags, or a stale copy of the data on one node, would otherwise fail in a collective far from the cause, or
    train silently wrong. One small all-gather."""
    everyone = gathered(control, values)
    for what in values:
        differ = [r for r, theirs in enumerate(everyone) if theirs[what] != everyone[0][what]]
        if differ:
            fail(f"the ranks disagree on {what}: rank 0 has {everyone[0][what]}, rank {differ[0]} has "
                 f"{everyone[differ[0]][what]} (ranks {differ} differ from rank 0); start every rank with the same "
                 f"flags and data")


# ----------------------------------------------------------------------------------------------------------------
# 4. a collective that fails


def collective_failure(error, rank, timeout, step=None):
    """A collective that failed (a peer died, or waited past --timeout) as one line naming it, the step it was in
    (if any) and the ranks that are lost, those whose pulse stopped; other errors as they are."""
    if dist.get_world_size() == 1:  # no peer to lose: a bug, with its traceback
        return error
    frames = traceback.extract_tb(error.__traceback__)
    names = [f.name for f in frames if f.filename.endswith("distributed_c10d.py")]
    message = str(error).lower()
    if names:
        collective = names[-1]
    elif "gloo" in message or "nccl" in message:
        collective = f"the collective waited on at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"
    else:
        return error
    lost, per_node = lost_ranks(dist.get_world_size()), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if lost is None:
        lost = "which peer is lost cannot be told: the store that the ranks beat in is gone too"
    else:
        lost = "lost: " + (", ".join(f"rank {r} (node {r // per_node})" for r in lost) or "none silent now")
    where = "" if step is None else f", step {step + 1}"
    return SystemExit(f"train.py: error: rank {rank}{where}: {collective} failed (a peer process died, or "
                      f"waited longer than --timeout {timeout:g} s); {lost}: {str(error).splitlines()[0]}")


# ----------------------------------------------------------------------------------------------------------------
# no run sits silent


@contextmanager
def repeating(action, every):
    """Call action() from a thread at the start of the block and every `every` seconds while it runs; the last
    call has returned when the block ends."""
    stop = threading.Event()

    def loop():
        action()
        while not stop.wait(every):
            action()
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class StepProgress:
    """What a long step is doing, on rank 0's progress bar: once a step has run for `every` seconds, a thread
    writes there, every `every` seconds, how long it has run and the layer it is in (forward or backward, from
    hooks on the blocks), so that a step of minutes (a long sequence on a CPU) never sits silent."""

    def __init__(self, model, bar, every=5.0):
        self.bar, self.every, self.step, self.started, self.where = bar, every, 0, None, "before the first layer"
        self.stop = threading.Event()
        if bar.disable:  # not rank 0
            return
        self.in_backward = False
        model.register_forward_pre_hook(lambda *hook_args: setattr(self, "in_backward", False))  # a micro-step
        for i, block in enumerate(model.blocks):
            layer = f"layer {i + 1}/{len(model.blocks)}"
            block.register_forward_pre_hook(partial(self._forward, layer))
            block.register_forward_hook(partial(self._backward_ahead, layer))
        threading.Thread(target=self._show, daemon=True).start()

    def _forward(self, layer, *hook_args):
        self.where = f"{layer} backward, recomputing its forward" if self.in_backward else f"{layer} forward"

    def _backward_ahead(self, layer, module, args, output):
        if output.requires_grad:  # its gradient arrives when this layer's backward starts
            output.register_hook(partial(self._backward, layer))

    def _backward(self, layer, grad):
        self.in_backward, self.where = True, f"{layer} backward"

    def begin(self, step):
        self.step, self.started, self.where = step, time.monotonic(), "before the first layer"

    def end(self):
        self.started = None

    def close(self):
        self.stop.set()

    def _show(self):
        while not self.stop.wait(self.every):
            started = self.started
            if started is not None and time.monotonic() - started >= self.every:
                self.bar.set_postfix_str(f"step {self.step + 1}: {time.monotonic() - started:.0f} s in, {self.where}")
