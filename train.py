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

This file is the run, top to bottom: flags, process groups and mesh, data, model and sharding, optimizer, resume,
the loop, the summary. Each service is one call into the file that owns it: launch.py (the flags and their checks,
the process groups, errors every rank agrees on), data.py, gpt.py, zero3.py, checkpoint.py, memory.py.
`python train.py --help` lists every flag with its default.

The default data (data.py) is a copy task: random tokens followed by the same tokens again, and only the copy is
scored. Under SP the copy lives on other ranks than the original, so the task cannot be learned unless attention
really crosses the sequence shards.

One optimizer step, on every rank of the dp x sp mesh. The code cites these step numbers; "rule N" is ulysses.py's.
  1. each DP rank draws its own micro-batches of full sequences; the sp ranks of an SP group draw the same ones
     (load_micro_batch);
  2. (rule 1) the labels are shifted by one before any sharding, label i = token i + 1 (a sample is drawn one
     token longer than its inputs; -100 where nothing is to be learned): a shard's last label is the next shard's
     first token (data.make_sample);
  3. (rule 2) sequences are padded at the end to S_pad, a multiple of sp (label -100), and SP rank r keeps tokens
     [r*S_pad/sp, (r+1)*S_pad/sp) with their GLOBAL position ids (ulysses.shard_for_sp; with --ring, the zigzag
     order, or with --pack each document's share);
  4. (rule 3) forward on the local tokens: embeddings, norms, MLP and loss per token, attention through two
     all-to-alls per layer forward (gpt.py calls ulysses.attention_layer); the model returns the SUM of its
     token losses;
  5. (rule 4) loss = that sum / the valid tokens of the WHOLE global batch, all dp x sp ranks and micro-steps
     (ulysses.global_valid_tokens); a batch without valid tokens gives 0, never NaN;
  6. (rule 4) backward; gradients are SUMMED over all dp x sp ranks (ZeRO-3 reduce-scatters with SUM). With step
     5 this is exactly the gradient one device would compute on the global batch: no 1/sp or 1/dp factor;
  7. clip by the global gradient norm; sum the loss and accuracy of the global batch for the log (a non-finite
     loss stops the run here, before the update); AdamW updates this rank's shard; the next forward gathers
     the new weights.
A plain `python train.py` is a process group of one, so the same collectives run (on one rank, they copy).
"""

import math
import os
import time
from functools import partial

import torch
import torch.distributed as dist
from tqdm import tqdm

import checkpoint
import data
import deltanet
import launch
import memory
import ring
import ulysses
from gpt import GPT
from zero3 import ZeRO3, fsdp2_shard


def main(argv=None):
    args = launch.parse_args(argv)
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    with launch.one_line_errors():  # a mistake: one line, and exit status 1 on every rank
        if args.plan:  # with --dry-run, the step itself runs on fake tensors beside the prediction
            if not memory.plan(args, partial(build, args)):  # its line says whether the run fits
                raise SystemExit(1)
            return True
        launch.check_args(args, world_size)  # the flags alone: every rank finds the same mistake, before any wait
        with launch.process_groups(args, world_size) as (device, mesh, control):
            # what depends on this machine (files, free memory) may differ between ranks: they agree before going on
            documents, data_sha256 = launch.agreed(control, partial(prepare, args, rank, world_size))
            launch.same_everywhere(control, {"the bytes of --data (SHA-256)": data_sha256})  # a stale copy?
            # rank 0 alone holds the out-dir for this run
            lock = launch.agreed(control, lambda: checkpoint.lock_out_dir(args.out_dir) if rank == 0 and args.out_dir
                                 else None)
            try:
                resume_from = checkpoint.find(args, world_size, control, lr_at, data_sha256)
                return train(args, world_size, mesh, device, documents, data_sha256, resume_from, control)
            finally:
                if lock:
                    lock.close()  # releases the out-dir for the next run


def prepare(args, rank, world_size):
    """What each rank checks on its own machine before the run: the memory, the data, the folders it writes
    into. Returns the documents of --data (None: the copy task) and the SHA-256 of its bytes."""
    memory.check_memory(args, world_size)  # a run that cannot fit is refused before it allocates anything
    try:
        documents = None if args.data is None else data.read_documents(args.data, args.pack, args.seq_len)
    except ValueError as e:
        launch.fail(f"--data {args.data}: {e}")
    if rank == 0 and args.metrics:  # rank 0 writes it
        if os.path.isdir(args.metrics):
            launch.fail(f"--metrics {args.metrics} is a directory; give a file name, e.g. "
                        f"{os.path.join(args.metrics, 'metrics.jsonl')}")
        checkpoint.make_folder("--metrics", os.path.dirname(os.path.abspath(args.metrics)))
    if args.out_dir is not None:
        checkpoint.make_folder("--out-dir", args.out_dir)
    return documents, args.data and checkpoint.sha256(args.data)


def build(args, world_size, mesh, device, host=torch.device("cpu")):
    """The model on `device`, sharded over every rank, its optimizer, and step(i, documents), which runs optimizer
    step i of this rank on its micro-batches (steps 1 to 7). host: where --offload and --offload-optimizer keep what
    they move off the device. --dry-run runs it on fake tensors (memory.dry_run)."""
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    dp, sp_groups = world_size // args.sp, (mesh.get_group("ulysses"), mesh.get_group("ring"))
    model = GPT(launch.model_config(args), *sp_groups, host)
    if device.type != "cpu":  # built on the CPU, so that a GPU run starts from the numbers a CPU run does
        model.to(device)
    if args.compile:  # each block's forward on its own, as torchtitan does; hooks (ZeRO-3's gathers) stay eager
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    n_params = sum(p.numel() for p in model.parameters())
    compute_dtype = torch.bfloat16 if args.dtype == "bfloat16" else None  # what ZeRO-3 and FSDP2 gather
    zero = None  # ZeRO-3 or FSDP2 (in place: zero stays None) over every rank: the dp x sp mesh flattened
    if args.zero == "3":
        zero = ZeRO3(model, model.units(), group=dist.group.WORLD, compute_dtype=compute_dtype,
                     offload_to=host if args.offload_optimizer else None)  # AdamW then steps in host memory
    elif args.zero == "fsdp2":
        fsdp2_shard(model, model.units(), dist.group.WORLD, compute_dtype=compute_dtype)
    optimizer = torch.optim.AdamW(zero.parameters() if zero else model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=args.weight_decay)

    def step(i, documents=None):
        batches = [load_micro_batch(args, documents, i, micro, dp, mesh.get_local_rank("dp"), sp_groups, device)
                   for micro in range(args.grad_accum)]
        return train_step(i, batches, model, zero, optimizer, args)
    return model, zero, optimizer, n_params, step


def train(args, world_size, mesh, device, documents, data_sha256, resume_from, control):
    dp, rank = world_size // args.sp, dist.get_rank()
    model, zero, optimizer, n_params, train_on = build(args, world_size, mesh, device)
    start_step = checkpoint.restore(resume_from, model, zero, optimizer) if resume_from else 0
    launch.gathered(control, None)  # every rank has loaded (however long its storage took) before the first collective
    if rank == 0:
        usp = f" (ulysses {args.sp // args.ring} x ring {args.ring})" if args.ring > 1 else ""
        print(f"world {world_size} = dp {dp} x sp {args.sp}{usp} | zero {args.zero} | {n_params / 1e6:.2f}M parameters "
              f"| seq {args.seq_len} | global batch {dp * args.batch_size * args.grad_accum} sequences | {device} | "
              f"{args.dtype} | predicted peak {memory.predicted(args, world_size)['peak'] / 2**20:,.2f} MiB per rank")
        if documents is not None:
            samples = args.steps * dp * args.batch_size * args.grad_accum
            print(f"data {args.data}: {data.describe(documents, args.pack, args.seq_len, samples)}")

    peak = memory.PeakMemory(model, optimizer, zero, device, host=args.offload or args.offload_optimizer)
    metrics = launch.agreed(control, lambda: checkpoint.Metrics(args.metrics, start_step) if rank == 0 and args.metrics
                            else None)  # rank 0 writes it
    history = []
    ulysses.reset_all_to_all_stats()
    ring.reset_ring_stats()
    deltanet.reset_context_stats()
    bar = tqdm(range(start_step, args.steps), disable=rank != 0, dynamic_ncols=True, initial=start_step,
               total=args.steps)
    progress = launch.StepProgress(model, bar)
    step = start_step
    try:
        for step in bar:
            t0 = time.perf_counter()
            progress.begin(step)
            measured = step == args.steps - 1  # every step is alike: the last one is measured
            with peak.measure(measured):
                loss, accuracy, grad_norm, lr = train_on(step, documents)
            seconds = time.perf_counter() - t0
            progress.end()
            tokens = dp * args.grad_accum * args.batch_size * args.seq_len  # the global batch's, padding excluded
            history.append({"step": step + 1, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
                            "seconds": seconds, "accuracy": accuracy})
            if measured:  # the measured step's line carries the peaks, the largest over the ranks (host: on CUDA)
                history[-1].update(peak_bytes=peak.bytes, host_peak_bytes=peak.host_bytes)
            bar.set_postfix(loss=f"{loss:.4f}", acc=f"{accuracy:.3f}", tok_s=f"{tokens / seconds:.0f}")
            if metrics:
                metrics.write(history[-1])
            if args.out_dir and (step + 1 == args.steps or args.save_every and (step + 1) % args.save_every == 0):
                checkpoint.save(args, step + 1, model, zero, optimizer, world_size, rank, data_sha256)
        bar.close()
        if history:  # the summary counts the model state, the last step's gradients included
            summarize(args, history, model, optimizer, n_params, world_size, device, rank)
    except RuntimeError as e:
        raise launch.collective_failure(e, rank, step, args.timeout) from None
    finally:
        progress.close()
        bar.close()
        if metrics:
            metrics.close()
    return history


def train_step(step, micro_batches, model, zero, optimizer, args):
    """One optimizer step on this rank's micro-batches of the global batch. Returns (loss, accuracy, grad_norm,
    lr), the first three for the whole global batch. Leaves the gradients in place (the caller may count them)."""
    device = micro_batches[0][0].device
    optimizer.zero_grad(set_to_none=True)
    # step 5 needs the valid tokens of the whole global batch before the first micro-batch's backward
    valid = ulysses.global_valid_tokens([labels for _, labels, *_ in micro_batches], dist.group.WORLD)
    loss_sum = correct = 0
    for inputs, labels, position_ids, token_index in micro_batches:
        # step 4; mixed precision: matmuls and attention in bf16, the rest in float32 (gpt.py says where)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            micro_loss_sum, micro_correct = model(inputs, position_ids, labels, args.pack, token_index)
        (micro_loss_sum / valid).backward()  # step 5, and the backward of step 6
        loss_sum, correct = loss_sum + micro_loss_sum.detach(), correct + micro_correct
    # step 6: gradients are summed over all dp x sp ranks. ZeRO-3 (zero3.ShardedUnit.reduce_grad, the default on
    # more than one rank) and FSDP2 reduce-scatter them with SUM during backward; with --zero 0, one all-reduce here.
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
    dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=dist.group.WORLD)
    loss, accuracy = (totals / valid).tolist()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # every rank sees the same, so all stop
        launch.fail(f"step {step + 1}: loss {loss}, gradient norm {grad_norm}; stopped before the update, so the "
                    f"last checkpoint stays the last good one")
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
    """Steps 1 to 3: this DP rank's full sequences of one micro-step (labels shifted by data.make_sample), then this
    SP rank's shard of them: input ids, labels, global position ids and token index, [batch_size, S_pad/sp] each
    (with a ring, in the order --balance picks). sp_groups: (Ulysses group, ring group)."""
    indices = data.micro_batch_indices(step, micro, args.grad_accum, dp_rank, dp, args.batch_size)
    samples = [data.make_sample(i, args.seq_len, documents, args.pack, args.seed) for i in indices]
    full = [torch.stack(column) for column in zip(*samples)]  # inputs, labels, position_ids: (B, S) each
    layout = ring.document_layout if args.balance == "documents" else None  # None: zigzag
    return [t.to(device, copy=True) for t in ulysses.shard_for_sp(*full, *sp_groups, layout)]  # (B, S_pad/sp) each


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
    mib, seconds = lambda b: f"{b / 2**20:,.2f} MiB", sum(r["seconds"] for r in history)
    tokens, element_bytes = memory.local_tokens(args), getattr(torch, args.dtype).itemsize
    count = lambda per_layer: args.grad_accum * sum((2 if args.recompute else 1) * there + back
                                                    for there, back in per_layer)  # forward twice with --recompute
    formula = count(block.attn.all_to_all_bytes(tokens, element_bytes) for block in model.blocks)
    print(f"final: loss {history[-1]['loss']:.4f} | accuracy {history[-1]['accuracy']:.4f}")
    print(f"throughput: {sum(r['tokens'] for r in history) / seconds:,.0f} tokens/s "
          f"({world_size} ranks, {seconds:.1f} s)")
    print(f"model state per rank (max over ranks): params {mib(params)} + grads {mib(grads)} + optimizer "
          f"{mib(optim)} = {mib(params + grads + optim)}{' in host memory' * args.offload_optimizer}; unsharded fp32 "
          f"{mib(16 * n_params)}, / {world_size} ranks = {mib(16 * n_params / world_size)}")
    how, predicted = ("torch.cuda.max_memory_allocated" if device.type == "cuda" else "storages counted, last step",
                      memory.predicted(args, world_size))
    host = history[-1]["host_peak_bytes"]  # counted on a GPU with an offload; a CPU's host is the memory counted
    host = ("the same, on a CPU" if device.type == "cpu" else "nothing offloaded" if host is None else
            f"{mib(host)} (predicted {mib(predicted['host'])})")
    print(f"peak tensor memory per rank (max over ranks, {how}): {mib(peak)} (predicted {mib(predicted['peak'])}); "
          f"host memory: {host}")
    a2a = [b for b in model.blocks if b.kind == "a" or args.gdn_parallel == "ulysses"]  # layers with all-to-alls
    report_bytes("all-to-all", "calls", ulysses.all_to_all_stats, formula, len(a2a), len(history), args.grad_accum)
    if args.ring > 1:
        softmax = [block for block in model.blocks if block.kind == "a"]
        formula = count(block.attn.ring_bytes(tokens, element_bytes, args.ring) for block in softmax)
        report_bytes("ring", "sends", ring.ring_stats, formula, len(softmax), len(history), args.grad_accum)
    if "d" in args.layer_pattern and args.gdn_parallel == "context":  # Gated DeltaNet's gathers, any seq-len
        formula = count(block.attn.context_bytes(args.batch_size, tokens // args.batch_size, element_bytes)
                        for block in model.blocks if block.kind == "d")
        sent = sum(deltanet.context_stats.values()) / len(history)
        print(f"context-parallel Gated DeltaNet of rank 0 per step: {sent:,.0f} bytes sent (formula {formula:,} bytes: "
              f"all layers and micro-steps, forward and backward)")
    heads = [len(r) for r in ulysses.head_layout(args.n_head, args.n_kv_head, args.sp // args.ring)[0]] \
        if "a" in args.layer_pattern else []
    if len(set(heads)) > 1:  # uneven: the rank with the most heads does the most attention work
        print(f"query heads per Ulysses rank {heads}: the busiest rank does "
              f"{max(heads) * len(heads) / sum(heads):.2f}x "
              f"the mean attention work")


def report_bytes(what, calls, stats, formula, layers, steps, micro_steps):
    """One line of the summary: the bytes rank 0 sent per step beside the formula's, and its calls per layer that
    makes them, per micro-step."""
    sent = (stats["forward"]["bytes"] + stats["backward"]["bytes"]) / steps
    per_layer = {phase: stats[phase]["calls"] / (steps * micro_steps * max(layers, 1)) for phase in stats}
    print(f"{what} of rank 0 per step: {sent:,.0f} bytes sent (formula {formula:,} bytes: all layers and micro-steps, "
          f"forward and backward); {calls} per layer per micro-step: {per_layer['forward']:g} forward, "
          f"{per_layer['backward']:g} backward")


if __name__ == "__main__":
    main()
