"""
Train a small GPT with Ulysses sequence parallelism (SP), data parallelism (DP) and ZeRO-3 over both.

    python train.py                                             # one process (dp 1 x sp 1)
    torchrun --standalone --nproc_per_node=4 train.py           # dp 1 x sp 4 (--sp defaults to all ranks)
    torchrun --standalone --nproc_per_node=4 train.py --sp 2    # dp 2 x sp 2
    torchrun --standalone --nproc_per_node=4 train.py --sp 4 --ring 2 --n-head 2  # Ulysses 2 x ring 2 (ring.py)
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 --nproc_per_node=8 \
        train.py --sp 8 --n-head 8                              # two nodes (node_rank=1 on the other)
    python train.py --data input.txt                            # any text file, as bytes (vocab 256)
    torchrun --standalone --nproc_per_node=4 --max-restarts=1 train.py --out-dir runs/ckpt --save-every 50

The default data (data.py) is a copy task: random tokens followed by the same tokens again, and only the copy is
scored. Under SP the copy lives on other ranks than the original, so the task cannot be learned unless attention
really crosses the sequence shards.

One optimizer step, on every rank of the dp x sp mesh (the code cites these numbers; steps 2, 3, 4 and 5-6 are
rules 1, 2, 3 and 4 of ulysses.py):
  1. each DP rank draws its own micro-batches of full sequences; the sp ranks of an SP group draw the same ones;
  2. the labels are shifted by one before any sharding (a shard's last label is the next shard's first token);
  3. sequences are padded at the end to a multiple of sp (label -100), and SP rank r keeps tokens
     [r*S/sp, (r+1)*S/sp) with their GLOBAL position ids (ulysses.shard_for_sp; with --ring, the zigzag order);
  4. forward on the local tokens: embeddings, norms, MLP and loss per token, attention through two all-to-alls
     per layer (ulysses.ulysses_attention);
  5. loss = this rank's SUM of token losses / the valid tokens of the WHOLE global batch, all dp x sp ranks and
     micro-steps (ulysses.global_valid_tokens); a batch without valid tokens gives 0, never NaN;
  6. backward; gradients are SUMMED over all dp x sp ranks (ZeRO-3 reduce-scatters with SUM). With step 5 this
     is exactly the gradient one device would compute on the global batch: no 1/sp or 1/dp factor anywhere;
  7. clip by the global gradient norm; sum the loss and accuracy of the global batch for the log (a non-finite
     loss stops the run here, before the update); AdamW updates this rank's shard; the next forward gathers
     the new weights.
"""

import argparse
import datetime
import errno
import fcntl
import hashlib
import json
import math
import os
import shutil
import socket
import threading
import time
import traceback
from contextlib import contextmanager, suppress
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.modules.module import register_module_forward_pre_hook
from tqdm import tqdm

import data
import ring
import ulysses
from gpt import GPT, GPTConfig
from zero3 import ZeRO3, fsdp2_shard, held, load_pieces, optimizer_scalars, prepare_optimizer, whole

WEEK = 7 * 24 * 3600
MODEL_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "window", "layer_pattern", "gdn_k_heads", "gdn_v_heads",
                "gdn_k_dim", "gdn_v_dim")  # what shapes the model


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default; a default of None (the help says what stands in) or a switch's False
    is left out."""

    def _get_help_string(self, action):
        return action.help if action.default is None or action.default is False else super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Ulysses sequence-parallel GPT training", allow_abbrev=False,
                                formatter_class=HelpFormatter)
    p.add_argument("--sp", type=int, help="sequence-parallel size (default: every rank); dp = world size / sp")
    p.add_argument("--ring", type=int, default=1, help="ring degree R: each SP group of --sp ranks is a ring of R "
                   "Ulysses groups of sp/R ranks (Ulysses x Ring, ring.py); 1: Ulysses alone")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, before padding to a multiple of sp")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per DP rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--lr", type=float, help="peak learning rate (default 1e-3; 5e-4 with Gated DeltaNet layers)")
    p.add_argument("--warmup", type=int, help="warmup steps (default: steps/10)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay, on every parameter")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p.add_argument("--seed", type=int, default=0, help="fixes the initial model and the samples (packed text "
                   "is read in order)")
    p.add_argument("--n-layer", type=int, help="layers (default: 2, or the length of --layer-pattern)")
    p.add_argument("--n-head", type=int, default=4, help="query heads of softmax attention")
    p.add_argument("--n-kv-head", type=int, help="key/value heads (default: n_head)")
    p.add_argument("--n-embd", type=int, default=128, help="hidden size")
    p.add_argument("--window", type=int, default=0, help="sliding-window attention over this many tokens (0: full)")
    p.add_argument("--layer-pattern", default="a", help="each layer's kind, repeated over the layers: a = softmax "
                   "attention, d = Gated DeltaNet (linear attention); e.g. ddda")
    for part, what in (("k-heads", "key heads (q, k)"), ("v-heads", "value heads (v, the state; a multiple of the key "
                       "heads)"), ("k-dim", "dims of a key head"), ("v-dim", "dims of a value head")):
        p.add_argument(f"--gdn-{part}", type=int, default=0, help=f"Gated DeltaNet layers: {what} (0: as for "
                       f"softmax attention, --n-head heads of --n-embd / --n-head)")
    p.add_argument("--data", help="a text file to train on, as bytes (default: the copy task)")
    p.add_argument("--pack", action="store_true", help="several documents in each sequence (text: its paragraphs; "
                   "copy task: documents of random lengths); attention stays inside each document")
    p.add_argument("--zero", choices=["0", "3", "fsdp2"], help="3: zero3.py shards params, grads and AdamW state "
                   "over all ranks (the default with more than one); 0: no sharding; fsdp2: PyTorch's fully_shard")
    p.add_argument("--tiles", type=int, default=1, help="run the MLP and the loss over this many sequence tiles")
    p.add_argument("--recompute", action="store_true", help="keep only block inputs for backward; recompute there")
    p.add_argument("--offload", action="store_true", help="with --recompute, on CUDA: block inputs in CPU memory")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="what matmuls, attention and the all-to-alls "
                   "compute in (default: bfloat16 on CUDA and for --plan, else float32); parameters, AdamW state, "
                   "gradient sums and checkpoints stay float32")
    p.add_argument("--compile", action="store_true", help="compile each block with torch.compile (inductor), the "
                   "all-to-alls traced through; the first step of each new shape compiles")
    p.add_argument("--out-dir", help="write checkpoints here (at the end, and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=0, help="also write a checkpoint every N steps (0: at the end "
                   "only)")
    p.add_argument("--keep", type=int, default=0, help="keep only the newest N checkpoints in --out-dir (0: all)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir that "
                   "passes verification")
    p.add_argument("--new-schedule", action="store_true", help="with --resume: accept --steps, --lr or --warmup "
                   "other than the checkpoint's (the learning rate moves to the new schedule at once)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait for a peer")
    p.add_argument("--metrics", help="write one JSON line per optimizer step to this file (its folder is made if "
                   "missing)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--plan", metavar="NxG", help="print the predicted memory per rank on N GPUs of G GiB, and exit")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    try:  # the flags alone: every rank finds the same mistake, before any process waits on another
        if args.plan:
            if not plan(args):
                raise SystemExit(1)  # its line says why
            return True
        check_args(args, world_size)
    except Mistake as e:
        raise SystemExit(f"train.py: error: {e}" if rank == 0 else 0) from None  # rank 0 says it, once
    owns_process_group = not dist.is_initialized()
    device, mesh, control = setup(args, world_size)
    lock = None
    try:
        # what depends on this machine (files, free memory) may differ between ranks: they agree before going on
        documents = agreed(control, partial(prepare, args, world_size, rank))
        if args.out_dir:  # then rank 0 alone holds the out-dir for this run
            lock = agreed(control, lambda: lock_out_dir(args.out_dir) if rank == 0 else None)
        checkpoint = find_checkpoint(args, world_size, control)
        return train(args, world_size, mesh, device, documents, checkpoint, control)
    except Mistake as e:
        raise SystemExit((f"train.py: error: {e}" if rank == 0 else 0) if e.alike else
                         f"train.py: error: rank {rank}: {e}") from None
    finally:
        if lock:
            lock.close()  # releases the out-dir for the next run
        dist.destroy_process_group(control)
        if owns_process_group:
            dist.destroy_process_group()


def prepare(args, world_size, rank):
    """What each rank checks on its own machine before the run: the memory, the data, the out-dir. Returns the
    documents of --data (None: the copy task)."""
    check_memory(args, world_size)  # a run that cannot fit is refused before it allocates anything
    try:
        documents = None if args.data is None else data.read_documents(args.data, args.pack, args.seq_len)
    except ValueError as e:
        fail(f"--data {args.data}: {e}")
    if rank == 0 and args.metrics:  # rank 0 writes it
        if os.path.isdir(args.metrics):
            fail(f"--metrics {args.metrics} is a directory; give a file name, e.g. "
                 f"{os.path.join(args.metrics, 'metrics.jsonl')}")
        make_folder("--metrics", os.path.dirname(os.path.abspath(args.metrics)))
    if args.out_dir is not None:
        make_folder("--out-dir", args.out_dir)
    return documents


def make_folder(flag, folder):
    """The folder a flag writes into, made if missing; one line if it cannot be made or written."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        fail(f"{flag}: cannot make the folder {folder} ({e.strerror})")
    if not os.access(folder, os.W_OK):
        fail(f"{flag}: cannot write into {folder}")


def setup(args, world_size):
    """Device, process group (with a timeout, so a dead peer ends the run), the dp x sp mesh, and a gloo group
    over every rank for agreeing on problems before the run and on which checkpoint verifies, whose wait has no
    --timeout deadline (how long a rank takes to check its part of a checkpoint depends on the storage; a dead peer
    is ended by torchrun)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:  # the processes of one machine share its cores, unless OMP_NUM_THREADS says how many threads each takes
        if "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend, timeout = ("nccl" if device.type == "cuda" else "gloo"), datetime.timedelta(seconds=args.timeout)
        if "MASTER_ADDR" in os.environ:  # torchrun
            # The processes meet through a key-value store (torchrun's agent hosts it). After torchrun restarts the
            # group, the store still holds the addresses of the processes that died; keys prefixed with the restart
            # count keep the new processes from dialling the old ones.
            rank, hosted = int(os.environ["RANK"]), os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                                  is_master=rank == 0 and not hosted, timeout=timeout)
            store = dist.PrefixStore(f"restart_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                    device_id=device if device.type == "cuda" else None)
        else:  # plain `python train.py`: a group of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    mesh = init_device_mesh(device.type, (world_size // args.sp, args.ring, args.sp // args.ring),
                            mesh_dim_names=("dp", "ring", "ulysses"))
    # mesh ranks = arange(world).view(dp, ring, ulysses): an SP group is sp consecutive ranks, a Ulysses group
    # sp/ring consecutive ranks (the fastest links), and a ring the ranks at the same place in each Ulysses group
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=1))
    return device, mesh, control


def train(args, world_size, mesh, device, documents, checkpoint, control):
    dp, sp_groups = world_size // args.sp, (mesh.get_group("ulysses"), mesh.get_group("ring"))
    rank, dp_rank = dist.get_rank(), mesh.get_local_rank("dp")

    torch.manual_seed(args.seed)  # every rank builds the same initial model
    model = GPT(model_config(args), *sp_groups).to(device)
    if args.compile:  # each block's forward on its own, as torchtitan does; hooks (ZeRO-3's gathers) stay eager
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    n_params = sum(p.numel() for p in model.parameters())
    compute_dtype = torch.bfloat16 if args.dtype == "bfloat16" else None  # what ZeRO-3 and FSDP2 gather
    zero = None  # ZeRO-3 and FSDP2 shard over every rank: the dp x sp mesh flattened, i.e. the world group
    # (FSDP2 shards the model's own parameters in place, so with it `zero` stays None)
    if args.zero == "3":
        zero = ZeRO3(model, model.units(), group=dist.group.WORLD, compute_dtype=compute_dtype)
    elif args.zero == "fsdp2":
        fsdp2_shard(model, model.units(), dist.group.WORLD, compute_dtype=compute_dtype)
    optimizer = torch.optim.AdamW(zero.parameters() if zero else model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)
    start_step = restore(checkpoint, model, zero, optimizer, rank) if checkpoint else 0
    gathered(control, None)  # every rank has loaded (however long its storage took) before the first collective
    if rank == 0:
        usp = f" (ulysses {args.sp // args.ring} x ring {args.ring})" if args.ring > 1 else ""
        print(f"world {world_size} = dp {dp} x sp {args.sp}{usp} | zero {args.zero} | {n_params / 1e6:.2f}M parameters "
              f"| "
              f"seq {args.seq_len} | global batch {dp * args.batch_size * args.grad_accum} sequences | {device} | "
              f"{args.dtype} | predicted peak {predicted(args, world_size)['peak'] / 2**20:,.2f} MiB per rank")
        if documents is not None:
            samples = args.steps * dp * args.batch_size * args.grad_accum
            print(f"data {args.data}: {data.describe(documents, args.pack, args.seq_len, samples)}")

    memory = PeakMemory(model, optimizer, zero, device)
    metrics = open_metrics(args, start_step) if rank == 0 else None
    history = []
    ulysses.reset_all_to_all_stats()
    ring.reset_ring_stats()
    bar = tqdm(range(start_step, args.steps), disable=rank != 0, dynamic_ncols=True, initial=start_step,
               total=args.steps)
    progress = StepProgress(model, bar)
    step = start_step
    try:
        for step in bar:
            t0 = time.perf_counter()
            progress.begin(step)
            micro_batches = [load_micro_batch(args, documents, step, micro, dp, dp_rank, sp_groups, device)
                             for micro in range(args.grad_accum)]
            with memory.measure(step == args.steps - 1):  # every step is alike: the last one is measured
                loss, accuracy, grad_norm, lr = train_step(step, micro_batches, model, zero, optimizer, args)
            seconds = time.perf_counter() - t0
            progress.end()
            tokens = dp * args.grad_accum * args.batch_size * args.seq_len  # the global batch's, padding excluded
            history.append({"step": step + 1, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
                            "seconds": seconds, "accuracy": accuracy})
            bar.set_postfix(loss=f"{loss:.4f}", acc=f"{accuracy:.3f}", tok_s=f"{tokens / seconds:.0f}")
            if metrics:
                print(json.dumps(history[-1]), file=metrics, flush=True)
            if args.out_dir and (step + 1 == args.steps or args.save_every and (step + 1) % args.save_every == 0):
                save_checkpoint(args, step + 1, model, zero, optimizer, world_size, rank)
    except RuntimeError as e:
        raise collective_failure(e, rank, step, args) from None
    finally:
        progress.close()
        bar.close()
        if metrics:
            metrics.close()
    if history:  # the summary counts the model state, the last step's gradients included
        history[-1]["peak_bytes"] = memory.peak_bytes
        summarize(args, history, model, optimizer, n_params, world_size, device, rank)
    return history


def train_step(step, micro_batches, model, zero, optimizer, args):
    """One optimizer step on this rank's micro-batches of the global batch. Returns (loss, accuracy, grad_norm,
    lr), the first three for the whole global batch. Leaves the gradients in place (the caller may count them)."""
    device = micro_batches[0][0].device
    optimizer.zero_grad(set_to_none=True)
    # step 5: every micro-batch's loss sum is divided by the valid tokens of the whole global batch
    valid = ulysses.global_valid_tokens([labels for _, labels, _ in micro_batches], dist.group.WORLD)
    loss_sum = correct = 0
    for inputs, labels, position_ids in micro_batches:
        # mixed precision: matmuls and attention in bf16, the rest in float32 (gpt.py says where that is forced)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            micro_loss_sum, micro_correct = model(inputs, position_ids, labels, packed=args.pack)
        (micro_loss_sum / valid).backward()
        loss_sum, correct = loss_sum + micro_loss_sum.detach(), correct + micro_correct
    # step 6: gradients are summed over all dp x sp ranks. ZeRO-3 and FSDP2 reduce-scatter them with SUM during
    # backward; without them, one all-reduce here.
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if args.zero == "0":
        flat_grads = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat_grads, op=dist.ReduceOp.SUM, group=dist.group.WORLD)  # a sum, never an average
        for p, g in zip(params, flat_grads.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
    # step 7: clip, then update
    max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
    grad_norm = zero.clip_grad_norm_(max_norm) if zero else torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()  # FSDP2: DTensor
    totals = torch.stack([loss_sum, correct.float()])
    dist.all_reduce(totals)
    loss, accuracy = (totals / valid).tolist()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # every rank sees the same, so all stop
        fail(f"step {step + 1}: loss {loss}, gradient norm {grad_norm}; stopped before the update, so the last "
             f"checkpoint stays the last good one")
    lr = lr_at(step, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return loss, accuracy, grad_norm, lr


def lr_at(step, args):
    """Linear warmup, then cosine decay to 10% of the peak. A function of the step: resuming needs no state."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def load_micro_batch(args, documents, step, micro, dp, dp_rank, sp_groups, device):
    """Steps 1-3: this DP rank's full sequences of one micro-step (labels shifted by data.make_sample), then this
    SP rank's shard of them: input ids, labels and global position ids, [batch_size, S_pad/sp] each (with a ring,
    in the zigzag order). sp_groups: (Ulysses group, ring group)."""
    indices = data.micro_batch_indices(step, micro, args.grad_accum, dp_rank, dp, args.batch_size)
    samples = [data.make_sample(i, args.seq_len, documents, args.pack, args.seed) for i in indices]
    full = [torch.stack(column) for column in zip(*samples)]  # inputs, labels, position_ids: (B, S) each
    return [t.to(device) for t in ulysses.shard_for_sp(*full, *sp_groups)]  # (B, S_pad/sp) each


def local_tokens(args):
    """This rank's tokens per micro-step: batch_size * S_pad/sp, S padded to a multiple of sp (of 2 sp with a ring,
    whose zigzag order cuts it into 2 x ring chunks)."""
    multiple = args.sp * (2 if args.ring > 1 else 1)
    return args.batch_size * math.ceil(args.seq_len / multiple) * multiple // args.sp


def model_config(args):
    return GPTConfig(**{name: getattr(args, name) for name in MODEL_FIELDS}, tiles=args.tiles,
                     recompute=args.recompute, offload=args.offload)


def model_flags(args):
    """What shapes the model, as GPTConfig resolves it (so --gdn-k-heads 0 and the head count it stands for agree)."""
    cfg = model_config(args)
    return {name: getattr(cfg, name) for name in MODEL_FIELDS}


# ================================================================================================================
# Below this line: what a reader may skip. Checkpoint files, failure handling, memory and reporting.
# ================================================================================================================

# checkpoints: DIR/step_000020/ holds
#   shard_00001-of-00004.pt  what rank 1 of 4 held: a run of each parameter's flattened float32 values and of its
#                            AdamW moments, by parameter name (zero3.held), so any layout reads back what it needs
#   trainer.pt               the step, which fixes the LR schedule and the data position, the flags, the RNG state
#   manifest.json            every file's size and SHA-256, written last
# Every rank writes its own shard at once (unsharded, with --zero 0, each writes 1/N of it), each file flushed to
# disk (fsync) in step_000020.tmp, which rank 0 renames once every rank's marker says its files are there: a
# directory without .tmp is whole. The ranks wait for the markers on the file system, not in a collective, so
# the writing has no --timeout deadline. Loading checks every file against the manifest, the ranks sharing the
# reading, and falls back to the newest checkpoint that passes.

MANIFEST = "manifest.json"


def checkpoints(out_dir, complete=True):
    """The checkpoints in out_dir, newest first: those with a manifest (complete), or those without one."""
    steps = [int(name[5:]) for name in os.listdir(out_dir) if name.startswith("step_") and name[5:].isdigit()
             and os.path.exists(os.path.join(out_dir, name, MANIFEST)) == complete]
    return [os.path.join(out_dir, f"step_{step:06d}") for step in sorted(steps, reverse=True)]


def newest_checkpoint(out_dir):
    return next(iter(checkpoints(out_dir)), None)


def shards(path):
    """The pieces every rank of the layout that wrote the checkpoint held, read lazily (mmap)."""
    with open(os.path.join(path, MANIFEST)) as f:
        names = [name for name in json.load(f)["files"] if name.startswith("shard_")]
    return [torch.load(os.path.join(path, name), mmap=True, weights_only=True) for name in names]


def checkpoint_weights(path):
    """A checkpoint's model weights, whole and by parameter name, in one process, whatever layout wrote it."""
    return whole(shards(path))


def data_flags(args, world_size):
    """What fixes the sequence of batches: resuming with other values trains on other data."""
    global_batch = world_size // args.sp * args.batch_size * args.grad_accum
    return {"seed": args.seed, "seq_len": args.seq_len, "global_batch": global_batch, "data": args.data,
            "pack": args.pack}


def schedule(args):
    """What fixes the learning rate of every step (lr_at)."""
    return {"steps": args.steps, "lr": args.lr, "warmup": args.warmup}


def gathered(control, value):
    """Every rank's value, in rank order, on every rank (one small all-gather)."""
    values = [None] * dist.get_world_size(control)
    dist.all_gather_object(values, value, group=control)
    return values


def agreed(control, work):
    """Run work() on every rank and return its result; if it raises Mistake on any rank, every rank stops."""
    try:
        result, problem = work(), None
    except Mistake as e:
        result, problem = None, str(e)
    stop_on(gathered(control, problem), dist.get_rank(control))
    return result


def stop_on(problems, rank):
    """problems: one line or None per rank, the same list on every rank. If there is one, every rank stops: the
    first rank with one says it (naming itself unless every rank found the same), and the others leave with
    status 0, as the run fails with that rank all the same."""
    if any(problems):
        first = next(r for r, p in enumerate(problems) if p)
        alike = all(p == problems[first] for p in problems)
        raise SystemExit(f"train.py: error: {'' if alike else f'rank {first}: '}{problems[first]}"
                         if rank == first else 0)


def lock_out_dir(out_dir):
    """An exclusive lock on out_dir for this run (flock: the system lifts it when the process ends, however it
    ends); refused if another live run holds it. Removes what an ended run left half-written or half-deleted."""
    lock = open(os.path.join(out_dir, ".lock"), "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if not isinstance(e, BlockingIOError):  # a file system without locks
            lock.close()
            fail(f"--out-dir {out_dir}: cannot lock it ({e.strerror}); choose a directory on a file system that "
                 f"has flock")
        lock.seek(0)
        holder = lock.read().strip() or "running"
        lock.close()
        fail(f"--out-dir {out_dir} is in use by another run ({holder}); wait for it to end, or choose another "
             f"directory")
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    lock.flush()
    for name in os.listdir(out_dir):
        if name.startswith("step_") and name.endswith((".tmp", ".deleting")):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    return lock


class _Hashing:
    """A file that hashes what is written to it (torch.save writes its zip archive in order)."""

    def __init__(self, f):
        self.f, self.digest = f, hashlib.sha256()

    def write(self, data):
        self.digest.update(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def write_files(directory, files):
    """Write {name: object} into directory (torch.save, or JSON for *.json), each flushed to the disk (fsync),
    and return {name: {"bytes", "sha256"}}. A failure is a Mistake naming it, a full disk as such."""
    written = {}
    for name, obj in files.items():
        path = os.path.join(directory, name)
        try:
            os.makedirs(directory, exist_ok=True)
            with open(path, "wb") as f:
                out = _Hashing(f)
                if name.endswith(".json"):
                    out.write(json.dumps(obj).encode())
                else:
                    torch.save(obj, out)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError of its zip writer
            with suppress(OSError):
                os.remove(path)
            free = shutil.disk_usage(directory).free if os.path.isdir(directory) else 0
            if getattr(e, "errno", None) == errno.ENOSPC or free < 2**20:
                fail(f"no space left on the device of {directory} ({free / 2**20:,.1f} MiB free) for {name}; "
                     f"free some, or keep fewer checkpoints (--keep)", alike=False)
            fail(f"cannot write {path}: {getattr(e, 'strerror', None) or str(e).splitlines()[0]}", alike=False)
        written[name] = {"bytes": os.path.getsize(path), "sha256": out.digest.hexdigest()}
    return written


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**24):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(args, step, model, zero, optimizer, world_size, rank):
    """Every rank writes its files, then a small marker naming them (or its problem), and waits on the file
    system, not in a collective, so the writing has no deadline: only a rank whose heartbeat stops for --timeout
    seconds ends the run (wait_for_markers). Once every marker is there, rank 0 writes the manifest, removes what
    --keep leaves out and renames the directory; the others go on when the manifest is in place."""
    t0 = time.perf_counter()
    final = os.path.join(args.out_dir, f"step_{step:06d}")
    tmp, every = final + ".tmp", min(1.0, args.timeout / 4)
    pieces = held(model, optimizer, zero)
    if args.zero == "0":  # every rank holds everything: each writes its 1/N run of every parameter
        cut = lambda n: slice(n * rank // world_size, n * (rank + 1) // world_size)
        pieces = {name: (shape, start + cut(len(v["param"])).start,
                         {k: t[cut(len(t))].clone() for k, t in v.items()})  # torch.save writes a view's storage
                  for name, (shape, start, v) in pieces.items()}
    files = {f"shard_{rank:05d}-of-{world_size:05d}.pt": pieces}
    if rank == 0:  # every rank drew the same random numbers so far
        files["trainer.pt"] = {"step": step, "world_size": world_size, "zero": args.zero, "model": model_flags(args),
                               "data": data_flags(args, world_size), "schedule": schedule(args),
                               "optimizer": optimizer_scalars(optimizer), "rng": torch.get_rng_state(),
                               "run": os.environ.get("TORCHELASTIC_RUN_ID")}
    try:
        os.makedirs(tmp, exist_ok=True)
        with heartbeat(os.path.join(tmp, f"rank_{rank:05d}.alive"), every):
            marker = {"files": write_files(tmp, files), "problem": None}
    except (Mistake, OSError) as e:
        marker = {"files": {}, "problem": str(e)}
    write_files(tmp, {f"rank_{rank:05d}.part.json": marker})
    os.replace(os.path.join(tmp, f"rank_{rank:05d}.part.json"), os.path.join(tmp, f"rank_{rank:05d}.json"))
    markers = wait_for_markers(tmp, final, world_size, rank, args.timeout)
    stop_on([markers[r]["problem"] if r in markers else None for r in range(world_size)], rank)
    if rank != 0:
        return
    manifest = {"step": step, "files": {name: f for m in markers.values() for name, f in m["files"].items()}}
    with heartbeat(os.path.join(tmp, "rank_00000.alive"), every):  # the others wait for the manifest
        write_files(tmp, {MANIFEST: manifest})  # last: a checkpoint with a manifest is complete
        for old in checkpoints(args.out_dir)[args.keep - 1:] if args.keep else []:  # --keep N: the newest N
            os.replace(old, old + ".deleting")  # no longer a checkpoint, before it is taken apart
            shutil.rmtree(old + ".deleting")
    for r in range(world_size):
        for name in (f"rank_{r:05d}.json", f"rank_{r:05d}.alive"):
            with suppress(FileNotFoundError):
                os.remove(os.path.join(tmp, name))
    os.replace(tmp, final)
    directory = os.open(args.out_dir, os.O_RDONLY)  # the rename itself reaches the disk
    os.fsync(directory)
    os.close(directory)
    size = sum(f["bytes"] for f in manifest["files"].values())
    tqdm.write(f"saved {final}: {len(manifest['files'])} files, {size / 2**20:,.2f} MiB, in "
               f"{time.perf_counter() - t0:.2f} s")


def heartbeat(path, every):
    """Touch `path` every `every` seconds while the block runs, so that other processes see this one live however
    long its writing takes (a flush to slow storage, say); one that hangs or was stopped falls silent."""
    def beat():
        with suppress(OSError), open(path, "a"):
            os.utime(path)
    return repeating(beat, every)


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


def wait_for_markers(directory, final, world_size, rank, timeout):
    """The markers in directory, {rank: marker}, once one reports a problem; else rank 0 waits for all of them,
    the other ranks until `final` is complete (rank 0 has renamed the directory). Waits while anything in
    directory changes (files growing, heartbeats); a Mistake once nothing has for `timeout` seconds (a rank that
    died or hangs)."""
    markers, seen, since = {}, None, time.monotonic()
    while True:
        for r in set(range(world_size)) - set(markers):
            with suppress(FileNotFoundError), open(os.path.join(directory, f"rank_{r:05d}.json")) as f:
                markers[r] = json.load(f)
        if any(m["problem"] for m in markers.values()) or (len(markers) == world_size if rank == 0 else
                                                           os.path.exists(os.path.join(final, MANIFEST))):
            return markers
        with suppress(FileNotFoundError):  # the directory itself goes when rank 0 renames it
            now = sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                         for entry in os.scandir(directory))
            if now != seen:
                seen, since = now, time.monotonic()
            elif time.monotonic() - since > timeout:
                missing = sorted(set(range(world_size)) - set(markers)) or [0]
                fail(f"checkpoint {directory}: ranks {missing} gave no sign of life for --timeout {timeout:g} s (a "
                     f"peer process died, or hangs)", alike=False)
        time.sleep(0.05)


def verify(path, rank, world_size):
    """The first problem with this rank's share of the checkpoint's files (every world_size-th, from the rank-th),
    or None: each must have the size and the SHA-256 that the manifest gives."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = sorted(json.load(f)["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is unreadable"
    for name, expected in files[rank::world_size]:
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing"
        if os.path.getsize(file) != expected["bytes"]:
            return f"{name} has {os.path.getsize(file):,} bytes, not {expected['bytes']:,}"
        if sha256(file) != expected["sha256"]:
            return f"{name} does not match its SHA-256 (changed on the disk)"
    return None


def find_checkpoint(args, world_size, control):
    """The checkpoint this run continues from: (its path, its trainer state, the seconds verifying took), or None
    to start afresh. --resume asks for one; a group that torchrun restarted (--max-restarts) takes the newest one
    of its own run by itself. A checkpoint that fails verification is reported in one line and moved aside
    (step_000020.damaged), and the next older one is tried."""
    paths = checkpoints(args.out_dir) if args.out_dir else []
    for incomplete in checkpoints(args.out_dir, complete=False) if args.out_dir else []:
        fail(f"--out-dir {args.out_dir} holds {os.path.basename(incomplete)} without a {MANIFEST} (from an older "
             f"train.py, or a copy cut short); move it out of the directory")
    if args.resume and not paths:
        fail(f"--resume: no complete checkpoint in --out-dir {args.out_dir}")
    if not paths:
        return None
    if not (args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0):
        fail(f"--out-dir {args.out_dir} already holds checkpoints; add --resume to continue from "
             f"{os.path.basename(paths[0])}, or choose another directory")
    rank, t0 = dist.get_rank(), time.perf_counter()
    for path in paths:
        problems = [p for p in gathered(control, verify(path, rank, world_size)) if p]
        if not problems:
            break
        if rank == 0:
            print(f"note: checkpoint {path} fails verification ({problems[0]}); trying the one before it")
    else:
        fail(f"no checkpoint in --out-dir {args.out_dir} passes verification; start afresh in another directory")
    for damaged in paths[:paths.index(path)] if rank == 0 else []:  # out of the way of the steps that redo them
        shutil.rmtree(damaged + ".damaged", ignore_errors=True)
        os.replace(damaged, damaged + ".damaged")
    trainer = torch.load(os.path.join(path, "trainer.pt"), weights_only=True)
    if not args.resume and trainer["run"] != os.environ.get("TORCHELASTIC_RUN_ID"):  # torchrun's restart of another
        fail(f"--out-dir {args.out_dir} already holds checkpoints of another run; add --resume to continue from "
             f"{os.path.basename(path)}, or choose another directory")
    if trainer["step"] > args.steps:
        fail(f"checkpoint {path} is past --steps {args.steps}: it has done {trainer['step']} steps")
    if {**model_flags(args), **trainer["model"]} != model_flags(args):  # a field the checkpoint lacks: as resolved
        fail(f"checkpoint {path} holds a model with {trainer['model']}; the flags ask for {model_flags(args)}")
    if trainer["schedule"] != schedule(args) and not args.new_schedule:
        was = argparse.Namespace(**{**vars(args), **trainer["schedule"]})
        changed = ", ".join(f"--{k} {trainer['schedule'][k]:g} -> {v:g}" for k, v in schedule(args).items()
                            if trainer["schedule"][k] != v)
        fail(f"{changed} against checkpoint {path} would move the learning rate of step {trainer['step'] + 1} from "
             f"{lr_at(trainer['step'], was):.3g} to {lr_at(trainer['step'], args):.3g}; resume with the checkpoint's "
             f"values, or add --new-schedule to accept it")
    if rank == 0 and trainer["data"] != data_flags(args, world_size):
        print(f"note: the checkpoint was trained with {trainer['data']}; this run has {data_flags(args, world_size)}, "
              f"so its steps will not repeat the original run's")
    return path, trainer, time.perf_counter() - t0


def restore(checkpoint, model, zero, optimizer, rank):
    """Load a checkpoint written on any layout into this run. Returns the number of steps already done."""
    path, trainer, seconds = checkpoint
    t0 = time.perf_counter()
    stored = shards(path)
    keys = {key for pieces in stored for _, _, values in pieces.values() for key in values} - {"param"}
    prepare_optimizer(optimizer, keys, trainer["optimizer"])
    load_pieces(held(model, optimizer, zero), stored)  # each rank copies what it holds out of every shard
    torch.set_rng_state(trainer["rng"])
    if rank == 0:
        print(f"resuming from {path} after step {trainer['step']} (written by {trainer['world_size']} ranks with "
              f"--zero {trainer['zero']}): model and AdamW state carried over; verified in {seconds:.2f} s, loaded "
              f"in {time.perf_counter() - t0:.2f} s")
    return trainer["step"]


def open_metrics(args, start_step):
    """The --metrics file, or None. A resumed run keeps the lines up to its checkpoint and writes the rest anew;
    lines that are not whole records (a blank line, one cut short by a full disk) are dropped, and counted."""
    if not args.metrics:
        return None
    kept, dropped = [], 0
    if start_step and os.path.exists(args.metrics):
        with open(args.metrics) as f:
            for line in f:
                try:
                    record = json.loads(line)
                    kept += [line] if record["step"] <= start_step else []
                except (ValueError, TypeError, KeyError):
                    dropped += 1
    if dropped:
        print(f"note: --metrics {args.metrics}: dropped {dropped} line(s) that were not whole records")
    metrics = open(args.metrics, "w")
    metrics.writelines(kept)
    return metrics


# ----------------------------------------------------------------------------------------------------------------
# mistakes and failures: one line, non-zero exit, and never a hang


class Mistake(Exception):
    """A mistake the user can fix, or a run that cannot go on: one line, non-zero exit, never a hang, printed once.
    Where every rank finds the same one (alike: the flags, a non-finite loss, a checkpoint all ranks read), rank 0
    says it and the others leave at once with status 0 (torchrun stops every process as soon as one fails, and
    rank 0 might not have written its line yet; the run fails all the same, with rank 0). Where one rank alone may
    find it (its files, its memory), the ranks agree first (agreed), or that rank says it, naming itself."""

    def __init__(self, message, alike=True):
        super().__init__(message)
        self.alike = alike


def fail(message, alike=True):
    raise Mistake(message, alike)


def check_args(args, world_size):
    """Fill in the defaults that depend on the world size, and refuse every flag value a run cannot use."""
    args.sp = world_size if args.sp is None else args.sp
    args.n_kv_head = args.n_head if args.n_kv_head is None else args.n_kv_head
    args.zero = ("3" if world_size > 1 else "0") if args.zero is None else args.zero
    args.dtype = ("bfloat16" if args.device == "cuda" or args.plan else "float32") if args.dtype is None else args.dtype
    args.n_layer = max(2, len(args.layer_pattern)) if args.n_layer is None else args.n_layer
    args.lr = (5e-4 if "d" in args.layer_pattern else 1e-3) if args.lr is None else args.lr
    args.warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
    zero_means_default = ("window", "warmup", "save_every", "keep", "gdn_k_heads", "gdn_v_heads", "gdn_k_dim",
                          "gdn_v_dim")
    for name in ("seq_len", "batch_size", "grad_accum", "steps", "n_layer", "n_head", "n_kv_head", "n_embd", "tiles",
                 *zero_means_default):
        least = 0 if name in zero_means_default else 1  # window 0: full; save_every 0: at the end; keep 0: all
        if getattr(args, name) < least:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least {least}")
    for name, zero_allowed in (("lr", False), ("weight_decay", True), ("grad_clip", True), ("timeout", False)):
        value = getattr(args, name)
        if not (math.isfinite(value) and (value >= 0 if zero_allowed else value > 0)):
            fail(f"--{name.replace('_', '-')} {value:g} must be a finite number "
                 f"{'of 0 or more' if zero_allowed else 'above 0'}")
    if args.timeout > WEEK:  # a collective's deadline is a timedelta, which ends at 1e9 days; nobody waits a week
        fail(f"--timeout {args.timeout:g} must be at most {WEEK} seconds (a week)")
    if not 0 <= args.seed < 2**32:
        fail(f"--seed {args.seed} must be in [0, 2**32)")
    if args.sp < 1 or world_size % args.sp:
        choices = ", ".join(str(p) for p in range(1, world_size + 1) if world_size % p == 0)
        fail(f"--sp {args.sp} does not divide the world size {world_size}; choose --sp in {{{choices}}}")
    if args.seq_len < args.sp:
        fail(f"--seq-len {args.seq_len} is smaller than --sp {args.sp}: every rank needs at least one token")
    if args.ring < 1 or args.sp % args.ring:
        choices = ", ".join(str(r) for r in range(1, args.sp + 1) if args.sp % r == 0)
        fail(f"--ring {args.ring} does not divide --sp {args.sp}; choose --ring in {{{choices}}}")
    if args.ring > 1 and ring_refusal(args):
        fail(f"--ring {args.ring} cannot be used with {ring_refusal(args)}; use --ring 1")
    if "a" in args.layer_pattern and args.sp // args.ring > args.n_head:  # a Ulysses rank would hold no head
        sps = [p for p in range(1, min(world_size, args.n_head) + 1) if world_size % p == 0]
        rings = [r for r in range(2, args.sp + 1) if args.sp % r == 0 and args.sp // r <= args.n_head]
        ring_too = "" if ring_refusal(args) else f", or --ring in {{{', '.join(map(str, rings))}}}"
        fail(f"--sp {args.sp} with --ring {args.ring} puts {args.sp // args.ring} ranks in each Ulysses group, more "
             f"than --n-head {args.n_head}: a rank would hold no head; choose --sp in {{{', '.join(map(str, sps))}}}"
             f"{ring_too}")
    try:
        cfg = model_config(args)
        if "a" in args.layer_pattern:
            ulysses.head_layout(args.n_head, args.n_kv_head, args.sp // args.ring)
    except ValueError as e:
        fail(e)
    if "d" in args.layer_pattern and args.sp > cfg.gdn_v_heads:
        valid = ", ".join(str(p) for p in range(1, cfg.gdn_v_heads + 1))
        fail(f"--sp {args.sp} is larger than the {cfg.gdn_v_heads} value heads of a Gated DeltaNet layer: a rank would "
             f"hold none; choose --sp in {{{valid}}} or more --gdn-v-heads")
    if args.offload and not args.recompute:
        fail("--offload keeps the block inputs that --recompute saves in CPU memory; add --recompute")
    if args.device == "cuda" and not torch.cuda.is_available() and args.plan is None:
        fail("--device cuda, but torch sees no CUDA device; choose --device cpu")
    if (args.resume or args.save_every or args.keep) and args.out_dir is None:
        fail("--resume, --save-every and --keep need --out-dir")


def ring_refusal(args):
    """The first flag that keeps a ring from running, with the reason; "" when a ring can run."""
    for flag, used, reason in (("--pack", args.pack, "the ring attends one document a row"),
                               ("--compile", args.compile, "the ring's sends are not traced"),
                               ("Gated DeltaNet layers (d in --layer-pattern)", "d" in args.layer_pattern,
                                "their recurrence needs the tokens in order")):
        if used:
            return f"{flag}: {reason}"
    return ""


def collective_failure(error, rank, step, args):
    """A collective that failed (a peer died, or waited past --timeout) as one line naming it; other errors as
    they are."""
    frames = traceback.extract_tb(error.__traceback__)
    names = [f.name for f in frames if f.filename.endswith("distributed_c10d.py")]
    message = str(error).lower()
    if names:
        collective = names[-1]
    elif "gloo" in message or "nccl" in message:
        collective = f"the collective waited on at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"
    else:
        return error
    return SystemExit(f"train.py: error: rank {rank}, step {step + 1}: {collective} failed (a peer process died, or "
                      f"waited longer than --timeout {args.timeout:g} s): {str(error).splitlines()[0]}")


# ----------------------------------------------------------------------------------------------------------------
# memory: predicted before the run (and refused if it cannot fit), measured during its last step


def predict_memory(cfg, tokens, batch, sp, ring_size, world_size, zero, cuda, bf16):
    """This rank's peak tensor memory in one training step of GPT(cfg), in bytes, before anything is allocated:
    {"peak", "state", "activations", "adamw" (the optimizer step's temporaries), "offloaded" (kept in CPU memory
    by cfg.offload)}, peak = state + the larger of activations and adamw. tokens: this rank's per
    micro-step (batch * S/sp); ring_size: the ring degree R (1: Ulysses alone over sp ranks); zero: "0", "3" or
    "fsdp2" over world_size ranks. The model is built on the meta
    device: shapes, no memory. `python bench.py memory` sets the prediction beside the measured peak.

    What a layer keeps for backward is counted tensor by tensor, in elements per local token, as autograd saves
    it on CPU in float32 (torch.autograd.graph.saved_tensors_hooks, storages counted once); bf16 takes the same
    counts at two bytes each, but four for what stays float32 (the residual stream, the norms, Gated DeltaNet's
    kernel). On CPU that comes out between 2% below and 13% above the measured peak (with a ring, 1% below to 30%
    above: the ring's query tiles are counted at their largest); no GPU has checked it."""
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
    # norm1: input, input * rstd, output; norm2: input, input * rstd; one rstd each (all float32 but the output)
    norms = wide * (4 * h + 2) + h
    # softmax attention: the kernel's q, k, v and output, its logsumexp (one a head), and the projection's input,
    # which without all-to-alls is the kernel's output itself, but keeps the whole qkv output alive (v is a view of
    # it) beside the rotated q and k; the all-to-alls make new tensors of them all
    attention = (q + 2 * kv) + q + H + (q + kv if U == 1 else h)
    # a ring's backward holds, for one query tile at a time, its float32 probabilities, their gradient and a copy
    # einsum makes of one of them, against a key block; dq in float32 (in bf16 also float32 copies of q, of the
    # output's gradient and of the output); the key/value block and the one arriving, three float32 dk/dv
    # accumulators (this step's, the one arriving, the one still being sent), and in bf16 the block's keys and
    # values in float32
    tile = min(ring.QUERY_TILE, tokens // batch * U)  # queries: a tile, or the kernel's whole sequence
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
    C, Dk, Dv = 64, cfg.gdn_k_dim, cfg.gdn_v_dim
    kd, vd = cfg.gdn_k_heads * Dk, cfg.gdn_v_heads * Dv
    layout = ulysses.head_layout(cfg.gdn_v_heads, cfg.gdn_k_heads, sp if "d" in cfg.layer_pattern else 1)
    hv, hk = (max(map(len, heads)) * sp for heads in layout)  # the kernel's value and key heads, per local token
    kd_, vd_, kv = hk * Dk, hv * Dv, hv * Dk
    kernel = (5 + 2) * kv + (4 + 2) * vd_ + 7 * C * hv + 16 * hv + 2 * Dk * Dv * hv / C
    deltanet = 2 * kd + 7 * vd + wide * (3 * (2 * kd_ + vd_) + kernel) + (C + 2) / e
    kept = {"a": norms + attention + mlp, "d": norms + deltanet + mlp}
    layers = [kept[block.kind] for block in model.blocks]
    blocks = tokens * e * (cfg.n_layer * h * wide if cfg.recompute else sum(layers))  # kept until backward
    offloaded = blocks if cfg.offload and cuda else 0
    # The head's backward: the final norm's three [h] tensors, then float32 logits, their gradient and the
    # softmax's output, 4 bytes each per vocabulary entry; tiled, its input and one tile's logits and gradient.
    head = tokens * e * ((2 * wide + 1) * h if cfg.tiles == 1 else (wide + 1) * h) + tokens * V * (
        12 if cfg.tiles == 1 else 8 / cfg.tiles)
    # A block's backward (after its recomputation, if any) holds about four float32 [h] gradients at once: measured
    layer = tokens * e * ((max(layers) if cfg.recompute else 0) + 4 * h * wide) + tokens * ring_backward
    activations = blocks - offloaded + tokens * 4 * 2 * D + max(head, layer)  # + RoPE's float32 cos and sin
    if zero == "0":  # everything on every rank (in bf16 also autocast's bf16 copy of the weights)
        state, local = (16 + (2 if bf16 else 0)) * n_params, n_params
    else:  # float32 shards of params, grads and AdamW's two moments, and two gathered units (compute dtype)
        state, local = 16 * n_params / world_size + 2 * unit * e, n_params / world_size
    adamw = 8 * local  # AdamW's step makes two float32 temporaries the size of the shards, after backward
    return {"peak": state + max(activations, adamw), "state": state, "activations": activations, "adamw": adamw,
            "offloaded": offloaded}


def predicted(args, world_size, cuda=None, **changed):
    """predict_memory for a run with these flags (some of them changed)."""
    args = argparse.Namespace(**{**vars(args), **changed})
    return predict_memory(model_config(args), local_tokens(args), args.batch_size, args.sp, args.ring, world_size,
                          args.zero, args.device == "cuda" if cuda is None else cuda, args.dtype == "bfloat16")


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
        f"{gib(m['state'])} + the larger of activations {gib(m['activations'])} and AdamW's step temporaries "
        f"{gib(m['adamw'])}; {gib(m['offloaded'])} more in CPU memory), against "
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
    """The peak tensor memory of one training step on this rank, in bytes: torch.cuda.max_memory_allocated on
    CUDA; on CPU, which has no such counter, MemTracker, which follows every tensor made while it is entered (the
    model, the optimizer and ZeRO-3's gathered units exist before, so they are named to it). Only the measured
    step pays for the tracking."""

    def __init__(self, model, optimizer, zero, device):
        self.existing = [model, optimizer, *([unit.full for unit in zero.units] if zero else [])]
        self.model, self.device, self.peak_bytes = model, device, None

    @contextmanager
    def measure(self, enabled=True):
        if not enabled:
            yield
        elif self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            from torch.distributed._tools.mem_tracker import MemTracker  # here, not at start: it brings inductor
            tracker = MemTracker()
            tracker.track_external(*self.existing)
            # MemTracker refuses a module that runs twice (gradient accumulation) unless its per-module statistics
            # are cleared before each forward of the model; the peak of the whole step is kept.
            hook = register_module_forward_pre_hook(partial(_clear_module_stats, tracker, self.model))
            try:
                with tracker:
                    yield
            finally:
                hook.remove()
            self.peak_bytes = tracker.get_tracker_snapshot("peak")[self.device]["Total"]


def _clear_module_stats(tracker, model, module, inputs):
    if module is model:
        tracker.reset_mod_stats()


# ----------------------------------------------------------------------------------------------------------------
# reporting


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


def summarize(args, history, model, optimizer, n_params, world_size, device, rank):
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).nbytes  # FSDP2: DTensors, count this rank's
    shards = [p for group in optimizer.param_groups for p in group["params"]]  # under ZeRO: this rank's
    state = [sum(local(p) for p in shards), sum(local(p.grad) for p in shards if p.grad is not None),
             sum(local(t) for p in shards for t in optimizer.state[p].values() if torch.is_tensor(t))]
    peaks = torch.tensor([float(history[-1]["peak_bytes"]), *map(float, state)], device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # bytes: peak, params, grads, AdamW state
    if rank != 0:
        return
    peak, params, grads, optim = peaks.tolist()
    sent, mib, seconds = ulysses.all_to_all_stats, lambda b: f"{b / 2**20:,.2f} MiB", sum(r["seconds"] for r in history)
    tokens, element_bytes = local_tokens(args), getattr(torch, args.dtype).itemsize
    count = lambda per_layer: args.grad_accum * sum((2 if args.recompute else 1) * there + back
                                                    for there, back in per_layer)  # forward twice with --recompute
    formula = count(block.attn.all_to_all_bytes(tokens, element_bytes) for block in model.blocks)
    print(f"final: loss {history[-1]['loss']:.4f} | accuracy {history[-1]['accuracy']:.4f}")
    print(f"throughput: {sum(r['tokens'] for r in history) / seconds:,.0f} tokens/s "
          f"({world_size} ranks, {seconds:.1f} s)")
    print(f"model state per rank (max over ranks): params {mib(params)} + grads {mib(grads)} + optimizer "
          f"{mib(optim)} = {mib(params + grads + optim)}; unsharded fp32 {mib(16 * n_params)}, / {world_size} ranks = "
          f"{mib(16 * n_params / world_size)}")
    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "MemTracker, last step"
    print(f"peak tensor memory per rank (max over ranks, {how}): {mib(peak)} (predicted "
          f"{mib(predicted(args, world_size)['peak'])})")
    calls = lambda stats, phase: stats[phase]["calls"] / (len(history) * args.grad_accum * args.n_layer)
    measured = lambda stats: (stats["forward"]["bytes"] + stats["backward"]["bytes"]) / len(history)
    print(f"all-to-all of rank 0 per step: {measured(sent):,.0f} bytes sent (formula {formula:,} bytes); calls per "
          f"layer per micro-step: {calls(sent, 'forward'):g} forward, {calls(sent, 'backward'):g} backward")
    if args.ring > 1:
        sent = ring.ring_stats
        formula = count(block.attn.ring_bytes(tokens, element_bytes, args.ring) for block in model.blocks)
        print(f"ring of rank 0 per step: {measured(sent):,.0f} bytes sent (formula {formula:,} bytes); sends per "
              f"layer per micro-step: {calls(sent, 'forward'):g} forward, {calls(sent, 'backward'):g} backward")
    heads = [len(r) for r in ulysses.head_layout(args.n_head, args.n_kv_head, args.sp // args.ring)[0]] \
        if "a" in args.layer_pattern else []
    if len(set(heads)) > 1:  # uneven: the rank with the most heads does the most attention work
        print(f"query heads per Ulysses rank {heads}: the busiest rank does "
              f"{max(heads) * len(heads) / sum(heads):.2f}x "
              f"the mean attention work")


if __name__ == "__main__":
    main()
