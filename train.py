"""
Train a small GPT with Ulysses sequence parallelism (SP), data parallelism (DP) and ZeRO-3 over both.

    python train.py                                             # one process (dp 1 x sp 1)
    torchrun --standalone --nproc_per_node=4 train.py           # dp 1 x sp 4 (--sp defaults to all ranks)
    torchrun --standalone --nproc_per_node=4 train.py --sp 2    # dp 2 x sp 2
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 --nproc_per_node=8 \
        train.py --sp 8 --n-head 8                              # two nodes (node_rank=1 on the other)
    python train.py --data input.txt                            # any text file, as bytes (vocab 256)
    torchrun --standalone --nproc_per_node=4 --max-restarts=1 train.py --out-dir ckpt --save-every 50

The default data is a copy task: every sample is random tokens followed by the same tokens again, and only the
copy is scored. Under SP the copy lives on other ranks than the original, so the task cannot be learned unless
attention really crosses the sequence shards. One step, as in DESIGN.md:
  batch of full sequences (same on every rank of an SP group) -> shift labels -> pad to a multiple of sp ->
  keep my S/sp tokens with their global position ids -> forward/backward (attention does the all-to-alls) ->
  loss = my token-loss sum / valid tokens of the whole global batch -> sum gradients over all ranks -> AdamW.
"""

import argparse
import datetime
import json
import math
import os
import shutil
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import ulysses
from gpt import GPT, GPTConfig
from zero3 import ZeRO3, fsdp2_shard

MODEL_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "window")  # the flags that shape the model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Ulysses sequence-parallel GPT training", allow_abbrev=False)
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel size (default: every rank); dp = world/sp")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, before padding to a multiple of sp")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per DP rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps/10)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay, on every parameter")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=None, help="key/value heads (default: n_head)")
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--window", type=int, default=0, help="sliding-window attention over this many tokens (0: full)")
    p.add_argument("--data", default=None, help="a text file to train on as bytes (default: the copy task)")
    p.add_argument("--pack", action="store_true", help="pack several documents into each sequence (text: split at "
                   "blank lines; copy task: documents of random lengths); attention stays inside each document")
    p.add_argument("--zero", choices=["0", "3", "fsdp2"], default=None,
                   help="3: zero3.py shards params, grads and AdamW state over all dp x sp ranks (default with more "
                        "than one rank); 0: every rank holds everything, gradients all-reduced; fsdp2: PyTorch's "
                        "fully_shard on the same units and ranks")
    p.add_argument("--tiles", type=int, default=1, help="run the MLP and the loss over this many sequence tiles")
    p.add_argument("--checkpoint", action="store_true", help="recompute each block in backward (activation "
                   "checkpointing)")
    p.add_argument("--offload", action="store_true", help="with --checkpoint on CUDA: keep block inputs in CPU "
                   "memory until backward")
    p.add_argument("--out-dir", default=None, help="write checkpoints here (at the end, and every --save-every)")
    p.add_argument("--save-every", type=int, default=0, help="also checkpoint every this many steps")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out-dir")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait for a peer")
    p.add_argument("--metrics", default=None, help="write one JSON line per optimizer step to this file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    return p.parse_args(argv)


def fail(message):
    """A mistake the user can fix: one line (from rank 0 only), non-zero exit, before any collective can hang."""
    raise SystemExit(f"train.py: error: {message}" if int(os.environ.get("RANK", 0)) == 0 else 1)


def prepare(args, world_size):
    """Check every flag, and read what the run needs from disk, before any process waits on another.
    Returns (the text documents or None for the copy task, the checkpoint to resume from or None)."""
    if args.sp is None:
        args.sp = world_size
    if args.n_kv_head is None:
        args.n_kv_head = args.n_head
    if args.zero is None:
        args.zero = "3" if world_size > 1 else "0"
    for name in ("seq_len", "batch_size", "grad_accum", "steps", "n_layer", "n_head", "n_kv_head", "n_embd", "tiles"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.sp < 1 or world_size % args.sp:
        choices = ", ".join(str(p) for p in range(1, world_size + 1) if world_size % p == 0)
        fail(f"--sp {args.sp} does not divide the world size {world_size}; choose --sp in {{{choices}}}")
    if args.seq_len < args.sp:
        fail(f"--seq-len {args.seq_len} is smaller than --sp {args.sp}: every rank needs at least one token")
    try:
        GPTConfig(**{name: getattr(args, name) for name in MODEL_FIELDS})
    except ValueError as e:
        fail(e)
    try:
        ulysses.kv_heads_to_send(args.n_head, args.n_kv_head, args.sp)
    except ValueError as e:
        fits = [p for p in ulysses.sp_sizes(args.n_head, args.n_kv_head) if world_size % p == 0]
        fail(f"{e}; with {world_size} ranks: --sp in {{{', '.join(map(str, fits))}}}")
    if args.window < 0:
        fail(f"--window {args.window} must be 0 (full attention) or a number of tokens")
    documents = None
    if args.data is not None:
        if not os.path.isfile(args.data):
            fail(f"--data {args.data}: no such file")
        documents = text_documents(args.data, split=args.pack)
        if not documents:
            fail(f"--data {args.data} holds no text")
        if not args.pack and sum(len(d) for d in documents) < args.seq_len + 1:
            fail(f"--data {args.data} has {sum(len(d) for d in documents)} bytes of text; --seq-len {args.seq_len} "
                 f"needs at least {args.seq_len + 1} (or use --pack)")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but torch sees no CUDA device; choose --device cpu")
    if (args.resume or args.save_every) and args.out_dir is None:
        fail("--resume and --save-every need --out-dir")
    if args.save_every < 0:
        fail(f"--save-every {args.save_every} must be 0 (only at the end) or a number of steps")
    if args.out_dir is not None and args.zero == "fsdp2":
        fail("--out-dir with --zero fsdp2: this script checkpoints --zero 0 and 3 (for FSDP2 use "
             "torch.distributed.checkpoint)")
    if args.out_dir is not None:
        try:
            os.makedirs(args.out_dir, exist_ok=True)
        except OSError as e:
            fail(f"--out-dir {args.out_dir}: {e.strerror}")
    metrics_dir = os.path.dirname(os.path.abspath(args.metrics)) if args.metrics else None
    for flag, directory in (("--out-dir", args.out_dir), ("--metrics", metrics_dir)):
        if directory is not None and not os.access(directory, os.W_OK):
            fail(f"{flag}: cannot write into {directory}")
    # torchrun restarting a failed group (--max-restarts) resumes from the newest checkpoint, if there is one
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
    newest = newest_checkpoint(args.out_dir) if args.out_dir is not None else None
    if args.resume and newest is None:
        fail(f"--resume: no complete checkpoint in --out-dir {args.out_dir}")
    if newest is not None and not (args.resume or restarted):
        fail(f"--out-dir {args.out_dir} already holds checkpoints; add --resume to continue from "
             f"{os.path.basename(newest)}, or choose another directory")
    return documents, read_checkpoint(newest, args, world_size) if newest is not None else None


# ----------------------------------------------------------------------------------------------------------------
# data: sample i depends only on (seed, i); the global batch of step t is samples [t*G, (t+1)*G) for every layout


def copy_document(n, length, g):
    """`length` tokens: n random ones, repeated. Labels are the next token inside the document (shifted here,
    before any sharding), -100 where it cannot be known: in the random first n, and at the last token, whose
    next token would belong to another document."""
    block = torch.randint(0, 256, (n,), generator=g)
    tokens = block.repeat(-(-length // n))[:length]
    labels = torch.cat([tokens[1:], torch.tensor([-100])])
    labels[: n - 1] = -100
    return tokens, labels


def text_documents(path, split):
    """A text file as bytes (vocab 256): one document, or with split=True one per blank-line-separated paragraph."""
    with open(path, "rb") as f:
        raw = f.read()
    parts = [d for d in raw.split(b"\n\n") if d.strip()] if split else [raw] if raw else []
    return [torch.frombuffer(bytearray(d), dtype=torch.uint8).long() for d in parts]


def make_sample(args, documents, index):
    """Sample `index` of the dataset, a function of (seed, index) alone: (inputs, labels, position_ids), each [S].
    Unpacked: one document (a copy task whose copy starts near the middle, or a window of the text).
    Packed: whole documents back to back, cut at seq_len; position ids restart at 0 at each document start."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + index)
    S = args.seq_len
    if not args.pack:
        if documents is None:
            tokens, labels = copy_document((S + 2) // 2, S + 1, g)  # the copy starts near the middle
        else:
            text = documents[0]
            start = torch.randint(0, len(text) - S, (1,), generator=g).item()
            tokens, labels = text[start: start + S], text[start + 1: start + S + 1]
        return tokens[:S], labels[:S], torch.arange(S)
    pieces = []
    while sum(len(t) for t, _ in pieces) < S:
        if documents is None:
            n = max(1, S // 8)  # documents of random length, each repeating its own first n tokens
            pieces.append(copy_document(n, torch.randint(n + 1, 4 * n + 1, (1,), generator=g).item(), g))
        else:
            doc = documents[torch.randint(0, len(documents), (1,), generator=g).item()]
            pieces.append((doc, torch.cat([doc[1:], torch.tensor([-100])])))
    tokens, labels = (torch.cat(column) for column in zip(*pieces))
    position_ids = torch.cat([torch.arange(len(t)) for t, _ in pieces])  # 0 at each document start, only there
    return tokens[:S], labels[:S], position_ids[:S]


def global_batch_indices(step, micro, dp_rank, args, dp):
    """The sample indices of one micro-batch. Over all (micro, dp_rank) they cover step*G .. (step+1)*G - 1."""
    start = (step * args.grad_accum + micro) * dp * args.batch_size + dp_rank * args.batch_size
    return range(start, start + args.batch_size)


def shard_for_sp(inputs, labels, position_ids, sp_rank, sp):
    """Full sequences [B, S] -> this rank's [B, S_pad/sp] inputs, labels and position ids.
    Pads at the end to a multiple of sp (labels -100, positions counting on): nothing is dropped, and causal
    attention keeps every real token from seeing the padding. Position ids are those of the full sequence:
    rank r's first token is at position r*S_pad/sp (unless a document starts there), never at 0."""
    B, S = inputs.shape
    pad = -S % sp
    inputs, labels = F.pad(inputs, (0, pad), value=0), F.pad(labels, (0, pad), value=-100)  # (B, S_pad)
    position_ids = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(1, pad + 1)], dim=1)  # (B, S_pad)
    local = (S + pad) // sp
    keep = slice(sp_rank * local, (sp_rank + 1) * local)
    return inputs[:, keep], labels[:, keep], position_ids[:, keep]  # (B, S_pad/sp) each


def load_micro_batch(step, micro, args, documents, dp, dp_rank, sp_rank, device):
    samples = [make_sample(args, documents, i) for i in global_batch_indices(step, micro, dp_rank, args, dp)]
    full = [torch.stack(column) for column in zip(*samples)]  # inputs, labels, position_ids: (B, S)
    return [t.to(device) for t in shard_for_sp(*full, sp_rank, args.sp)]


# ----------------------------------------------------------------------------------------------------------------
# checkpoints: DIR/step_000020/{trainer.pt, model.pt, optimizer_rank00000.pt, ...}. Written into step_000020.tmp
# and renamed when every rank has written its part, so a directory without .tmp is always complete.


def newest_checkpoint(out_dir):
    steps = [int(name[5:]) for name in os.listdir(out_dir) if name.startswith("step_") and name[5:].isdigit()] \
        if os.path.isdir(out_dir) else []
    return os.path.join(out_dir, f"step_{max(steps):06d}") if steps else None


def data_flags(args, world_size):
    """What fixes the sequence of batches: resuming with other values trains on other data."""
    global_batch = world_size // args.sp * args.batch_size * args.grad_accum
    return {"seed": args.seed, "seq_len": args.seq_len, "global_batch": global_batch, "data": args.data,
            "pack": args.pack}


def read_checkpoint(path, args, world_size):
    """Load and check, before any process waits on another, everything this rank will need from a checkpoint:
    (trainer state, whole-model state dict, this rank's optimizer and RNG state, or None on another layout)."""
    rank = int(os.environ.get("RANK", 0))

    def load(name):
        try:
            return torch.load(os.path.join(path, name), weights_only=True)
        except Exception as e:  # truncated, foreign or missing files all end here
            fail(f"checkpoint {path} is unreadable (truncated, or not written by train.py): {name}: "
                 f"{str(e).splitlines()[0][:100]}")
    trainer = load("trainer.pt")
    if not (isinstance(trainer, dict) and {"step", "world_size", "zero", "model", "data"} <= trainer.keys()):
        fail(f"checkpoint {path} is unreadable (truncated, or not written by train.py): trainer.pt: no trainer state")
    mine = {name: getattr(args, name) for name in MODEL_FIELDS}
    if trainer["model"] != mine:
        fail(f"checkpoint {path} holds a model with {trainer['model']}; the flags ask for {mine}")
    same_layout = trainer["world_size"] == world_size and trainer["zero"] == args.zero
    own = load(f"optimizer_rank{rank:05d}.pt") if same_layout else None
    if rank == 0 and trainer["data"] != data_flags(args, world_size):
        print(f"note: the checkpoint was trained with {trainer['data']}; this run has {data_flags(args, world_size)}, "
              f"so its steps will not repeat the original run's")
    trainer["path"] = path
    return trainer, load("model.pt"), own


def save_checkpoint(args, step, model_state, optimizer, world_size, rank):
    final = os.path.join(args.out_dir, f"step_{step:06d}")
    tmp = final + ".tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    # each rank its own optimizer state (a shard under ZeRO-3) and RNG state (nothing draws from it after the
    # model is built, but a model with dropout would); the step fixes the data position and the LR schedule
    torch.save({"optimizer": optimizer.state_dict(), "rng": torch.get_rng_state()},
               os.path.join(tmp, f"optimizer_rank{rank:05d}.pt"))
    if rank == 0:
        torch.save(model_state, os.path.join(tmp, "model.pt"))  # whole, unsharded: loads on any layout
        torch.save({"step": step, "world_size": world_size, "zero": args.zero, "data": data_flags(args, world_size),
                    "model": {name: getattr(args, name) for name in MODEL_FIELDS}},
                   os.path.join(tmp, "trainer.pt"))
    dist.barrier()
    if rank == 0:
        os.replace(tmp, final)  # atomic: the checkpoint exists whole or not at all
    dist.barrier()


def restore(resume_from, model, zero, optimizer, args, world_size, rank):
    """Load a checkpoint into this run. Returns the number of steps already done."""
    trainer, model_state, own = resume_from
    (zero or model).load_state_dict(model_state)  # ZeRO-3 cuts its shards for this run's ranks
    if own is not None:  # the same layout: this rank's optimizer shard fits
        optimizer.load_state_dict(own["optimizer"])
        torch.set_rng_state(own["rng"])
    if rank == 0:
        carried = "model, optimizer state" if own is not None else (
            f"model only: it was written by {trainer['world_size']} ranks with --zero {trainer['zero']}, this run "
            f"has {world_size} with --zero {args.zero}, so AdamW's state starts again from zero")
        print(f"resuming from {trainer['path']} after step {trainer['step']}: {carried}")
    return trainer["step"]


# ----------------------------------------------------------------------------------------------------------------


def lr_at(step, args):
    """Linear warmup, then cosine decay to 10% of the peak. A function of the step: resuming needs no state."""
    warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def all_to_all_bytes_formula(args, element_bytes):
    """Bytes one rank sends per optimizer step: per layer and micro-step, q, k, v and the output are each
    [B, S/P, heads, D] and (P-1)/P of each leaves the rank; backward sends the same again, and with
    --checkpoint the forward runs twice (once more inside backward)."""
    P = args.sp
    S_pad = math.ceil(args.seq_len / P) * P
    kv_sent = ulysses.kv_heads_to_send(args.n_head, args.n_kv_head, P)
    head_dim = args.n_embd // args.n_head
    per_layer = args.batch_size * (S_pad // P) * head_dim * (2 * args.n_head + 2 * kv_sent) * (P - 1) // P
    passes = 3 if args.checkpoint else 2
    return passes * args.n_layer * args.grad_accum * per_layer * element_bytes


def model_state_bytes(optimizer):
    """Bytes of parameters, gradients and optimizer state this rank holds (under ZeRO: its shards)."""
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t  # FSDP2 keeps DTensors; count this rank's piece
        return t.numel() * t.element_size()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {"params": sum(local(p) for p in params),
            "grads": sum(local(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(local(t) for p in params for t in optimizer.state[p].values() if torch.is_tensor(t))}


def memory_tracker(model, optimizer, zero):
    """Peak tensor memory of one step on CPU, where there is no torch.cuda.max_memory_allocated: MemTracker
    follows every tensor made while it is entered; what exists before must be named to it."""
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *([u.full for u in zero.units] if zero else []))
    return tracker


def failed_collective(error):
    """The name of the collective an exception came out of, or None if it did not come from one."""
    frames = traceback.extract_tb(error.__traceback__)
    names = [f.name for f in frames if f.filename.endswith("distributed_c10d.py")]
    if names:
        return names[-1]
    message = str(error).lower()
    if "gloo" in message or "nccl" in message:
        return f"the collective waited on at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"
    return None


def setup(args, world_size):
    """Device, process group (with a timeout, so a dead peer ends the run) and the dp x sp mesh."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:  # the processes of one machine share its cores
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
    mesh = init_device_mesh(device.type, (world_size // args.sp, args.sp), mesh_dim_names=("dp", "sp"))
    return device, mesh  # mesh ranks = arange(world).view(dp, sp): an SP group is sp consecutive ranks


def main(argv=None):
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    documents, resume_from = prepare(args, world_size)
    owns_process_group = not dist.is_initialized()
    device, mesh = setup(args, world_size)
    try:
        return train(args, world_size, documents, resume_from, device, mesh)
    finally:
        if owns_process_group:
            dist.destroy_process_group()


def train_step(step, micro_batches, model, zero, optimizer, args, tracker=None):
    """One optimizer step on this rank's micro-batches of the global batch. Returns (loss, accuracy, grad_norm,
    lr), the first three for the whole global batch. Leaves the gradients in place (the caller may count them)."""
    device = micro_batches[0][0].device
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.zero_grad(set_to_none=True)
    # DESIGN.md step 7: divide by the valid tokens of the WHOLE global batch (all ranks, all micro-steps)
    valid = sum((labels != -100).sum() for _, labels, _ in micro_batches).to(device)  # int64
    dist.all_reduce(valid)
    loss_sum, correct = torch.zeros((), device=device), torch.zeros((), device=device)
    for inputs, labels, position_ids in micro_batches:
        if tracker:  # it follows one forward per module; the peak of the whole step is kept
            tracker.reset_mod_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            micro_loss_sum, micro_correct = model(inputs, position_ids, labels, packed=args.pack)
        (micro_loss_sum / valid.clamp(min=1)).backward()  # a rank or batch with no valid token adds 0
        loss_sum += micro_loss_sum.detach()
        correct += micro_correct
    # DESIGN.md step 8: SUM gradients over all dp x sp ranks: this is then the single-device gradient.
    # ZeRO-3 and FSDP2 reduce-scatter with SUM during backward; without them, one all-reduce here.
    if args.zero == "0":
        flat_grads = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat_grads)
        for p, g in zip(params, flat_grads.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
    max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
    grad_norm = zero.clip_grad_norm_(max_norm) if zero else torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()  # FSDP2: DTensor
    totals = torch.stack([loss_sum, correct.float()])
    dist.all_reduce(totals)
    loss, accuracy = (totals / valid.clamp(min=1)).tolist()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # every rank sees the same, so all stop
        fail(f"step {step + 1}: loss {loss}, gradient norm {grad_norm}; stopped before the update, so the last "
             f"checkpoint stays the last good one")
    lr = lr_at(step, args)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    return loss, accuracy, grad_norm, lr


def train(args, world_size, documents, resume_from, device, mesh):
    dp, sp_group = world_size // args.sp, mesh.get_group("sp")
    rank, dp_rank, sp_rank = dist.get_rank(), mesh.get_local_rank("dp"), mesh.get_local_rank("sp")

    torch.manual_seed(args.seed)  # every rank builds the same initial model
    cfg = GPTConfig(**{name: getattr(args, name) for name in MODEL_FIELDS}, tiles=args.tiles,
                    checkpoint=args.checkpoint, offload=args.offload)
    model = GPT(cfg, sp_group=sp_group).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    compute_dtype = torch.bfloat16 if device.type == "cuda" else None
    zero = None  # ZeRO-3 and FSDP2 shard over every rank: the dp x sp mesh flattened, i.e. the world group
    if args.zero == "3":
        zero = ZeRO3(model, model.units(), group=dist.group.WORLD, compute_dtype=compute_dtype)
    elif args.zero == "fsdp2":
        fsdp2_shard(model, model.units(), dist.group.WORLD, compute_dtype=compute_dtype)
    params = zero.parameters() if zero else list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    start_step = restore(resume_from, model, zero, optimizer, args, world_size, rank) if resume_from else 0
    if rank == 0:
        print(f"world {world_size} = dp {dp} x sp {args.sp} | zero {args.zero} | {n_params / 1e6:.2f}M parameters | "
              f"seq {args.seq_len} | global batch {dp * args.batch_size * args.grad_accum} sequences | {device}")

    metrics_file = None
    if args.metrics and rank == 0:  # a resumed run keeps the lines up to its checkpoint and writes the rest anew
        kept = [line for line in open(args.metrics)
                if json.loads(line)["step"] <= start_step] if start_step and os.path.exists(args.metrics) else []
        metrics_file = open(args.metrics, "w")
        metrics_file.writelines(kept)
    history, total_seconds, peak_bytes = [], 0.0, None
    ulysses.reset_all_to_all_stats()
    bar = tqdm(range(start_step, args.steps), disable=rank != 0, dynamic_ncols=True, initial=start_step,
               total=args.steps)
    step = start_step
    try:
        for step in bar:
            t0 = time.perf_counter()
            micro_batches = [load_micro_batch(step, m, args, documents, dp, dp_rank, sp_rank, device)
                             for m in range(args.grad_accum)]
            if device.type == "cpu" and step == args.steps - 1:  # measure the last step: every step is alike
                with memory_tracker(model, optimizer, zero) as tracker:
                    loss, accuracy, grad_norm, lr = train_step(step, micro_batches, model, zero, optimizer, args,
                                                               tracker)
                peak_bytes = tracker.get_tracker_snapshot("peak")[device]["Total"]
            else:
                loss, accuracy, grad_norm, lr = train_step(step, micro_batches, model, zero, optimizer, args)
            seconds = time.perf_counter() - t0
            total_seconds += seconds
            tokens = dp * args.grad_accum * args.batch_size * args.seq_len
            record = {"step": step + 1, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
                      "seconds": seconds, "accuracy": accuracy}
            history.append(record)
            bar.set_postfix(loss=f"{loss:.4f}", acc=f"{accuracy:.3f}", tok_s=f"{tokens / seconds:.0f}")
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
            if args.out_dir and (step + 1 == args.steps or args.save_every and (step + 1) % args.save_every == 0):
                model_state = zero.state_dict() if zero else model.state_dict()
                save_checkpoint(args, step + 1, model_state, optimizer, world_size, rank)
    except RuntimeError as e:
        collective = failed_collective(e)
        if collective is None:
            raise
        raise SystemExit(f"train.py: error: rank {rank}, step {step + 1}: {collective} failed (a peer process died, "
                         f"or waited longer than --timeout {args.timeout:g} s): {str(e).splitlines()[0]}")
    finally:
        bar.close()
        if metrics_file:
            metrics_file.close()
    if history:  # the last step's gradients are still there to be counted
        summarize(args, history, total_seconds, model_state_bytes(optimizer), peak_bytes, n_params, world_size,
                  device, rank)
    return history


def summarize(args, history, total_seconds, state_bytes, peak_bytes, n_params, world_size, device, rank):
    if device.type == "cuda":
        peak_bytes = torch.cuda.max_memory_allocated(device)
    peaks = torch.tensor([float(peak_bytes), *map(float, state_bytes.values())], device=device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # (peak, params, grads, optimizer)
    if rank != 0:
        return
    sent = ulysses.all_to_all_stats
    measured = (sent["forward"]["bytes"] + sent["backward"]["bytes"]) / len(history)
    formula = all_to_all_bytes_formula(args, element_bytes=2 if device.type == "cuda" else 4)
    micro_layers = len(history) * args.grad_accum * args.n_layer
    mib = lambda b: f"{b / 2**20:,.2f} MiB"
    print(f"final: loss {history[-1]['loss']:.4f} | accuracy {history[-1]['accuracy']:.4f}")
    print(f"throughput: {sum(r['tokens'] for r in history) / total_seconds:,.0f} tokens/s "
          f"({world_size} ranks, {total_seconds:.1f} s)")
    params, grads, optim = peaks[1:].tolist()
    print(f"model state per rank (max over ranks): params {mib(params)} + grads {mib(grads)} + optimizer "
          f"{mib(optim)} = {mib(params + grads + optim)}; unsharded fp32 {mib(16 * n_params)}, "
          f"/ {world_size} ranks = {mib(16 * n_params / world_size)}")
    how = "torch.cuda.max_memory_allocated" if device.type == "cuda" else "MemTracker, last step"
    print(f"peak tensor memory per rank (max over ranks, {how}): {mib(peaks[0].item())}")
    print(f"all-to-all per rank per step: {measured:,.0f} bytes sent (formula {formula:,} bytes); calls per layer "
          f"per micro-step: {sent['forward']['calls'] / micro_layers:g} forward, "
          f"{sent['backward']['calls'] / micro_layers:g} backward")


if __name__ == "__main__":
    main()
