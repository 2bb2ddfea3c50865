"""
Tests of memory: StorageBytes, the measurement, against bytes counted by hand; the traced step against the measured
peak, one configuration per flag (within 1%; equal to the byte when written); a deep model's trace, extended from
two shallow ones, against the full depth's; the longest sequence that fits; --plan's lines and README's plans; a GPU
run that cannot fit, refused before it starts; the H100's peaks held by the trace.
"""

import contextlib
import io
import json
import os
import re
from unittest.mock import patch

import pytest
import torch
import torch.multiprocessing as mp
from torch._subclasses.fake_tensor import FakeTensor

import train
import zero3
from conftest import HERE, PARAGRAPHS, bytes_line, run_ranks, train_rank
from harness import fakes, launch, memory


@torch.library.custom_op("test_memory::plus_one", mutates_args=())
def plus_one(x: torch.Tensor) -> torch.Tensor:
    ones = torch.ones_like(x)  # a temporary, freed before the operator returns
    return x + ones


def test_storage_bytes_counts_what_is_alive():
    """StorageBytes, the measurement behind every peak, against bytes counted by hand (float32: 4 bytes an
    element): the tensors that exist before count once, however many views of them; a view adds nothing; a tensor
    freed gives its bytes back; a storage resized to 0 and back, as ZeRO-3 frees and refills its gathered units,
    counts as it is; an operator's own temporaries count only with inside_operators."""
    existing, unit = torch.zeros(1000), torch.empty(1000)  # 4,000 bytes each
    with memory.StorageBytes([existing, existing[:10], unit]) as counter:  # 8,000
        a = torch.ones(2000)  # 16,000
        view = a[:100].view(10, 10)  # a view: the same storage
        b = a * 2  # 24,000
        del a, view, b  # 8,000
        unit.untyped_storage().resize_(0)  # 4,000: ZeRO-3 frees a gathered unit
        c = torch.empty(6000)  # 28,000: the peak (32,000 if the freed unit still counted)
        del c  # 4,000
        unit.untyped_storage().resize_(4000)  # 8,000: refilled
        assert counter.now == 8000
    assert counter.peak == 28000
    for inside_operators, peak in ((False, 8000), (True, 12000)):  # x and its result; with the temporary
        x = torch.zeros(1000)
        with memory.StorageBytes([x], inside_operators=inside_operators) as counter:
            plus_one(x)
        assert counter.peak == peak, inside_operators
    resize = torch.UntypedStorage.resize_
    with memory.StorageBytes([], inside_operators=True) as counter:  # counting inside an operator enters it again
        before = torch.zeros(1000)  # 4,000, made before the operator's call
        y = plus_one(torch.zeros(10))  # 40 in (freed after the call), a temporary of 40, 40 out
        del before  # freed after the call: seen freed
        assert counter.now == y.nbytes == 40
    assert counter.peak == 4120 and torch.UntypedStorage.resize_ is resize


def traced(argv, world_size, cuda=False, **changed):
    args = launch.parse_args(argv)
    launch.check_args(args, world_size)
    return memory.planned(args, world_size, train.build, cuda, **changed)


# one configuration per flag, on 2 ranks (ZeRO-3 the default there), and Ulysses 2 x ring 2 on 4 (packed in zigzag
# with seed 1, rank 0's shard lies in its row's first document: its position ids equal its token indices); with seed
# 2, Ulysses 4's rank 0 has the same position ids in both micro-steps, and its peers do not
FLAGS = {2: [[], ["--zero", "0"], ["--zero", "fsdp2"], ["--tiles", "4"], ["--loss-tiles", "4"],
             ["--recompute", "--offload"], ["--offload-optimizer"], ["--dtype", "bfloat16"],
             ["--n-kv-head", "2", "--mlp", "swiglu"], ["--window", "64"], ["--sinks"], ["--pack", "--window", "64"],
             ["--data", os.path.join(HERE, "README.md"), "--pack", "--window", "64"], ["--pack", "--ring", "2"],
             ["--ring", "2"], ["--pack", "--ring", "2", "--window", "64"], ["--layer-pattern", "da"],
             ["--layer-pattern", "da", "--gdn-parallel", "context", "--pack"]],
         4: [["--sp", "4", "--ring", "2", "--seq-len", "4096"],
             ["--sp", "4", "--ring", "2", "--seq-len", "4096", "--pack", "--balance", "zigzag", "--seed", "1"],
             ["--sp", "4", "--pack", "--window", "64", "--grad-accum", "2", "--seed", "2"]]}


def train_rank_gloo_late(rank, world_size, runs):
    """train_rank, with gloo's worker thread as late as it may be: it holds the copy of the input that each
    reduce-scatter makes until the next reduce-scatter, which here is when it lets go of it."""
    held, reduce_scatter = [], zero3.reduce_scatter

    def late(*args, **kwargs):
        work = reduce_scatter(*args, **kwargs, async_op=True)
        work.wait()
        held[:] = [work]
    zero3.reduce_scatter = late
    return train_rank(rank, world_size, runs)


@pytest.mark.parametrize("world_size", sorted(FLAGS))
def test_the_trace_equals_the_measured_peak(world_size):
    """memory.planned traces train.py's step on fake tensors in this one process (a fake process group of the run's
    ranks, token data real) against the peak the run measures on gloo processes (the busiest rank's, the last of 2
    steps, the operators' own buffers counted): within 1% for each flag (a --data file's packed documents too: their
    lengths set attention's memory), USP as Ulysses 1 x ring 2 and 2 x ring 2 (packed too), both ways of Gated
    DeltaNet, the context way with packed documents (they agreed to the byte when this was written). Also the ring's
    bytes against bytes counted by hand: a rank's key/value block is k and v of its Ulysses group's 2,048 tokens, of
    its 2 heads of 32 (1,048,576 bytes); each layer sends one block forward, and backward the block and 2 float32
    accumulators. gloo's reduce-scatter copies its input, which NCCL does not, and its thread lets go of the copy
    a moment after the call, or later: ZeRO-3's reduce-scatters here hold it until the next, and the count leaves it
    out."""
    runs = [["--seq-len", "1024", *flags, "--steps", "2", "--batch-size", "1"] for flags in FLAGS[world_size]]
    per_rank = run_ranks(world_size, train_rank_gloo_late, runs)
    for i, argv in enumerate(runs):
        measured = max(rank[i][0][-1]["peak_bytes"] for rank in per_rank)
        peak = traced(argv, world_size)["device"]
        assert abs(peak / measured - 1) < 0.01, (argv, peak, measured)
    if world_size == 4:
        assert bytes_line(per_rank[0][0][1], "ring") == [8 * 1048576, 8 * 1048576, 1, 3]  # 1 send forward, 3 back


def _traced_twice(argv):
    args = launch.parse_args(argv)
    launch.check_args(args, 2)
    return [memory.trace(args, 2, train.build, cuda=False)["device"] for _ in range(2)]


def test_an_fsdp2_trace_is_the_same_whatever_was_traced_before():
    """DTensor (FSDP2) learns a new op's output shape on fake copies of its inputs at their global size, once per
    shape, in the first step a process runs: the count leaves them out, so that the first trace in a process (a fresh
    one here) equals the next."""
    argv = ["--seq-len", "64", "--batch-size", "1", "--steps", "2", "--zero", "fsdp2", "--n-layer", "5", "--recompute"]
    with mp.get_context("forkserver").Pool(1) as fresh:
        first, second = fresh.apply(_traced_twice, (argv,))
    assert first == second


DEEP = [["--n-layer", "6", "--recompute"],
        ["--n-layer", "11", "--layer-pattern", "da", "--gdn-parallel", "context", "--ring", "2"],
        ["--n-layer", "9", "--recompute", "--offload", "--offload-optimizer", "--tiles", "2", "--plan", "2x80"],
        ["--n-layer", "8", "--zero", "fsdp2", "--sinks", "--pack", "--plan", "2x80"],
        ["--n-layer", "16", "--zero", "0", "--steps", "1", "--recompute", "--offload", "--tiles", "4", "--plan", "2x80",
         "--seq-len", "4096"]]


@pytest.mark.parametrize("argv", DEEP, ids=["6-layers-recomputed", "da-context-ring", "offloaded-cuda",
                                            "fsdp2-packed-cuda", "the-first-step-overtakes"])
def test_a_deep_trace_is_the_line_through_two_shallow_ones(argv):
    """Beyond four periods of --layer-pattern, memory.planned traces three and four periods (and the layers of a
    period begun) and extends each segment of the step along its line to the run's depth. Equal to the byte to the
    trace at full depth, device and host, as on CPU and as on CUDA (--plan). In the first, the peak is a middle
    block's recomputation, which no segment of an end block reaches. In the last, the first optimizer step (AdamW's
    moments made beside every gradient) overtakes the backward only past 3 layers: one line through the whole step's
    peaks would come out at half the peak."""
    argv = ["--seq-len", "512", "--batch-size", "1", "--steps", "2"] + argv
    args = launch.parse_args(argv)
    launch.check_args(args, 2)
    planned = memory.planned(args, 2, train.build, cuda=bool(args.plan))
    assert planned["how"].endswith(f"extended to {args.n_layer}"), planned
    full = memory.trace(args, 2, train.build, cuda=bool(args.plan))
    assert (planned["device"], planned["host"]) == (full["device"], full["host"])


def test_the_longest_sequence_that_fits():
    """memory.longest, by traces: the longest sequence that fits 40 MiB on 2 ranks fits, and one 1% longer does not;
    none fits 1 MiB; the search takes few traces (each step aims where the line through the last two meets the
    memory). And on a line: the least sequence (--sp tokens) when it alone fits, however near the next one is."""
    argv, memory_bytes, calls = ["--batch-size", "1", "--steps", "2"], 40 * 2**20, []

    def peak(S):
        calls.append(S)
        return traced(argv, 2, seq_len=S)["device"]
    n = memory.longest(peak, 1000, memory_bytes, 0.01, least=2)
    assert peak(n) <= memory_bytes < peak(int(n * 1.01) + 1), n
    assert len(calls) <= 10, calls
    assert memory.longest(peak, 1000, 2**20, 0.01, least=2) == 0
    assert memory.longest(lambda S: 10**5 + 1000 * S, 1000, 10**5 + 100_900, 0.01, least=100) == 100


def test_the_search_traces_no_longer_than_this_machine_allows(monkeypatch, capsys):
    """The line through two traces may aim far past what this machine can trace (a small model's peaks at 32 and 64
    tokens once aimed at 2.7 billion, whose token data alone is 20 GiB): each trace is at most `most` of the longest
    before it, and where the longest that fits reaches it, the search stops and --plan says so. traceable: 8x the
    longest traced, or less after a trace that took much of the free memory, or a minute and more."""
    calls = []
    peak = lambda S: calls.append(S) or 10**5 + S  # meets 10**12 bytes near 10**12 tokens
    assert memory.longest(peak, 32, 10**12, 0.01, most=lambda seen: min(8 * seen, 10**6)) == 10**6
    assert max(calls) == 10**6 and all(S <= 8 * max(calls[:i + 1]) for i, S in enumerate(calls[1:])), calls
    calls.clear()  # a bound that moves a token a trace: no creeping up to it in steps below the tolerance
    assert memory.longest(peak, 32, 10**12, 0.01, most=lambda seen: 60_000 + len(calls)) >= 59_000 and len(calls) < 12
    assert memory.longest(lambda S: S, 1000, 60, 0.01, least=40, most=lambda seen: 50) == 60  # none fits yet: unbound
    held = memory.resource.getrusage(memory.resource.RUSAGE_SELF).ru_maxrss * 1024
    traceable = lambda held, *seconds: memory.traceable(held, {1000 * (i + 1): {"seconds": t} for i, t in
                                                               enumerate(seconds)})  # traces of 1000, 2000, ... tokens
    assert 1000 < traceable(held, 1.0) <= 8000 and traceable(held - 2**50, 1.0) < 1000  # memory: 2**50 bytes taken
    assert traceable(held, 70.0, 70.0) == 16000 and traceable(held, 120.0) == 2000  # time: flat, or twice the first
    assert traceable(held, 30.0, 60.0) == 2000  # a minute at 2,000 tokens, and growing with them: none longer
    monkeypatch.setattr(memory, "free_memory", lambda: 2**40)  # a machine with a TiB free: the time and growth bounds
    assert traceable(held, 1.0) == 8000
    monkeypatch.setattr(memory, "free_memory", lambda: 2**20 // 2)  # half a MiB free: nothing longer
    assert traceable(held, 1.0) < 1000
    monkeypatch.setattr(memory, "traceable", lambda held, traces: min(8 * max(traces), 5000))
    assert train.main(["--plan", "1x80", "--seq-len", "64", "--batch-size", "1", "--n-embd", "16"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("longest sequence that fits: 5,000 tokens or more (a "
                                                               "longer one's trace would take too long, or 2/3 of the "
                                                               "free memory; the search traced for ")


def test_free_memory_is_the_machines_within_its_containers_limit(tmp_path):
    """free_memory: MemAvailable from /proc/meminfo, within a cgroup's limit less what it uses (version 2 or 1; the
    root's, a container's, and the process's own, a job's), never above the machine's; a limit of "max", or no file
    at all, is no bound."""
    def machine(files):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        for path, text in files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
        return memory.free_memory(root)
    meminfo = {"proc/meminfo": "MemTotal:       33554432 kB\nMemAvailable:    8388608 kB\n"}  # 8 GiB available
    v2 = lambda limit, used: {"sys/fs/cgroup/memory.max": limit, "sys/fs/cgroup/memory.current": f"{used}\n"}
    v1 = {"sys/fs/cgroup/memory/memory.limit_in_bytes": f"{2**31}\n", "sys/fs/cgroup/memory/memory.usage_in_bytes": "0"}
    assert machine(meminfo) == 8 * 2**30
    assert machine({**meminfo, **v2(f"{4 * 2**30}\n", 2**30)}) == 3 * 2**30  # a limit of 4 GiB, 1 GiB used
    assert machine({**meminfo, **v2(f"{64 * 2**30}\n", 0)}) == 8 * 2**30  # a limit above what the machine has
    assert machine({**meminfo, **v2("max\n", 2**30)}) == 8 * 2**30
    assert machine({**meminfo, **v1}) == 2 * 2**30
    nested = {"proc/self/cgroup": "0::/slurm/job_7\n", "sys/fs/cgroup/slurm/job_7/memory.max": f"{2**30}",
              "sys/fs/cgroup/slurm/job_7/memory.current": "0"}  # a job's own cgroup, below the root's
    assert machine({**meminfo, **v2("max", 0), **nested}) == 2**30
    nested_v1 = {"proc/self/cgroup": "9:name=systemd:/\n4:memory:/slurm/job_7\n",
                 "sys/fs/cgroup/memory/slurm/job_7/memory.limit_in_bytes": f"{2**29}",
                 "sys/fs/cgroup/memory/slurm/job_7/memory.usage_in_bytes": "0"}
    assert machine({**meminfo, **nested_v1}) == 2**29
    assert machine({}) == float("inf")


def test_a_plan_prints_the_traced_peak_and_the_longest_sequence(capsys, tmp_path):
    """--plan NxG: the traced peak per GPU against G GiB and the longest sequence that fits, in one process, no GPU,
    and with --metrics the same as a JSON line; one that does not fit exits 1 after its lines; unpacked text searches
    past the length of its file (its sequences' memory does not depend on it); a --plan that is not NxG is one line."""
    metrics = tmp_path / "new folder" / "plan.jsonl"
    assert train.main(["--plan", "8x1", "--n-layer", "3", "--n-head", "8", "--seq-len", "65536", "--batch-size", "1",
                       "--recompute", "--offload", "--compile", "--metrics", str(metrics)])
    printed = capsys.readouterr().out
    plan = json.loads(metrics.read_text())
    assert f"fits: {memory.size(plan['peak_bytes'])} of 1.0 GiB" in printed, (plan, printed)
    assert f"longest sequence that fits: {plan['longest']:,} tokens" in printed, (plan, printed)
    assert re.match(r"plan: 8 GPUs, sp 8, seq 65,536: fits: [\d.]+ MiB of 1.0 GiB per GPU for 8,192 tokens per rank, "
                    r"and [\d.]+ MiB of CPU memory per GPU \(the step traced on fake tensors, rank 0, 3 layers, \d+ s; "
                    r"eager, as --compile is not traced\)\nlongest sequence that fits: [\d,]+ tokens \(within 1%; "
                    r"the search traced for \d+ s\)\n$", printed), printed
    with pytest.raises(SystemExit, match=r"^1$"):  # its model state alone is 7 MiB
        train.main(["--plan", "1x0.001", "--seq-len", "100000"])
    printed = capsys.readouterr().out
    assert re.search(r"seq 100,000: does NOT fit: [\d.,]+ [GM]iB of 1.0 MiB .*\nlongest sequence that fits: none",
                     printed), printed
    text = tmp_path / "text.txt"  # unpacked text is S tokens of one document: the copy task's memory at any S
    text.write_text(PARAGRAPHS)  # 973 bytes, fewer than the search's longer sequences
    assert train.main(["--plan", "1x0.02", "--seq-len", "64", "--batch-size", "1", "--data", str(text)])
    assert int(capsys.readouterr().out.split("longest sequence that fits: ")[1].split()[0].replace(",", "")) > 974
    for plan in ("8", "8xinf", "8x0", "0x80", "8xnan", "1048577x80", "8x1048577"):
        with pytest.raises(SystemExit, match=rf"--plan {plan}: write it as GPUSxGIB, 1 to 1,048,576 GPUs of more "
                                             rf"than 0 and at most 1,048,576 GiB, e.g. 8x80"):
            train.main(["--plan", plan])


def _readme_plan(command):
    """(whether it fits, the plan line) of `python train.py COMMAND`, in a process of its own, the search for the
    longest sequence left out (minutes at README's lengths; test_the_longest_sequence_that_fits holds it)."""
    memory.longest = lambda *args: 0
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            fits = train.main(command.split())
        except SystemExit:  # a plan that does not fit
            fits = False
    return fits, printed.getvalue().splitlines()[0]


def test_readme_plans_fit_as_written():
    """Every `python train.py --plan ...` line of README runs as written and fits (README offers each as a way to
    train its --seq-len), and its plan line is the one README quotes, the seconds apart. The plans are traced side
    by side, one process each."""
    with open(os.path.join(HERE, "README.md")) as f:
        readme = f.read()
    commands = re.findall(r"^python train\.py (--plan .*)$", readme, re.M)
    assert len(commands) == 2
    with mp.get_context("forkserver").Pool(len(commands)) as processes:
        for command, (fits, line) in zip(commands, processes.map(_readme_plan, commands)):
            seconds = lambda text: re.sub(r"\d+ s\b", "N s", text)
            assert fits and re.match(r"plan: .*: fits: ", line) and seconds(line) in seconds(readme), (command, line)


def test_a_run_that_cannot_fit_the_gpu_is_refused(monkeypatch):
    """On CUDA a run's step is traced before it starts (before any process group) and weighed against its GPU's free
    memory (torch.cuda.mem_get_info; here stand-ins of one GPU with 1 GiB free of 80): one line, with what it would
    need. One that fits gets its trace back, for the opening line and the summary. Two ranks sharing the GPU over
    gloo need twice one's memory. On CPU, or inside a caller's own process group, nothing is traced."""
    free = [2**30]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 80 * 2**30))
    args = launch.parse_args(["--device", "cuda", "--seq-len", "1000000", "--batch-size", "1"])
    with pytest.raises(launch.Mistake, match=r"^this run would need [\d.]+ GiB per rank, 1,000,000 tokens on each "
                                             r"\(its step traced on fake tensors\), 1 rank\(s\) on GPU 0, "
                                             r"against 1.0 GiB free there; --plan 1x1 finds the longest sequence "
                                             r"that fits$"):
        memory.check(args, train.build)
    fits = memory.check(launch.parse_args(["--device", "cuda"]), train.build)
    assert 0 < fits["device"] < 2**30, fits
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    shared = ["--device", "cuda", "--backend", "gloo"]
    free[0] = 3 * traced(shared, 2, cuda=True)["device"] // 2  # one rank's 1.5 times
    with pytest.raises(launch.Mistake, match=r", 2 rank\(s\) on GPU 0, "):
        memory.check(launch.parse_args(shared), train.build)
    assert memory.check(launch.parse_args(["--device", "cpu"]), train.build) is None
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    assert memory.check(launch.parse_args(["--device", "cuda"]), train.build) is None


def test_a_traced_run_prints_its_trace(monkeypatch, capsys):
    """What the fit check returns on CUDA (here a stand-in on CPU) is the run's traced peak: in its opening line, and
    beside the measured peak in its summary."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setattr(memory, "check", lambda args, build: {"device": 3 * 2**20, "host": 5 * 2**20})
    train.main(["--steps", "1"])
    out = capsys.readouterr().out
    assert "| traced peak 3.00 MiB per rank" in out, out
    assert re.search(r"^peak tensor memory per rank \(.*\): [\d,.]+ MiB \(traced 3.00 MiB\); ", out, re.M), out


def test_a_trace_makes_token_data_real_and_masks_fake():
    """The trace's tensors: integer factories (positions, token indices) hold values, so that what is computed from
    them traces; a boolean mask stays fake, as an [S, S] one of a window would fill host memory at a planned S."""
    with fakes.FakeTensors():
        positions, mask = torch.arange(6), torch.ones(6, 6, dtype=torch.bool).tril()
        assert not isinstance(positions, FakeTensor) and positions.sum().item() == 15
        assert isinstance(mask, FakeTensor) and isinstance(torch.zeros(3), FakeTensor)


M1B = ["--n-layer", "16", "--n-embd", "2048", "--n-head", "16", "--n-kv-head", "4", "--batch-size", "1",
       "--device", "cuda", "--plan", "1x80"]
H100_PEAKS = [(["--seq-len", "8192", "--steps", "8"], 18.406), (["--seq-len", "32768", "--steps", "8"], 45.738),
              (["--seq-len", "131072", "--tiles", "16", "--recompute", "--offload", "--steps", "1"], 15.840),
              (["--seq-len", "262144", "--tiles", "16", "--recompute", "--offload", "--steps", "1"], 22.542)]  # GiB


@pytest.mark.parametrize("argv, measured", H100_PEAKS, ids=["8k", "32k", "128k-offload", "256k-offload"])
def test_the_trace_holds_to_an_h100s_peaks(argv, measured):
    """The trace as on CUDA against the peaks one H100 measured (torch.cuda.max_memory_allocated of a run's last
    step; torch 2.11; `python train.py --device cuda` with a 0.7B model in bf16, BENCHMARKS.md's GPU section): within
    1%, the 16 layers extended from 3 and 4."""
    assert abs(traced(M1B + argv, 1, cuda=True)["device"] / 2**30 / measured - 1) < 0.01


LLAMA_PLAN = ["--model", "llama3-8b", "--n-layer", "2", "--plan", "8x80", "--seq-len", "65536", "--batch-size", "1",
              "--tiles", "4", "--loss-tiles", "16", "--recompute"]


def test_offloads_move_memory_from_the_gpu_to_the_host():
    """Llama-3-8B's shapes (2 of its 32 layers), 64k tokens on 8 GPUs, traced as on CUDA, where host and device are
    apart: --offload puts each block's input in CPU memory (with RoPE's tables); with --offload-optimizer the GPU
    holds none of the optimizer (float32 shards and AdamW's moments, 12 bytes a parameter of this rank's) and CPU
    memory holds it, the gradients and a bf16 copy (18 bytes)."""
    peaks = {}
    for name, offloads in (("kept", []), ("offload", ["--offload"]), ("optimizer too", ["--offload",
                                                                                      "--offload-optimizer"])):
        args = launch.parse_args(LLAMA_PLAN + offloads)
        launch.check_args(args, 8)
        peaks[name] = memory.trace(args, 8, train.build, cuda=True)
    local = (2 * 218_112_000 + 525_336_576 + 525_340_672) / 8  # this rank's parameters: 2 blocks, embedding, head
    assert peaks["offload"]["device"] - peaks["optimizer too"]["device"] > 12 * local * 0.95, peaks
    assert peaks["optimizer too"]["host"] - peaks["offload"]["host"] > 18 * local, peaks
    # --offload: each block's float32 input [8192, 4096] in CPU memory, and RoPE's cos and sin [8192, 128] with it
    assert peaks["offload"]["host"] - peaks["kept"]["host"] == 2 * 8192 * 4 * (4096 + 2 * 128), peaks


def test_the_trace_is_of_the_busiest_rank():
    """6 heads and 2 kv heads on 4 ranks: rank 1 holds query heads 2 and 3, which use both kv heads, so its kernel
    gets the most heads. memory.traced_ranks picks it alone, and its traced peak is the largest of the 4 ranks'. Under
    a ring with a window the ring ranks' work differs: both are traced, and the plan's peak is the larger. Packed
    documents differ by ring rank and data group too."""
    args = launch.parse_args(["--n-head", "6", "--n-kv-head", "2", "--n-embd", "192", "--seq-len", "8192",
                              "--batch-size", "1"])
    launch.check_args(args, 4)
    peaks = [memory.trace(args, 4, train.build, cuda=False, rank=rank)["device"] for rank in range(4)]
    assert memory.traced_ranks(args, 4) == [1] and peaks[1] == max(peaks) > min(peaks), peaks
    windowed = ["--seq-len", "2048", "--ring", "2", "--window", "128", "--batch-size", "1", "--steps", "2"]
    args = launch.parse_args(windowed)
    launch.check_args(args, 2)
    peaks = [memory.trace(args, 2, train.build, cuda=False, rank=rank)["device"] for rank in range(2)]
    assert memory.traced_ranks(args, 2) == [0, 1] and traced(windowed, 2)["device"] == peaks[1] > peaks[0], peaks
    packed = launch.parse_args(["--sp", "4", "--ring", "2", "--pack"])  # on 8: dp 2 x ring 2 x ulysses 2
    launch.check_args(packed, 8)
    assert memory.traced_ranks(packed, 8) == [0, 2, 4, 6]  # Ulysses rank 0 of each ring rank of each data group
