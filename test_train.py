"""
Tests of train.py's training against one process on the same global batch: every layout (sp, dp x sp, gradient
accumulation, ZeRO-3, plain all-reduce, FSDP2, tiles and recomputation), uneven heads, Ulysses x Ring, hybrid
Gated DeltaNet models, bf16 and compiled training give the same steps; the summary's bytes against a count by
hand; training on text learns; train.py under torchrun exits 0.

Four steps show what a layout can get wrong: a gradient summed wrongly or clipped by a partial norm differs at
step 1, stale weights or optimizer state at step 2, and every step here is clipped (gradient norms 0.5 to 0.6
against --grad-clip 0.2).
"""

import contextlib
import io
import json
import os
import re

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import train
import zero3
from conftest import HERE, assert_all_close, assert_same_training, bytes_line, run, run_ranks, torchrun, train_rank
from harness import checkpoint


# Two steps of warmup: AdamW's first update is about lr * sign(gradient), so at the full learning rate a weight
# whose gradient nearly cancels would carry that gradient's rounding (another summation order) into the 1e-5
# that the final weights are held to.
TRAIN_ARGS = ["--steps", "4", "--warmup", "2", "--n-layer", "2", "--n-embd", "32", "--lr", "3e-3", "--grad-clip", "0.2"]
# a key head for every two value heads (Qwen3-Next: 16 and 32), and value heads wider than key heads (12 and 8)
GDN_SHAPE = ["--gdn-k-heads", "2", "--gdn-v-heads", "4", "--gdn-v-dim", "12"]
LAYOUTS = {  # each with a global batch of 8 sequences: dp * batch-size * grad-accum
    "sp4": ["--sp", "4", "--batch-size", "8"],  # --zero 3 is the default with 4 ranks
    # one sequence a micro-step, with each sharding
    "dp2xsp2 accum": ["--sp", "2", "--batch-size", "1", "--grad-accum", "4"],
    "dp2xsp2 zero0": ["--sp", "2", "--batch-size", "4", "--zero", "0"],
    "dp2xsp2 fsdp2": ["--sp", "2", "--batch-size", "1", "--grad-accum", "4", "--zero", "fsdp2"],
    "dp2xsp2 tiles recompute": ["--sp", "2", "--batch-size", "1", "--grad-accum", "4", "--tiles", "3", "--recompute"],
}


def _final_weights(out_dir):
    return checkpoint.weights(checkpoint.newest(out_dir))


@pytest.mark.parametrize("extra", [["--seq-len", "64"], ["--seq-len", "101", "--n-kv-head", "1"]],
                         ids=["seq64", "seq101-kv1"])
def test_training_is_the_same_for_every_layout(extra, tmp_path):
    """Same global batch, same training: sp, dp x sp, gradient accumulation, ZeRO-3, plain all-reduce, FSDP2,
    tiles and recomputation all give the one-process losses, gradient norms and final weights. With one kv head,
    both ranks of an sp 2 layout get it, and its gradient is the sum of theirs."""
    one_process = ["--sp", "1", "--batch-size", "8"] + TRAIN_ARGS + extra + ["--out-dir", str(tmp_path / "one")]
    [(reference, _)] = run_ranks(1, train_rank, [one_process])[0]
    out_dirs = {name: tmp_path / name.replace(" ", "_") for name in LAYOUTS}
    per_rank = run_ranks(4, train_rank, [argv + TRAIN_ARGS + extra + ["--out-dir", str(out_dirs[name])]
                                         for name, argv in LAYOUTS.items()])
    losses = lambda rank_results: [[r["loss"] for r in history] for history, _ in rank_results]
    assert all(losses(rank_results) == losses(per_rank[0]) for rank_results in per_rank)  # one global loss
    assert all(r["grad_norm"] > 0.2 for r in reference)  # clipping really happens
    for name, (history, _) in zip(LAYOUTS, per_rank[0]):
        assert_same_training(history, reference, name)
        assert_all_close(_final_weights(out_dirs[name]), _final_weights(tmp_path / "one"), rtol=0, atol=1e-5,
                         where=name)


def test_the_optimizer_steps_on_clipped_gradients(one_rank):
    """--grad-clip 0.2: AdamW receives gradients of global norm 0.2, while the norm logged is the one before clipping
    (larger); the learning rate warms up linearly, lr / warmup at the first step."""
    norms = []  # of the gradients each optimizer step receives
    hook = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: norms.append(torch.stack(
        [p.grad.norm() for group in optimizer.param_groups for p in group["params"]]).norm().item()))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            history = train.main(TRAIN_ARGS + ["--steps", "2", "--seq-len", "32", "--batch-size", "4"])
    finally:
        hook.remove()
    assert all(r["grad_norm"] > 0.2 for r in history), history
    assert norms == pytest.approx([0.2, 0.2], rel=1e-4)
    assert [r["lr"] for r in history] == pytest.approx([1.5e-3, 3e-3])


@pytest.mark.parametrize("kv, all_to_all", [("6", 163840), ("2", 139264)])
def test_training_with_uneven_heads(kv, all_to_all):
    """6 heads on sp 4 (ranks hold 2, 2, 1, 1; with 2 kv heads, kv head 0 goes to ranks 0 and 1): the same
    losses as one process, with ZeRO-3. The summary says how uneven the work is (the busiest rank 2 heads of a
    mean of 1.5: 1.33x), and rank 0's bytes, by hand: a head of its 8 x 32/4 tokens is 8 * 8 * 8 * 4 = 2,048 bytes
    (D = 48/6 = 8); forward it sends q, k and v of the other ranks' heads (2 + 2 * 2, 1 + 2, 1 + 2 heads, either
    kv count: with 2, ranks 1 to 3 use 2, 1 and 1 kv heads) and its 2 output heads to 3 ranks; backward the
    other ranks' 4 output heads and its own q, k and v heads to 3 ranks (2 + 2 * 2 heads; 2 + 2 * 1 with 2 kv
    heads). Per step, over 2 layers: 2 * 2,048 * (18 + 22) = 163,840 bytes, and 2 * 2,048 * (18 + 16) = 139,264."""
    argv = TRAIN_ARGS + ["--n-head", "6", "--n-embd", "48", "--n-kv-head", kv, "--seq-len", "30", "--batch-size", "8"]
    [(reference, _)] = run_ranks(1, train_rank, [argv])[0]
    [(history, printed)] = run_ranks(4, train_rank, [argv + ["--sp", "4"]])[0]
    assert_same_training(history, reference, f"6 heads, {kv} kv heads, sp 4")
    assert "query heads per Ulysses rank [2, 2, 1, 1]: the busiest rank does 1.33x the mean attention work" in printed
    assert bytes_line(printed) == [all_to_all, all_to_all, 4, 4]  # q, k, v and the output, one call each, each way


def test_the_bytes_line_counts_every_micro_step_and_the_recomputed_forward():
    """The summary's byte lines count a whole optimizer step, as their first line says: --grad-accum 2 with
    --recompute on sp 2, by hand: a micro-step's tensor on a rank is 4 x 32/2 tokens x 32 x 4 bytes = 8,192 bytes, of
    which each all-to-all sends half; 4 a layer forward, run twice (--recompute runs it again in backward), 4
    backward: 2 micro-steps * 2 layers * (2 * 4 + 4) * 4,096 = 196,608 bytes; calls a layer and micro-step: 8
    forward, 4 backward."""
    argv = TRAIN_ARGS + ["--seq-len", "32", "--sp", "2", "--batch-size", "4", "--grad-accum", "2", "--recompute"]
    [(_, printed)] = run_ranks(2, train_rank, [argv])[0]
    assert ("bytes rank 0 sent in one optimizer step, all 2 layers and 2 micro-steps, forward and backward; the "
            "forward twice, as --recompute runs it again in backward:") in printed, printed
    assert bytes_line(printed) == [196608, 196608, 8, 4]


@pytest.mark.parametrize("world_size, layout, model", [
    (8, ["--sp", "4", "--ring", "2", "--batch-size", "4"], ["--n-kv-head", "2"]),  # ZeRO-3, the default
    (4, ["--sp", "4", "--ring", "2", "--batch-size", "8", "--zero", "fsdp2"], ["--n-head", "2", "--n-embd", "16"]),
    (4, ["--sp", "4", "--ring", "4", "--batch-size", "8", "--zero", "0"], ["--window", "20"]),
    (2, ["--sp", "2", "--ring", "2", "--batch-size", "8", "--balance", "zigzag"], ["--pack"]),
    (2, ["--sp", "2", "--ring", "2", "--batch-size", "8"], ["--pack", "--sinks", "--window", "20", "--steps", "20"]),
    (4, ["--sp", "4", "--ring", "2", "--batch-size", "8"], ["--pack", "--sinks", "--n-kv-head", "2", "--steps", "20"]),
], ids=["dp2xulysses2xring2-zero3-kv2", "ulysses2xring2-nhead2-fsdp2", "ring4-zero0-window", "ring2-packed-zigzag",
        "ring2-packed-balanced-sinks-window-20-steps", "ulysses2xring2-packed-balanced-sinks-kv2-20-steps"])
def test_ring_training_matches_one_device(world_size, layout, model, tmp_path):
    """Ulysses x Ring training equals one process step by step (losses, gradient norms, final weights within 1e-5),
    with padding (101 tokens into 2 x sp chunks): dp 2 x Ulysses 2 x ring 2 with ZeRO-3 and GQA; more SP ranks
    than heads (n_head 2, sp 4 = Ulysses 2 x ring 2) with FSDP2; a ring of 4 with a sliding window; a ring of 2
    with packed documents in the zigzag order; and over 20 steps, packed documents balanced per document (the
    default with --pack) with attention sinks, under a ring of 2 with a window and under Ulysses 2 x ring 2."""
    extra = TRAIN_ARGS + ["--seq-len", "101"] + model
    one_process = ["--sp", "1", "--batch-size", "8"] + extra + ["--out-dir", str(tmp_path / "one")]
    [(reference, _)] = run_ranks(1, train_rank, [one_process])[0]
    [(history, _)] = run_ranks(world_size, train_rank, [layout + extra + ["--out-dir", str(tmp_path / "ring")]])[0]
    assert_same_training(history, reference, " ".join(layout))
    assert_all_close(_final_weights(tmp_path / "ring"), _final_weights(tmp_path / "one"), rtol=0, atol=1e-5,
                     where=" ".join(layout))


@pytest.mark.parametrize("model", [["--layer-pattern", "dda", "--n-layer", "3"] + GDN_SHAPE,
                                   ["--layer-pattern", "ddda", "--n-layer", "4", "--pack"]],
                         ids=["dda-2k-4v-heads", "ddda-packed"])
def test_training_a_hybrid_model(model):
    """Hybrid models: two Gated DeltaNet layers to one softmax layer with Qwen3-Next's ratios (a key head for
    every two value heads, convolution 4; value dim 12, key dim 8), and three to one with packed documents:
    sp 4 and dp 2 x sp 2 give the one-process losses and gradient norms, with ZeRO-3. At train.py's learning rate
    for Gated DeltaNet models, 5e-4: at 3e-3, AdamW grows the float32 rounding of different summation orders
    (gradients summed over ranks where one device sums over tokens; a key head's gradient summed over its value
    heads before the convolution's backward on one device, after it under SP) to 1e-5 to 5e-5 in the gradient
    norm by step 15, where the layer itself agrees to 1e-10 in float64 (test_deltanet.py). The summary counts the
    all-to-alls of all layers together, as a Gated DeltaNet layer makes 3 each way and a softmax layer 4."""
    argv = TRAIN_ARGS + ["--seq-len", "64", "--lr", "5e-4"] + model
    [(reference, _)] = run_ranks(1, train_rank, [argv + ["--batch-size", "8"]])[0]
    layouts = {"sp4": ["--sp", "4", "--batch-size", "8"], "dp2xsp2": ["--sp", "2", "--batch-size", "4"]}
    results = run_ranks(4, train_rank, [argv + layout for layout in layouts.values()])[0]
    pattern = model[model.index("--layer-pattern") + 1]
    calls = 3 * pattern.count("d") + 4 * pattern.count("a")
    for name, (history, printed) in zip(layouts, results):
        assert_same_training(history, reference, name)
        sent, formula, *called = bytes_line(printed)
        assert sent == formula and called == [calls, calls], (name, printed)


def _bf16_rank(rank, world_size, runs):
    """train.main once per argv. Returns each run's metrics, the dtypes the gradients were summed in (ZeRO-3's
    reduce-scatter) and the (parameter, gradient) dtypes the optimizer's step received, and what it printed."""
    results = []
    reduce_scatter = zero3.reduce_scatter
    for argv in runs:
        received = set()
        hook = register_optimizer_step_pre_hook(lambda optimizer, args, kwargs: received.update(
            (p.dtype, p.grad.dtype) for group in optimizer.param_groups for p in group["params"]))
        summed_in = set()

        def recording_reduce_scatter(output, input, **kwargs):
            summed_in.add(input.dtype)
            return reduce_scatter(output, input, **kwargs)
        zero3.reduce_scatter = recording_reduce_scatter
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            history = train.main(argv)
        hook.remove()
        zero3.reduce_scatter = reduce_scatter
        results.append((history, summed_in, received, printed.getvalue()))
    return results


def test_bf16_training_matches_one_device(tmp_path):
    """--dtype bfloat16 on a hybrid model (softmax attention and Gated DeltaNet): dp 2 x sp 2 with ZeRO-3 and sp 4
    with FSDP2 train as one bf16 process does; the all-to-alls send half of float32's bytes, as the formula says;
    ZeRO-3 sums gradients in float32, and the optimizer gets float32 parameters and gradients; the checkpoint is
    float32 and resumes in float32.

    The tolerance: bf16 keeps 8 significant bits, so a matmul output is rounded to within 2^-8 of itself. Other
    layouts add up the same float32 numbers in another order before that rounding, and a value near a rounding
    boundary lands one bf16 step (2^-7 relative) away; and ZeRO-3 and FSDP2 round the norm weights, the embedding
    and Gated DeltaNet's small per-head parameters to bf16 where one process (--zero 0) keeps them float32. A loss
    averages hundreds of such values and moves far less: we allow 2^-9 of it. A gradient norm follows single
    gradients more closely: 2^-6. A real mistake (a gradient summed twice, a head on the wrong rank) moves both by
    tens of percent."""
    argv = TRAIN_ARGS + ["--seq-len", "32", "--layer-pattern", "da"]
    bf16, out_dir = argv + ["--dtype", "bfloat16"], str(tmp_path / "one")
    [(reference, _, received, _), (resumed, _, _, printed)] = run_ranks(1, _bf16_rank, [
        bf16 + ["--batch-size", "8", "--out-dir", out_dir],
        argv + ["--batch-size", "8", "--dtype", "float32", "--out-dir", out_dir, "--resume", "--steps", "6",
                "--new-schedule"]])[0]
    assert received == {(torch.float32, torch.float32)}
    saved = checkpoint.weights(os.path.join(out_dir, "step_000004"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert "carried over" in printed and [r["step"] for r in resumed] == [5, 6]
    layouts = {"dp2xsp2 zero3": ["--sp", "2", "--batch-size", "4"], "sp4 fsdp2": ["--sp", "4", "--zero", "fsdp2"]}
    float32 = argv + layouts["dp2xsp2 zero3"] + ["--steps", "1", "--dtype", "float32"]
    runs = [bf16 + layout for layout in layouts.values()] + [float32]
    *per_layout, (_, _, _, printed_float32) = run_ranks(4, _bf16_rank, runs)[0]
    assert per_layout[0][1] == {torch.float32}  # the dtype of every gradient ZeRO-3 reduce-scattered
    for name, (history, _, received, printed) in zip(layouts, per_layout):
        assert received == {(torch.float32, torch.float32)}, name
        for key, rtol in (("loss", 2**-9), ("grad_norm", 2**-6)):
            torch.testing.assert_close([r[key] for r in history], [r[key] for r in reference], rtol=rtol, atol=0,
                                       msg=lambda m: f"{name}, {key}: {m}")
    measured, formula, _, _ = bytes_line(per_layout[0][3])
    assert measured == formula == bytes_line(printed_float32)[0] / 2


def test_bf16_loss_follows_float32(text_file):
    """50 steps on text, bf16 against float32, a hybrid model on one process (Gated DeltaNet with a key head for
    every two value heads, value dim 12): the loss falls from 5.55 to about 1.8 nats in both, and the curves never
    part by more than 0.01 nats (bf16 rounding moves a step's loss by about 1e-4 of itself; AdamW's updates let that
    grow a little over the steps)."""
    argv = ["--data", str(text_file), "--seq-len", "64", "--steps", "50", "--n-embd", "32", "--lr", "3e-3",
            "--layer-pattern", "da"] + GDN_SHAPE
    float32, bf16 = ([r["loss"] for r in train.main(argv + ["--dtype", dtype])] for dtype in ("float32", "bfloat16"))
    assert float32[-1] < 2.0 and bf16[-1] < 2.0
    torch.testing.assert_close(bf16, float32, rtol=0, atol=0.01)


@pytest.mark.parametrize("world_size, layout, what, sent", [
    (2, ["--sp", "2"], "all-to-all", 131072),  # 2 layers * 2 ways * 4 tensors * 8 x 16 tokens x 32 x 4 bytes / 2
    (4, ["--sp", "2"], "all-to-all", 131072),  # 8 sequences a DP rank: every rank's blocks compute what sp2's do
    (2, ["--sp", "2", "--ring", "2"], "ring", 262144),  # 2 layers * 4 blocks * k, v of 8 x 16 tokens x 32 x 4 bytes
], ids=["sp2", "dp2xsp2", "ring2"])
def test_compiled_training_inductor(world_size, layout, what, sent):
    """--compile (each block through inductor, ZeRO-3's hooks eager) trains as eager does: same losses, gradient
    norms and accuracy, also with a ring, whose passes are an operator in the graph (slow: inductor compiles the
    blocks on every rank). Compiled, q, k, v and the output still travel in one all-to-all each (a ring: a block
    forward, the block and two accumulators backward), with the bytes counted by hand: each all-to-all sends half
    of a rank's [8, 16, 32] float32 tensor, a ring step all of its key/value block. Every rank
    computes on tensors of the same shapes in all three, so that the kernels inductor compiles for the first are in
    its cache for the others."""
    argv = TRAIN_ARGS + ["--seq-len", "32"] + layout
    (eager, eager_printed), (compiled, printed) = run_ranks(world_size, train_rank, [argv, argv + ["--compile"]])[0]
    assert_same_training(compiled, eager, f"--compile on {world_size} ranks")
    calls = [4, 4] if what == "all-to-all" else [1, 3]
    assert bytes_line(printed, what) == bytes_line(eager_printed, what) == [sent, sent, *calls]


@pytest.mark.parametrize("pack", [[], ["--pack"]], ids=["plain", "packed"])
def test_training_on_text_learns(text_file, pack):
    """40 steps on the paragraphs take the loss from ln 256 = 5.55 (uniform over bytes) to below 2.7."""
    history = train.main(["--data", str(text_file), "--seq-len", "64", "--steps", "40", "--n-embd", "32", "--lr",
                          "3e-3"] + pack)
    assert history[0]["loss"] > 5.4 and history[-1]["loss"] < 2.7, [r["loss"] for r in history]


def test_torchrun_train_exits_zero(tmp_path):
    """train.py under torchrun, 2 ranks, 3 steps: exit 0, a --metrics line a step, and the summary's bytes as
    README's formula gives them, 4 N h e (P-1)/P^2 a layer each way: 4 * (8 * 32) * 32 * 4 / 4 * 2 * 2 layers."""
    metrics = tmp_path / "metrics.jsonl"
    status, output, _ = run(torchrun(2) + ["--steps", "3", "--seq-len", "32", "--n-embd", "32", "--metrics",
                                           str(metrics)])
    assert status == 0, output[-2000:]
    assert bytes_line(output) == [131072, 131072, 4, 4]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


# ================================================================================================================
# --gdn-parallel context trains as one process does

HYBRID = TRAIN_ARGS + ["--seq-len", "61", "--lr", "5e-4"] + GDN_SHAPE  # 61: padded to the multiple of sp (2 sp)
MODELS = {"dda": ["--layer-pattern", "dda", "--n-layer", "3"], "da packed": ["--layer-pattern", "da", "--pack"]}
CONTEXT_LAYOUTS = [  # (model, layout)
    ("dda", ["--sp", "4", "--batch-size", "8"]),
    ("dda", ["--sp", "4", "--ring", "2", "--batch-size", "8"]),  # USP for the a layers, context over all 4 for d
    ("dda", ["--sp", "2", "--batch-size", "4", "--zero", "0"]),
    ("da packed", ["--sp", "4", "--batch-size", "8"]),
]


def test_context_training_equals_one_process():
    """--gdn-parallel context: a hybrid model with Qwen3-Next's head ratio on sp 4, on Ulysses 2 x ring
    2 (zigzag order), dp 2 x sp 2 and with packed documents give the one-process losses and gradient norms within
    1e-5."""
    argv = lambda model: HYBRID + MODELS[model] + ["--gdn-parallel", "context"]
    references = run_ranks(1, train_rank, [argv(m) + ["--batch-size", "8"] for m in MODELS])[0]
    reference = dict(zip(MODELS, (history for history, _ in references)))
    per_rank = run_ranks(4, train_rank, [argv(model) + layout for model, layout in CONTEXT_LAYOUTS])[0]
    for (model, layout), (history, _) in zip(CONTEXT_LAYOUTS, per_rank):
        assert_same_training(history, reference[model], f"{model} {' '.join(layout)}")


def test_context_bf16_training_matches_one_bf16_process():
    """bf16 on Ulysses 2 x ring 2 with the context way against one bf16 process, within the bf16
    tolerances (2^-9 of the loss, 2^-6 of the gradient norm: see test_bf16_training_matches_one_device). The
    summary's bytes, by hand: each rank holds one run of tokens of each of its 8 rows, and sends each of the 3
    other ranks, per row, the state's summary, 4 value heads of [Dk 8, Dv 12 + Dk 8] in float32 (2,560 bytes),
    and the convolution's 3 tokens of context, 2 * 2 * 8 + 4 * 12 channels and a start flag in bf16 (486
    bytes); backward the same; 2 Gated DeltaNet layers: 3 * 8 * 3,046 * 2 * 2 = 292,416 bytes a step."""
    argv = HYBRID + MODELS["dda"] + ["--gdn-parallel", "context", "--dtype", "bfloat16"]
    [(reference, _, _, _)] = run_ranks(1, _bf16_rank, [argv + ["--batch-size", "8"]])[0]
    [(history, _, _, printed)] = run_ranks(4, _bf16_rank, [argv + ["--sp", "4", "--ring", "2", "--batch-size", "8"]])[0]
    for key, rtol in (("loss", 2**-9), ("grad_norm", 2**-6)):
        torch.testing.assert_close([r[key] for r in history], [r[key] for r in reference], rtol=rtol, atol=0)
    assert bytes_line(printed, "context-parallel Gated DeltaNet") == [292416, 292416]


def test_optimizer_offload_trains_as_on_the_device():
    """--offload-optimizer (ZeRO-3's float32 shards, their gradients and AdamW in host memory; each gather sent from a
    host buffer in the compute dtype, refilled after every step) trains as AdamW on the device: 20 steps on 2
    ranks, in float32 and in bf16, the same losses and gradient norms within 1e-6. The summary says the model state
    is in host memory and prints the host memory beside the peak."""
    base = ["--zero", "3", "--steps", "20", "--n-layer", "2", "--n-embd", "32", "--lr", "3e-3", "--batch-size", "4"]
    runs = [base + dtype + offload for dtype in ([], ["--dtype", "bfloat16"])
            for offload in ([], ["--offload-optimizer"])]
    (device_f32, _), (host_f32, printed), (device_bf16, _), (host_bf16, _) = run_ranks(2, train_rank, runs)[0]
    for host, device, where in ((host_f32, device_f32, "float32"), (host_bf16, device_bf16, "bf16")):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close([r[key] for r in host], [r[key] for r in device], rtol=0, atol=1e-6,
                                       msg=lambda m: f"{where}, {key}: {m}")
    assert re.search(r"model state per rank \(max over ranks\): .* = [\d.]+ MiB in host memory; ", printed), printed
    assert re.search(r"peak tensor memory per rank .*; host memory: the same, on a CPU", printed), printed


def test_readme_gives_each_file_its_lines():
    """README's table of files gives each file's line count as it is, and its opening paragraph the core's total (the
    first five rows), so that a reader weighing the core reads the files' real size."""
    with open(os.path.join(HERE, "README.md")) as f:
        readme = f.read()
    rows = re.findall(r"^\| `(\w+\.py)` \| (\d+) \|", readme, re.M)
    assert len(rows) == 9, rows  # the core's five files and the four concept files
    for name, lines in rows:
        with open(os.path.join(HERE, name)) as f:
            assert int(lines) == len(f.read().splitlines()), (name, lines)
    core = sum(int(lines) for _, lines in rows[:5])
    assert f"The core is five files, {core:,} lines" in readme, core
