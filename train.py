"""
Train a small GPT with Ulysses sequence parallelism (SP) and data parallelism (DP).

    python train.py                                             # one process (dp 1 x sp 1)
    torchrun --standalone --nproc_per_node=4 train.py           # dp 1 x sp 4 (--sp defaults to all ranks)
    torchrun --standalone --nproc_per_node=4 train.py --sp 2    # dp 2 x sp 2
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 --nproc_per_node=8 train.py --sp 8
    python train.py --data input.txt                            # any text file, as bytes (vocab 256)

The default data is a copy task: every sample is random tokens followed by the same tokens again, and only the
copied half is scored. Under SP the copy lives on other ranks than the original, so the task cannot be learned
unless attention really crosses the sequence shards. One step, as in DESIGN.md:
  batch of full sequences (same on every rank of an SP group) -> shift labels -> pad to a multiple of sp ->
  keep my S/sp tokens with their global position ids -> forward/backward (attention does the all-to-alls) ->
  loss = my token-loss sum / valid tokens of the whole global batch -> sum gradients over all ranks -> AdamW.
"""

import argparse
import json
import math
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import ulysses
from gpt import GPT, GPTConfig


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Ulysses sequence-parallel GPT training", allow_abbrev=False)
    p.add_argument("--sp", type=int, default=None, help="sequence-parallel size (default: every rank); dp = world/sp")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence, before padding to a multiple of sp")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per DP rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps/10)")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global gradient norm (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-kv-head", type=int, default=None, help="key/value heads (default: n_head)")
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--data", default=None, help="a text file to train on as bytes (default: the copy task)")
    p.add_argument("--pack", action="store_true", help="pack several documents into each sequence (text: split at "
                   "blank lines; copy task: documents of random lengths); attention stays inside each document")
    p.add_argument("--window", type=int, default=0, help="sliding-window attention over this many tokens (0: full)")
    p.add_argument("--metrics", default=None, help="write one JSON line per optimizer step to this file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    return p.parse_args(argv)


def fail(message):
    """A mistake the user can fix: one line (from rank 0 only), non-zero exit, before any collective can hang."""
    raise SystemExit(f"train.py: error: {message}" if int(os.environ.get("RANK", 0)) == 0 else 1)


def check_args(args, world_size):
    if args.sp is None:
        args.sp = world_size
    if args.n_kv_head is None:
        args.n_kv_head = args.n_head
    for name in ("seq_len", "batch_size", "grad_accum", "steps", "n_layer", "n_head", "n_kv_head", "n_embd"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.sp < 1 or world_size % args.sp:
        choices = sorted(p for p in range(1, world_size + 1) if world_size % p == 0)
        fail(f"--sp {args.sp} does not divide the world size {world_size}; choose --sp in {choices}")
    if args.seq_len < args.sp:
        fail(f"--seq-len {args.seq_len} is smaller than --sp {args.sp}: every rank needs at least one token")
    try:
        GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_kv_head=args.n_kv_head, n_embd=args.n_embd)
        ulysses.kv_heads_to_send(args.n_head, args.n_kv_head, args.sp)
    except ValueError as e:
        fail(e)
    if args.window < 0:
        fail(f"--window {args.window} must be 0 (full attention) or a number of tokens")
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


# ----------------------------------------------------------------------------------------------------------------
# data: sample i depends only on (seed, i); the global batch of step t is samples [t*G, (t+1)*G) for every layout


def copy_document(n, g):
    """2n tokens: n random ones, then the same n again. Labels are the next token inside the document (shifted
    here, before any sharding), -100 where it cannot be known: in the random half, and at the last token, whose
    next token would belong to another document."""
    half = torch.randint(0, 256, (n,), generator=g)
    tokens = torch.cat([half, half])
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
            tokens, labels = copy_document((S + 2) // 2, g)  # at least S + 1 tokens: every label is real
        else:
            text = documents[0]
            start = torch.randint(0, len(text) - S, (1,), generator=g).item()
            tokens, labels = text[start: start + S], text[start + 1: start + S + 1]
        return tokens[:S], labels[:S], torch.arange(S)
    pieces = []
    while sum(len(t) for t, _ in pieces) < S:
        if documents is None:
            pieces.append(copy_document(torch.randint(4, max(4, S // 4) + 1, (1,), generator=g).item(), g))
        else:
            doc = documents[torch.randint(0, len(documents), (1,), generator=g).item()]
            pieces.append((doc, torch.cat([doc[1:], torch.tensor([-100])])))
    tokens, labels = torch.cat([t for t, _ in pieces]), torch.cat([l for _, l in pieces])
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


def lr_at(step, args):
    """Linear warmup, then cosine decay to 10% of the peak."""
    warmup = max(1, args.steps // 10) if args.warmup is None else args.warmup
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def all_to_all_bytes_formula(args, element_bytes):
    """Bytes one rank sends per optimizer step: per layer and micro-step, q, k, v and the output are each
    [B, S/P, heads, D] and (P-1)/P of each leaves the rank; backward sends the same again."""
    P = args.sp
    S_pad = math.ceil(args.seq_len / P) * P
    kv_sent = ulysses.kv_heads_to_send(args.n_head, args.n_kv_head, P)
    head_dim = args.n_embd // args.n_head
    per_layer = args.batch_size * (S_pad // P) * head_dim * (2 * args.n_head + 2 * kv_sent) * (P - 1) // P
    return 2 * args.n_layer * args.grad_accum * per_layer * element_bytes


def peak_memory_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident set size of this process


def main(argv=None):
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    check_args(args, world_size)
    owns_process_group = not dist.is_initialized()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:  # the processes of one machine share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
        device = torch.device("cpu")
    if owns_process_group:
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "MASTER_ADDR" in os.environ:  # torchrun
            dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        else:  # plain `python train.py`: a group of one
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    dp = world_size // args.sp
    mesh = init_device_mesh(device.type, (dp, args.sp), mesh_dim_names=("dp", "sp"))  # ranks = arange(world).view(dp, sp)
    sp_group = mesh.get_group("sp")
    rank, dp_rank, sp_rank = dist.get_rank(), mesh.get_local_rank("dp"), mesh.get_local_rank("sp")
    documents = text_documents(args.data, split=args.pack) if args.data is not None else None

    torch.manual_seed(args.seed)  # every rank builds the same initial model
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_kv_head=args.n_kv_head, n_embd=args.n_embd,
                    window=args.window)
    model = GPT(cfg, sp_group=sp_group).to(device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    if rank == 0:
        n_params = sum(p.numel() for p in params)
        print(f"world {world_size} = dp {dp} x sp {args.sp} | {n_params / 1e6:.2f}M parameters | "
              f"seq {args.seq_len} | global batch {dp * args.batch_size * args.grad_accum} sequences | {device}")

    metrics_file = open(args.metrics, "w") if args.metrics and rank == 0 else None
    history, total_seconds = [], 0.0
    ulysses.reset_all_to_all_stats()
    bar = tqdm(range(args.steps), disable=rank != 0, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        micro_batches = [load_micro_batch(step, m, args, documents, dp, dp_rank, sp_rank, device)
                         for m in range(args.grad_accum)]
        # DESIGN.md step 7: divide by the valid tokens of the WHOLE global batch (all ranks, all micro-steps)
        valid = torch.tensor(float(sum((labels != -100).sum() for _, labels, _ in micro_batches)), device=device)
        dist.all_reduce(valid)
        loss_sum, correct = torch.zeros((), device=device), torch.zeros((), device=device)
        for inputs, labels, position_ids in micro_batches:
            with autocast:
                micro_loss_sum, micro_correct = model(inputs, position_ids, labels, packed=args.pack)
            (micro_loss_sum / valid.clamp(min=1)).backward()  # a rank or batch with no valid token adds 0
            loss_sum += micro_loss_sum.detach()
            correct += micro_correct
        # DESIGN.md step 8: SUM gradients over all dp x sp ranks: this is then the single-device gradient
        flat_grads = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat_grads)
        for p, g in zip(params, flat_grads.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip if args.grad_clip > 0 else float("inf"))
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        totals = torch.stack([loss_sum, correct.float()])
        dist.all_reduce(totals)
        seconds = time.perf_counter() - t0
        total_seconds += seconds
        tokens = dp * args.grad_accum * args.batch_size * args.seq_len
        record = {"step": step + 1, "loss": (totals[0] / valid.clamp(min=1)).item(), "grad_norm": grad_norm.item(),
                  "lr": lr, "tokens": tokens, "seconds": seconds, "accuracy": (totals[1] / valid.clamp(min=1)).item()}
        history.append(record)
        bar.set_postfix(loss=f"{record['loss']:.4f}", acc=f"{record['accuracy']:.3f}", tok_s=f"{tokens / seconds:.0f}")
        if metrics_file:
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
    bar.close()
    if metrics_file:
        metrics_file.close()

    peak = torch.tensor(float(peak_memory_bytes(device)), device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        sent = ulysses.all_to_all_stats
        measured = (sent["forward"]["bytes"] + sent["backward"]["bytes"]) / args.steps
        formula = all_to_all_bytes_formula(args, element_bytes=2 if device.type == "cuda" else 4)
        calls_per_layer = (sent["forward"]["calls"] / (args.steps * args.grad_accum * args.n_layer),
                           sent["backward"]["calls"] / (args.steps * args.grad_accum * args.n_layer))
        print(f"final: loss {history[-1]['loss']:.4f} | accuracy {history[-1]['accuracy']:.4f}")
        print(f"throughput: {sum(r['tokens'] for r in history) / total_seconds:,.0f} tokens/s "
              f"({world_size} ranks, {total_seconds:.1f} s)")
        peak_kind = "max allocated" if device.type == "cuda" else "peak RSS"
        print(f"peak memory per rank ({peak_kind}, max over ranks): {peak.item() / 2**20:,.1f} MiB")
        print(f"all-to-all per rank per step: {measured:,.0f} bytes sent (formula {formula:,} bytes); "
              f"calls per layer per micro-step: {calls_per_layer[0]:g} forward, {calls_per_layer[1]:g} backward")
    if owns_process_group:
        dist.destroy_process_group()
    return history


if __name__ == "__main__":
    main()
