"""
What a run says: its opening line, a line a step (rank 0's progress bar, the history train.main returns, the
--metrics file), the peak memory of its last step, and the summary, whose byte lines (`bytes_sent`) set what rank 0
sent beside the formula. train.py opens a `Log` around its loop and ends it with `Log.summary`.
"""

import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from tqdm import tqdm

import data
import deltanet
import ring
import ulysses
from harness import checkpoint, launch, memory


class Log:
    """The record of one run's steps. `measuring(step)` around a step times it, measures the peak memory of the last
    step (memory.PeakMemory) and shows on the progress bar where a long step is (launch.StepProgress); `write`
    records the step: the history, the progress bar, --metrics. As a context manager it closes what it opened, and
    a collective that failed becomes one line naming it (launch.collective_failure)."""

    def __init__(self, args, run, model, optimizer, zero, n_params, start_step, traced=None):
        self.args, self.run, self.model, self.optimizer, self.n_params = args, run, model, optimizer, n_params
        self.traced = traced  # memory.check's trace of the step (CUDA), or None
        self.step, self.seconds, self.history = start_step, None, []
        # rank 0 writes --metrics; this all-gather also waits for every rank to load its checkpoint, however long its
        # storage takes, before the first collective of the step, which has a --timeout deadline
        self.metrics = launch.agreed(run.control, lambda: checkpoint.Metrics(args.metrics, start_step)
                                     if run.rank == 0 and args.metrics else None)
        if run.rank == 0:
            opening(args, run, n_params, start_step, traced)
        self.peak = memory.PeakMemory(model, optimizer, zero, run.device, host=args.offload or args.offload_optimizer)
        for reset in (ulysses.reset_all_to_all_stats, ring.reset_ring_stats, deltanet.reset_context_stats):
            reset()  # the summary counts the bytes of this run's steps
        self.bar = tqdm(total=args.steps, initial=start_step, disable=run.rank != 0, dynamic_ncols=True)
        self.progress = launch.StepProgress(model, self.bar)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        self.progress.close()
        self.bar.close()
        if self.metrics:
            self.metrics.close()
        if isinstance(error, RuntimeError):
            raise launch.collective_failure(error, self.run.rank, self.args.timeout, self.step)

    @contextmanager
    def measuring(self, step):
        """Around step `step`: its seconds; the last step's peak memory (every step is alike: the last is measured)."""
        self.step, start = step, time.perf_counter()
        self.progress.begin(step)
        with self.peak.measure() if step == self.args.steps - 1 else nullcontext():
            yield
        self.seconds = time.perf_counter() - start
        self.progress.end()

    def write(self, loss, accuracy, grad_norm, lr):
        """The measured step's record: in the history, on the progress bar, in --metrics."""
        args = self.args
        tokens = self.run.world_size // args.sp * args.grad_accum * args.batch_size * args.seq_len  # padding excluded
        record = {"step": self.step + 1, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
                  "seconds": self.seconds, "accuracy": accuracy}
        if self.step == args.steps - 1:  # the measured step: the peaks, the largest over the ranks (host: on CUDA)
            record.update(peak_bytes=self.peak.bytes, host_peak_bytes=self.peak.host_bytes)
        self.history.append(record)
        self.bar.set_postfix(loss=f"{loss:.4f}", acc=f"{accuracy:.3f}", tok_s=f"{tokens / self.seconds:.0f}",
                             refresh=False)
        self.bar.update()
        if self.metrics:
            self.metrics.write(record)

    def summary(self):
        """Rank 0 prints the summary of the steps this run made (none: nothing), the model state counted with the
        last step's gradients."""
        self.bar.close()
        if self.history:
            summary(self.args, self.history, self.model, self.optimizer, self.n_params, self.run, self.traced)


def opening(args, run, n_params, start_step, traced):
    dp = run.world_size // args.sp
    usp = f" (ulysses {args.sp // args.ring} x ring {args.ring})" if args.ring > 1 else ""
    peak = f" | traced peak {traced['device'] / 2**20:,.2f} MiB per rank" if traced else ""  # CUDA runs are traced
    print(f"world {run.world_size} = dp {dp} x sp {args.sp}{usp} | zero {args.zero} | {n_params / 1e6:.2f}M parameters "
          f"| seq {args.seq_len} | global batch {dp * args.batch_size * args.grad_accum} sequences | {run.device} | "
          f"{args.dtype}{peak}")
    if run.documents is not None:
        samples = (args.steps - start_step) * dp * args.batch_size * args.grad_accum  # this run's steps
        print(f"data {args.data}: {data.describe(run.documents, args.pack, args.seq_len, samples)}")


def summary(args, history, model, optimizer, n_params, run, traced):
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).nbytes  # FSDP2: DTensors, count this rank's
    shards = [p for group in optimizer.param_groups for p in group["params"]]  # under ZeRO: this rank's
    state = [sum(local(p) for p in shards), sum(local(p.grad) for p in shards if p.grad is not None),
             sum(local(t) for p in shards for t in optimizer.state[p].values() if torch.is_tensor(t))]
    peaks = torch.tensor([float(history[-1]["peak_bytes"]), *map(float, state)], device=run.device)
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)  # bytes: peak, params, grads, AdamW state
    if run.rank != 0:
        return
    peak, params, grads, optim = peaks.tolist()
    mib, seconds = lambda b: f"{b / 2**20:,.2f} MiB", sum(r["seconds"] for r in history)
    print(f"final: loss {history[-1]['loss']:.4f} | accuracy {history[-1]['accuracy']:.4f}")
    print(f"throughput: {sum(r['tokens'] for r in history) / seconds:,.0f} tokens/s "
          f"({run.world_size} rank{'s' * (run.world_size > 1)}, {seconds:.1f} s)")
    print(f"model state per rank (max over ranks): params {mib(params)} + grads {mib(grads)} + optimizer "
          f"{mib(optim)} = {mib(params + grads + optim)}{' in host memory' * args.offload_optimizer}; unsharded fp32 "
          f"{mib(16 * n_params)}, / {run.world_size} rank{'s' * (run.world_size > 1)} = "
          f"{mib(16 * n_params / run.world_size)}")
    how = "torch.cuda.max_memory_allocated" if run.device.type == "cuda" else "storages counted, last step"
    traced_as = lambda key: f" (traced {mib(traced[key])})" if traced else ""  # memory.check's, on CUDA
    host = history[-1]["host_peak_bytes"]  # counted on a GPU with an offload; a CPU's host is the memory counted
    host = ("the same, on a CPU" if run.device.type == "cpu" else "nothing offloaded" if host is None else
            f"{mib(host)}{traced_as('host')}")
    print(f"peak tensor memory per rank (max over ranks, {how}): {mib(peak)}{traced_as('device')}; host memory: {host}")
    bytes_sent(args, model, run, len(history))
    heads = [len(r) for r in ulysses.head_layout(args.n_head, args.n_kv_head, args.sp // args.ring)[0]] \
        if "a" in args.layer_pattern else []
    if len(set(heads)) > 1:  # uneven: the rank with the most heads does the most attention work
        print(f"query heads per Ulysses rank {heads}: the busiest rank does "
              f"{max(heads) * len(heads) / sum(heads):.2f}x the mean attention work")


# ----------------------------------------------------------------------------------------------------------------
# the bytes of a step, sent and by the formula


def bytes_sent(args, model, run, steps):
    """The summary's byte lines: what rank 0 sent in one optimizer step, measured (the mean over the run's steps)
    and by the formula, and the calls a layer makes in a micro-step (all layers', where they are of two kinds)."""
    group, e = run.mesh.get_group("ulysses"), getattr(torch, args.dtype).itemsize
    tokens = memory.local_tokens(args)  # this rank's, per micro-step
    count = lambda per_layer: args.grad_accum * sum((2 if args.recompute else 1) * forward + backward
                                                    for forward, backward in per_layer)
    twice = "; the forward twice, as --recompute runs it again in backward" if args.recompute else ""
    print(f"bytes rank 0 sent in one optimizer step, all {args.n_layer} layers and {args.grad_accum} micro-step"
          f"{'s' * (args.grad_accum > 1)}, forward and backward{twice}:")
    exchanging = [block for block in model.blocks if block.kind == "a" or args.gdn_parallel == "ulysses"]
    exchanges = [exchange_bytes(args, group, tokens, e) if block.kind == "a" else block.attn.all_to_all_bytes(tokens, e)
                 for block in exchanging]
    alike = len({block.kind for block in exchanging}) <= 1  # else all layers' calls of a micro-step: 4 and 3 differ
    line("all-to-all", "calls", ulysses.all_to_all_stats, count(exchanges), len(exchanges) if alike else None, steps,
         args.grad_accum)
    if args.ring > 1:
        blocks = [ring_block_bytes(args, group, tokens, e) for block in model.blocks if block.kind == "a"]
        line("ring", "sends", ring.ring_stats, count(blocks), len(blocks), steps, args.grad_accum)
    if "d" in args.layer_pattern and args.gdn_parallel == "context":  # Gated DeltaNet's gathers: any seq-len alike
        summaries = [block.attn.context_bytes(args.batch_size, tokens // args.batch_size, e)
                     for block in model.blocks if block.kind == "d"]
        print(f"  context-parallel Gated DeltaNet: {sum(deltanet.context_stats.values()) / steps:,.0f} "
              f"(formula {count(summaries):,})")


def line(what, calls, stats, formula, layers, steps, micro_steps):
    """One byte line: the bytes sent, a step's mean, beside the formula's; the calls a layer makes a micro-step, or
    all layers together where they are of two kinds (layers None)."""
    sent = (stats["forward"]["bytes"] + stats["backward"]["bytes"]) / steps
    per = {way: stats[way]["calls"] / (steps * micro_steps * (layers or 1)) for way in stats}
    print(f"  {what}: {sent:,.0f} (formula {formula:,}); {calls} per {'' if layers is None else 'layer per '}micro-"
          f"step{', all layers' if layers is None else ''}: {per['forward']:g} forward, {per['backward']:g} backward")


def exchange_bytes(args, group, tokens, element_bytes):
    """(forward, backward) bytes this rank sends in one softmax attention layer on `tokens` local tokens: forward
    q, k and v to the other ranks' heads (seq_to_heads) and the output back (heads_to_seq); backward the output's
    gradient there, and those of q, k and v back. ulysses.all_to_all_bytes counts each exchange."""
    P, rank = ulysses.size_and_rank(group)
    query_heads, kv_heads = ulysses.head_layout(args.n_head, args.n_kv_head, P)
    per_head = tokens * (args.n_embd // args.n_head) * element_bytes
    (q_there, q_back), (kv_there, kv_back) = (ulysses.all_to_all_bytes(heads, rank, per_head)
                                              for heads in (query_heads, kv_heads))
    return q_there + 2 * kv_there + q_back, q_there + q_back + 2 * kv_back


def ring_block_bytes(args, group, tokens, element_bytes):
    """(forward, backward) bytes this rank sends around the ring in one softmax attention layer (ring.ring_bytes):
    the key/value block of the kv heads its kernel gets, for the U x `tokens` tokens of its Ulysses group; backward
    their gradients too, in float32 or wider."""
    U, rank = ulysses.size_and_rank(group)
    kv_heads = len(ulysses.kernel_kv_heads(args.n_head, args.n_kv_head, U, rank))
    block = 2 * tokens * U * kv_heads * (args.n_embd // args.n_head)  # k and v, elements
    return ring.ring_bytes(args.ring, block * element_bytes, block * max(4, element_bytes))
