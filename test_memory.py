"""
Tests of memory: memory.StorageBytes, the measurement, against bytes counted by hand; the predicted peak per rank
within 8% of what PeakMemory measures for eleven runs (a ring run: 20%); a run that cannot fit is refused before it
starts, and --plan prints what would fit; every --plan line of README fits as written; a ring run's bytes and
memory.
"""

import os
import re
import time
from functools import partial
from unittest.mock import patch

import pytest
import torch

import train
from conftest import HERE, bytes_line, run_ranks, train_rank
from harness import launch, memory


PREDICTION_ERROR = 0.08  # BENCHMARKS: "the tests hold ... to 8%"


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


def _measured_peaks(world_size, runs):
    """The measured peak per rank of the last of 2 steps of each run (batch 1), the busiest rank's."""
    per_rank = run_ranks(world_size, train_rank, [argv + ["--steps", "2", "--batch-size", "1"] for argv in runs])
    return [max(rank[i][0][-1]["peak_bytes"] for rank in per_rank) for i in range(len(runs))]


def _assert_predicted(argv, world_size, measured, error=PREDICTION_ERROR):
    args = launch.parse_args(argv + ["--batch-size", "1"])
    launch.check_args(args, world_size)
    predicted = memory.predicted(args, world_size)["peak"]
    assert abs(predicted / measured - 1) < error, (argv, world_size, predicted, measured)


MEMORY_RUNS = {1: [["--seq-len", "1024"], ["--seq-len", "4096", "--tiles", "4", "--recompute"],
                   ["--seq-len", "2048", "--window", "64"]],
               2: [["--seq-len", "4096"], ["--seq-len", "1024", "--tiles", "4", "--recompute"],
                   ["--seq-len", "2048", "--window", "64", "--dtype", "bfloat16"]],
               4: [["--seq-len", "4096", "--recompute"], ["--seq-len", "4096", "--tiles", "4"]]}


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_memory_prediction_is_within_8_percent(world_size):
    """train.py's predicted peak per rank against the peak it measures, for sp 1, 2 and 4, with and without
    tiles and recomputation, at 1k and 4k tokens (configurations of BENCHMARKS.md's memory table), and with a
    sliding window, whose [S, S] mask SDPA keeps for backward, a layer's in the compute dtype (left out, the
    predictions came out 37% and 44% under)."""
    for argv, measured in zip(MEMORY_RUNS[world_size], _measured_peaks(world_size, MEMORY_RUNS[world_size])):
        _assert_predicted(argv, world_size, measured)


def test_a_window_over_packed_documents_is_predicted(tmp_path):
    """--pack with a sliding window on SDPA runs it a document at a time, and SDPA keeps each document's [n, n] mask
    for backward: documents longer than the sequence make one [S, S] mask a row, what the prediction counts (it
    was 38% under before it counted them): within 8%."""
    text = tmp_path / "long.txt"
    text.write_text("\n\n".join(f"paragraph {i} " * 400 for i in range(6)))  # paragraphs of about 5,000 bytes
    argv = ["--seq-len", "2048", "--window", "64", "--pack", "--data", str(text)]
    _assert_predicted(argv, 1, _measured_peaks(1, [argv])[0])


def test_a_run_that_cannot_fit_is_refused_and_a_plan_is_printed(one_rank, capsys):
    start = time.time()
    with pytest.raises(SystemExit, match=r"this run would need [\d,.]+ GiB per rank for 100,000,000 tokens a rank "
                                         r"\(model state .*\), against [\d,.]+ GiB; about [\d,]+ tokens would fit; "
                                         r"--recompute: [\d,.]+ GiB; --tiles 16: [\d,.]+ GiB$"):
        train.main(["--seq-len", "100000000"])
    assert time.time() - start < 5
    assert train.main(["--plan", "8x80", "--n-layer", "32", "--n-embd", "4096", "--n-head", "32", "--n-kv-head", "8",
                       "--seq-len", "1048576", "--batch-size", "1", "--tiles", "64", "--recompute", "--offload"])
    plan = re.search(r"^plan: 8 GPUs, sp 8, seq 1,048,576: fits: ([\d.]+) GiB per rank for 131,072 tokens a rank "
                     r"\(model state ([\d.]+) GiB \+ the larger of activations ([\d.]+) GiB and the optimizer "
                     r"step's gradients and temporaries ([\d.]+) GiB; [\d.]+ GiB more in CPU memory\), against "
                     r"80.0 GiB; about [\d,]+ tokens would fit", capsys.readouterr().out)
    peak, state, activations, step = map(float, plan.groups())
    assert abs(state + max(activations, step) - peak) <= 0.1  # the parts add up, to the printed rounding
    for plan in ("8", "8xinf", "8x0", "0x80", "8xnan"):
        with pytest.raises(SystemExit, match=rf"--plan {plan}: write it as GPUSxGIB, at least one GPU of more than 0 "
                                             rf"GiB, e.g. 8x80"):
            train.main(["--plan", plan])
    with pytest.raises(SystemExit, match=r"^1$"):  # a plan that does not fit fails, after its line
        train.main(["--plan", "1x1", "--seq-len", "10000000"])
    assert "plan: 1 GPU, sp 1, seq 10,000,000: does NOT fit" in capsys.readouterr().out
    # Gated DeltaNet layers alone split by their value heads, so sp may pass n_head: checked and planned
    assert train.main(["--plan", "4x80", "--layer-pattern", "d", "--n-head", "2", "--gdn-v-heads", "4"])
    assert "plan: 4 GPUs, sp 4, seq 128: fits" in capsys.readouterr().out


def test_readme_plans_fit_as_written(capsys):
    """Every `python train.py --plan ...` line of README runs as written, and fits (README offers each as a way
    to train its --seq-len): its line says so and the command succeeds; the line README quotes is the one it prints."""
    with open(os.path.join(HERE, "README.md")) as f:
        readme = f.read()
    commands = re.findall(r"^python train\.py (--plan .*)$", readme, re.M)
    assert len(commands) == 3
    for command in commands:
        capsys.readouterr()
        assert train.main(command.split()), command  # a plan that does not fit ends in SystemExit(1)
        printed = capsys.readouterr().out.strip()
        seq = int(command.split("--seq-len ")[1].split()[0])
        assert re.match(rf"plan: \d+ GPUs?, sp \d+.*, seq {seq:,}: fits: ", printed), printed
        if "--ring" in command:
            assert f"```\n{printed}\n```" in readme


def test_ring_bytes_and_memory():
    """Ulysses 2 x ring 2 on 4 ranks, 4,096 tokens: the summary's ring line against bytes counted by hand (a rank's
    key/value block is k and v of its Ulysses group's 2,048 tokens, of its 2 heads of 32: 2 * 2,048 * 2 * 32 * 4 =
    1,048,576 bytes; each layer sends one block forward, and backward the block again and 2 float32 dk/dv
    accumulators; 2 layers: 8 * 1,048,576 bytes a step), and the predicted peak per rank within 20% of the
    measured one: the prediction counts the ring's own buffers (its backward's blocks and accumulators, 5.5 MiB
    here), which live inside the ring's operator, where the measurement does not look (it came out 18% above)."""
    argv = ["--sp", "4", "--ring", "2", "--seq-len", "4096"]
    per_rank = run_ranks(4, train_rank, [argv + ["--steps", "2", "--batch-size", "1"]])
    assert bytes_line(per_rank[0][0][1], "ring") == [8 * 1048576, 8 * 1048576, 1, 3]  # sends: 1 forward, 3 backward
    _assert_predicted(argv, 4, max(rank[0][0][-1]["peak_bytes"] for rank in per_rank), error=0.2)


def test_memory_prediction_counts_sinks_and_the_ring_layout():
    """A packed Ulysses 2 x ring 2 run with attention sinks, 4,096 tokens, balanced per document: predicted within
    20% of its measured peak, as for any ring run (test_ring_bytes_and_memory: the ring's own buffers). The sink
    logits are parameters (without ZeRO, 12 bytes of state each: the weight and AdamW's two moments). Packing under
    the ring adds to the activations the Ulysses group's copy of the layout and, on CPU, what each of the 2 softmax
    layers keeps: every ring token's document and position, 8 bytes each (with U = 2 and 4 ranks: 8 x (2 + 2 x 4 x
    2) = 144 bytes a local token)."""
    argv = ["--sp", "4", "--ring", "2", "--seq-len", "4096", "--pack", "--sinks"]
    per_rank = run_ranks(4, train_rank, [argv + ["--steps", "2", "--batch-size", "1"]])
    _assert_predicted(argv, 4, max(rank[0][0][-1]["peak_bytes"] for rank in per_rank), error=0.2)
    args = launch.parse_args(argv + ["--batch-size", "1"])
    launch.check_args(args, 4)
    with_sinks, without = (memory.predicted(args, 4, zero="0", sinks=sinks)["state"] for sinks in (True, False))
    assert with_sinks - without == 12 * args.n_layer * args.n_head
    packed, unpacked = (memory.predicted(args, 4, pack=pack)["activations"] for pack in (True, False))
    assert packed - unpacked == memory.local_tokens(args) * 8 * (2 + 2 * 4 * 2)


@pytest.mark.parametrize("world_size, argv", [(4, ["--sp", "4"]), (4, ["--sp", "4", "--ring", "2"])],
                         ids=["sp4", "ulysses2xring2"])
def test_context_memory_prediction_is_within_8_percent(world_size, argv):
    """memory.predict_memory counts what the context way keeps: within 8% of the measured peak of the busiest
    rank, as for the other layouts (test_memory_prediction_is_within_8_percent)."""
    argv = argv + ["--layer-pattern", "ddda", "--gdn-parallel", "context", "--seq-len", "4096"]
    _assert_predicted(argv, world_size, _measured_peaks(world_size, [argv])[0])


ZERO3_UNITS = ["--n-layer", "2", "--n-embd", "512", "--seq-len", "64", "--batch-size", "1", "--steps", "2"]


def _zero3_units_rank(rank, world_size):
    return [train.main(ZERO3_UNITS + ["--dtype", dtype])[-1]["peak_bytes"] for dtype in ("bfloat16", "float32")]


def test_memory_prediction_counts_a_units_gradient():
    """ZeRO-3 over 4 ranks with blocks of 3.1M parameters and 64 tokens: a unit's whole gradient, and in bf16 its
    float32 copy for the sum over the ranks, outweigh the activations. The prediction is within 10% of the measured
    peak in bf16 and float32 (without the gradient it was 17% and 13% low)."""
    per_rank = run_ranks(4, _zero3_units_rank)
    for dtype, peak in zip(("bfloat16", "float32"), map(max, zip(*per_rank))):
        args = launch.parse_args(ZERO3_UNITS + ["--dtype", dtype])
        launch.check_args(args, 4)
        predicted = memory.predicted(args, 4)["peak"]
        assert abs(predicted / peak - 1) < 0.1, (dtype, predicted, peak)


def test_a_run_that_cannot_fit_the_gpu_is_refused(monkeypatch):
    """On CUDA the refusal weighs the prediction against the GPU's free memory (torch.cuda.mem_get_info; here
    stand-ins of a GPU with 1 GiB free of 80): one line with what would fit, before anything is allocated."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 80 * 2**30))  # the current GPU
    args = launch.parse_args(["--device", "cuda", "--seq-len", "1000000", "--batch-size", "1"])
    launch.check_args(args, 1)
    with pytest.raises(launch.Mistake, match=r"^this run would need [\d.]+ GiB per rank for 1,000,000 tokens a rank "
                                             r"\(model state .*\), against 1.0 GiB; about [\d,]+ tokens would fit"):
        memory.check_memory(args, 1)


M1B = ["--n-layer", "16", "--n-embd", "2048", "--n-head", "16", "--n-kv-head", "4", "--batch-size", "1",
       "--device", "cuda", "--plan", "1x80"]
H100_PEAKS = [(["--seq-len", "8192", "--steps", "8"], 18.406), (["--seq-len", "32768", "--steps", "8"], 45.738),
              (["--seq-len", "131072", "--tiles", "16", "--recompute", "--offload", "--steps", "1"], 15.840),
              (["--seq-len", "262144", "--tiles", "16", "--recompute", "--offload", "--steps", "1"], 22.542)]  # GiB


@pytest.mark.parametrize("argv, measured", H100_PEAKS, ids=["8k", "32k", "128k-offload", "256k-offload"])
def test_the_cuda_prediction_holds_to_an_h100s_peaks(argv, measured):
    """The prediction for CUDA against the peaks one H100 measured (torch.cuda.max_memory_allocated of a run's last
    step; torch 2.11; `python train.py --device cuda` with a 0.7B model in bf16, BENCHMARKS.md's GPU section): within
    10%. The prediction is for a step after the first, which finds AdamW's moments made; the two offloaded runs
    measured their first (--steps 1). There the dry run stands in: it traces that first step within 2% of the H100's
    peak, and the prediction is held to its trace of a second step."""
    args = launch.parse_args(M1B + argv)
    launch.check_args(args, 1)
    predicted = memory.predicted(args, 1)["peak"] / 2**30
    if args.steps == 1:
        assert abs(memory.dry_run(args, 1, partial(train.build, args))["device"] / 2**30 / measured - 1) < 0.02
        args.steps = 2
        measured = memory.dry_run(args, 1, partial(train.build, args))["device"] / 2**30
    assert abs(predicted / measured - 1) < 0.1, (argv, predicted, measured)


DRY_RUNS = [["--seq-len", "2048"], ["--seq-len", "2048", "--tiles", "4", "--recompute", "--offload-optimizer"],
            ["--seq-len", "2048", "--zero", "fsdp2", "--dtype", "bfloat16"],
            ["--seq-len", "2048", "--n-kv-head", "2", "--mlp", "swiglu", "--vocab-size", "1000"]]


def test_dry_run_equals_the_measured_peak():
    """memory.dry_run traces train.py's real step on fake tensors, in this one process with a fake process group of 2
    ranks, as a CPU runs it: its peak is within 0.5% of the peak 2 gloo ranks measure running the same step (ZeRO-3,
    tiles and recomputation with the optimizer in host memory, FSDP2 in bf16, GQA with a SwiGLU MLP; they agreed
    to the byte when this was written)."""
    measured = _measured_peaks(2, DRY_RUNS)
    for argv, peak in zip(DRY_RUNS, measured):
        args = launch.parse_args(argv + ["--batch-size", "1"])
        launch.check_args(args, 2)
        traced = memory.dry_run(args, 2, partial(train.build, args), cuda=False)
        assert abs(traced["device"] / peak - 1) < 0.005, (argv, traced, peak)


LLAMA_PLAN = ["--model", "llama3-8b", "--n-layer", "2", "--plan", "8x80", "--seq-len", "65536", "--batch-size", "1",
              "--tiles", "4", "--loss-tiles", "16", "--recompute", "--offload"]


def test_a_dry_run_of_llama_shapes_on_8_gpus(capsys):
    """--plan --dry-run on Llama-3-8B's shapes (2 of its 32 layers), 64k tokens on 8 GPUs, as they would run it: the
    traced line follows the plan's, and the predictor is within 10% of it, GPU and CPU memory. Host and device
    apart, as only a GPU run has them, traced on CPU: --offload puts each block's input in CPU memory (with RoPE's
    tables); with --offload-optimizer the GPU holds none of the optimizer (float32 shards and AdamW's moments, 12
    bytes a parameter of this rank's) and CPU memory holds it, the gradients and a bf16 copy (18 bytes)."""
    assert train.main(LLAMA_PLAN + ["--dry-run", "--offload-optimizer"])
    printed = capsys.readouterr().out
    line = re.search(r"^dry run: rank 0 of 8, the training step traced on fake tensors in [\d.]+ s: fits: ([\d.]+) GiB "
                     r"per GPU \(predicted [\d.]+ GiB, ([-+][\d.]+)%\), ([\d.]+) GiB in CPU memory \(predicted "
                     r"([\d.]+) GiB\)$", printed, re.M)
    assert printed.startswith("plan: 8 GPUs, sp 8, seq 65,536: fits: ") and line, printed
    assert abs(float(line.group(2))) < 10 and abs(float(line.group(3)) / float(line.group(4)) - 1) < 0.1, printed
    traced = {}
    for name, argv in (("kept", [flag for flag in LLAMA_PLAN if flag != "--offload"]), ("offload", LLAMA_PLAN),
                       ("optimizer too", LLAMA_PLAN + ["--offload-optimizer"])):
        args = launch.parse_args(argv)
        launch.check_args(args, 8)
        traced[name] = memory.dry_run(args, 8, partial(train.build, args))
    local = (2 * 218_112_000 + 525_336_576 + 525_340_672) / 8  # this rank's parameters: 2 blocks, embedding, head
    assert traced["offload"]["device"] - traced["optimizer too"]["device"] > 12 * local * 0.95, traced
    assert traced["optimizer too"]["host"] - traced["offload"]["host"] > 18 * local, traced
    # --offload: each block's float32 input [8192, 4096] in CPU memory, and RoPE's cos and sin [8192, 128] with it
    assert traced["offload"]["host"] - traced["kept"]["host"] == 2 * 8192 * 4 * (4096 + 2 * 128), traced


def test_a_dry_run_traces_the_busiest_rank():
    """6 heads and 2 kv heads on 4 ranks: rank 1 holds query heads 2 and 3, which use both kv heads, so its kernel
    gets the most heads. memory.busiest_rank picks it, and its traced peak is the largest of the 4 ranks'."""
    args = launch.parse_args(["--plan", "4x80", "--n-head", "6", "--n-kv-head", "2", "--n-embd", "192",
                              "--seq-len", "8192", "--batch-size", "1"])
    launch.check_args(args, 4)
    busiest = memory.busiest_rank(args)
    peaks = []
    for rank in range(4):
        with patch.object(memory, "busiest_rank", lambda args: rank):
            peaks.append(memory.dry_run(args, 4, partial(train.build, args), cuda=False)["device"])
    assert busiest == 1 and peaks[1] == max(peaks) > min(peaks), peaks
