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

This file is the run, top to bottom: main (the flags, the process groups and mesh), train (resume, the loop, the
summary), build (the model, its sharding, the optimizer), load_micro_batch (the data: steps 1 to 3 below),
train_step (steps 4 to 7). What runs the lesson without being part of it lives in harness/, and this file calls its
services by name: launch (the flags and their checks, the process groups, errors every rank agrees on), checkpoint,
memory, report (the progress and the summary). `python train.py --help` lists every flag with its default.

The default data (data.py) is a copy task: random tokens followed by the same tokens again, and only the copy is
scored. Under SP the copy lives on other ranks than the original, so the task cannot be learned unless attention
really crosses the sequence shards.

One optimizer step on the dp x sp mesh (sp = ring x ulysses), numbered as the code cites it; "rule N": ulysses.py.
  1. each DP rank draws its own micro-batches of full sequences; the sp ranks of an SP group draw the same ones
     (load_micro_batch);
  2. (rule 1) the labels are shifted by one before any sharding: the label at position i is the token at position
     i + 1 (data.py sets them from the next token; -100 where nothing is to be learned), so a shard's
     last label is the next shard's first token (data.make_sample);
  3. (rule 2) sequences are padded at the end to S_pad, a multiple of sp (of 2 sp with --ring; label -100), and SP rank
     r keeps tokens [r*S_pad/sp, (r+1)*S_pad/sp) with their GLOBAL position ids (ulysses.shard_for_sp; with --ring,
     ring.shard_for_ring: the zigzag order, or with --balance documents each document's share);
  4. (rule 3) forward on the local tokens: embeddings, norms, MLP and loss per token, attention through the
     exchanges of ulysses_attention (gpt.py); the model returns the SUM of its token losses and its correct count;
  5. (rule 4) loss = that sum / the valid tokens of the WHOLE global batch, all dp x sp ranks and micro-steps
     (ulysses.global_valid_tokens, counted before step 4); a batch without valid tokens gives 0, never NaN;
  6. (rule 4) backward; gradients are SUMMED over all dp x sp ranks (ZeRO-3 reduce-scatters with SUM). With step
     5 this is exactly the gradient one device would compute on the global batch: no 1/sp or 1/dp factor;
  7. clip by the global gradient norm; sum the loss and the correct predictions of the global batch for the log (a
     non-finite loss or gradient norm stops the run here, before the update); AdamW updates this rank's shard (all of
     the model under --zero 0) at the step's learning rate (lr_at); ZeRO-3 and FSDP2 gather it in the next forward.
A plain `python train.py` is a process group of one: the gradients' and the totals' all-reduces run there too (on
one rank they change nothing); attention makes no all-to-all.
"""

import math

import torch
import torch.distributed as dist

import data
import ring
import ulysses
from documents import document_layout
from gpt import GPT
from harness import checkpoint, launch, memory, report
from zero3 import ZeRO3, fsdp2_shard


def main(argv=None):
    """The run, top to bottom. Returns its history: a dict per step (loss, accuracy, grad_norm, lr, tokens, seconds);
    with --plan, whether the run fits."""
    args = launch.parse_args(argv)  # the flags
    with launch.one_line_errors():  # a mistake: one line, and exit status 1 on every rank
        if args.plan:  # --plan NxG: this run's step traced on fake tensors as on N GPUs of G GiB; no run
            return memory.plan(args, build)
        # on CUDA: the step traced, before any process group (a trace makes its own); a run that cannot fit stops here
        traced = memory.check(args, build)
        # the flags checked; the process groups and the dp x ring x ulysses mesh; --data read on every rank
        with launch.started(args) as run:
            with checkpoint.out_dir(args, run, lr_at) as resume_from:  # --out-dir locked; what to resume, or None
                return train(args, run, resume_from, traced)


def train(args, run, resume_from, traced=None):
    """Model and sharding, optimizer, resume, the loop, the summary. run: launch.started's (device, mesh, rank,
    world_size, documents, data_sha256, ...); traced: memory.check's (None on CPU)."""
    model, zero, optimizer, n_params, train_on = build(args, run.world_size, run.mesh, run.device)
    start_step = checkpoint.restore(resume_from, model, zero, optimizer) if resume_from else 0  # steps done
    with report.Log(args, run, model, optimizer, zero, n_params, start_step, traced) as log:  # rank 0 prints
        for step in range(start_step, args.steps):
            with log.measuring(step):  # its seconds; the last step's peak memory; where a long step is
                loss, accuracy, grad_norm, lr = train_on(step, run.documents)
            log.write(loss, accuracy, grad_norm, lr)  # the history, the progress bar, --metrics
            if args.out_dir and (step + 1 == args.steps or args.save_every and (step + 1) % args.save_every == 0):
                checkpoint.save(args, step + 1, model, zero, optimizer, run.world_size, run.rank, run.data_sha256)
        log.summary()
    return log.history


def build(args, world_size, mesh, device, host=torch.device("cpu")):
    """(model on `device`, zero: its ZeRO-3 sharding or None, optimizer, parameter count, train_on(i, documents),
    which runs optimizer step i of this rank on its micro-batches: steps 1 to 7). host: where --offload and
    --offload-optimizer keep what they move off the device. memory.py runs it on fake tensors (memory.trace)."""
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    # process groups: the mesh is (dp, ring, ulysses) = (world/sp, --ring, sp/--ring), row-major: a Ulysses group's
    # ranks are consecutive (the fastest links); 4 ranks --sp 2: ulysses {0,1} {2,3}, dp {0,2} {1,3}. ulysses runs the
    # all-to-alls; ring passes key/value blocks on and dk/dv back; dp sends nothing (its index picks a rank's samples);
    # WORLD: ZeRO-3's gathers and reduce-scatters (or --zero 0's all-reduce), the gradient norm, token count, totals.
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

    def train_on(i, documents=None):
        batches = [load_micro_batch(args, documents, i, micro, dp, mesh.get_local_rank("dp"), sp_groups, device)
                   for micro in range(args.grad_accum)]
        return train_step(i, batches, model, zero, optimizer, args)
    return model, zero, optimizer, n_params, train_on


def load_micro_batch(args, documents, step, micro, dp, dp_rank, sp_groups, device):
    """Steps 1 to 3: this DP rank's full sequences of one micro-step (labels shifted by data.make_sample), then this
    SP rank's shard of them: input ids, labels, global position ids and token index, [batch_size, S_pad/sp] each
    (with a ring, in the order --balance picks). sp_groups: (Ulysses group, ring group)."""
    indices = data.micro_batch_indices(step, micro, args.grad_accum, dp_rank, dp, args.batch_size)
    samples = [data.make_sample(i, args.seq_len, documents, args.pack, args.seed) for i in indices]
    full = [torch.stack(column) for column in zip(*samples)]  # inputs, labels, position_ids: (B, S) each
    if args.ring > 1:  # Ulysses x Ring: the ring's share of the tokens (zigzag, or per document), split over Ulysses
        layout = document_layout if args.balance == "documents" else None  # None: zigzag
        shards = ring.shard_for_ring(*full, *sp_groups, layout)
    else:
        shards = ulysses.shard_for_sp(*full, sp_groups[0])
    return [t.to(device, copy=True) for t in shards]  # (B, S_pad/sp) each


def train_step(step, micro_batches, model, zero, optimizer, args):
    """One optimizer step on this rank's micro-batches of the global batch. Returns (loss, accuracy, grad_norm,
    lr), the first three for the whole global batch. Leaves the gradients in place (the caller may count them)."""
    device = micro_batches[0][0].device
    optimizer.zero_grad(set_to_none=True)
    # step 5 needs the valid tokens of the whole global batch before the first micro-batch's backward
    valid = ulysses.global_valid_tokens([labels for _, labels, *_ in micro_batches], dist.group.WORLD)  # ()
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
        flat_grads = torch.cat([p.grad.flatten() for p in params])  # (parameters,)
        dist.all_reduce(flat_grads, op=dist.ReduceOp.SUM, group=dist.group.WORLD)  # a sum, never an average
        for p, g in zip(params, flat_grads.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
    # step 7: clip, then update
    max_norm = args.grad_clip if args.grad_clip > 0 else float("inf")
    grad_norm = zero.clip_grad_norm_(max_norm) if zero else torch.nn.utils.clip_grad_norm_(params, max_norm)
    grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()  # FSDP2: DTensor
    totals = torch.stack([loss_sum, correct.float()])  # (2,)
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
    """Linear warmup, then cosine decay toward 10% of the peak. A function of the step: resuming needs no state."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


if __name__ == "__main__":
    main()
