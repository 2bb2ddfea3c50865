"""
Tests of train.py's training against one process on the same global batch: every layout (sp, dp x sp, gradient
accumulation, ZeRO-3, plain all-reduce, FSDP2, tiles and recomputation), uneven heads, Ulysses x Ring, hybrid
Gated DeltaNet models, bf16 and compiled training give the same steps; training on text learns; train.py under
torchrun exits 0.
"""

import contextlib
import io
import json
import os
import re
import subprocess

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import checkpoint
import train
import zero3
from conftest import HERE, PARAGRAPHS, assert_all_close, assert_same_training, run_ranks, torchrun


TRAIN_ARGS = ["--steps", "20", "--n-layer", "2", "--n-embd", "32", "--lr", "3e-3", "--grad-clip", "0.2"]
# a key head for every two value heads (Qwen3-Next: 16 and 32), and value heads wider than key heads (12 and 8)
GDN_SHAPE = ["--gdn-k-heads", "2", "--gdn-v-heads", "4", "--gdn-v-dim", "12"]
LAYOUTS = {  # each with a global batch of 8 sequences: dp * batch-size * grad-accum
    "sp4": ["--sp", "4", "--batch-size", "8"],  # --zero 3 is the default with 4 ranks
    "dp2xsp2 accum": ["--sp", "2", "--batch-size", "2", "--grad-accum", "2"],
    "dp2xsp2 zero0": ["--sp", "2", "--batch-size", "4", "--zero", "0"],
    "dp2xsp2 fsdp2": ["--sp", "2", "--batch-size", "4", "--zero", "fsdp2"],
    "dp2xsp2 tiles recompute": ["--sp", "2", "--batch-size", "4", "--tiles", "3", "--recompute"],
}


def _train_rank(rank, world_size, runs):
    """Run train.main once per (argv, out_dir); return each run's metrics and its final model (if saved)."""
    results = []
    for argv, out_dir in runs:
        history = train.main(argv + (["--out-dir", out_dir] if out_dir else []))
        final = checkpoint.newest(out_dir) if out_dir else None
        results.append((history, checkpoint.weights(final) if final else None))
    return results


@pytest.mark.parametrize("extra", [["--seq-len", "64"], ["--seq-len", "101", "--n-kv-head", "2"]],
                         ids=["seq64", "seq101-kv2"])
def test_training_is_the_same_for_every_layout(extra, tmp_path):
    """Same global batch, same training: sp, dp x sp, gradient accumulation, ZeRO-3, plain all-reduce, FSDP2,
    tiles and recomputation all give the one-process losses, gradient norms and final weights."""
    one_process = ["--sp", "1", "--batch-size", "8"] + TRAIN_ARGS + extra
    [(reference, reference_model)] = run_ranks(1, _train_rank, [(one_process, str(tmp_path / "one"))])[0]
    runs = [(argv + TRAIN_ARGS + extra, str(tmp_path / name.replace(" ", "_"))) for name, argv in LAYOUTS.items()]
    per_rank = run_ranks(4, _train_rank, runs)
    losses = lambda rank_results: [[r["loss"] for r in history] for history, _ in rank_results]
    assert all(losses(rank_results) == losses(per_rank[0]) for rank_results in per_rank)  # one global loss
    assert sum(r["grad_norm"] > 0.2 for r in reference) >= 2  # clipping really happens
    for name, (history, model) in zip(LAYOUTS, per_rank[0]):
        assert_same_training(history, reference, name)
        assert_all_close(model, reference_model, rtol=0, atol=1e-5, where=name)


@pytest.mark.parametrize("kv", ["6", "2"])
def test_training_with_uneven_heads(kv):
    """6 heads on sp 4 (ranks hold 2, 2, 1, 1; with 2 kv heads, kv head 0 goes to ranks 0 and 1): the same
    losses as one process, with ZeRO-3."""
    argv = TRAIN_ARGS + ["--n-head", "6", "--n-embd", "48", "--n-kv-head", kv, "--seq-len", "30", "--batch-size"]
    [(reference, _)] = run_ranks(1, _train_rank, [(argv + ["8"], None)])[0]
    [(history, _)] = run_ranks(4, _train_rank, [(argv + ["8", "--sp", "4"], None)])[0]
    assert_same_training(history, reference, f"6 heads, {kv} kv heads, sp 4")


@pytest.mark.parametrize("world_size, layout, model", [
    (8, ["--sp", "4", "--ring", "2", "--batch-size", "4"], ["--n-kv-head", "2"]),  # ZeRO-3, the default
    (4, ["--sp", "4", "--ring", "2", "--batch-size", "8", "--zero", "fsdp2"], ["--n-head", "2", "--n-embd", "16"]),
    (4, ["--sp", "4", "--ring", "4", "--batch-size", "8", "--zero", "0"], ["--window", "20"]),
    (2, ["--sp", "2", "--ring", "2", "--batch-size", "8"], ["--pack"]),
], ids=["dp2xulysses2xring2-zero3-kv2", "ulysses2xring2-nhead2-fsdp2", "ring4-zero0-window", "ring2-packed"])
def test_ring_training_matches_one_device(world_size, layout, model, tmp_path):
    """Ulysses x Ring training equals one process step by step (losses, gradient norms, final weights within 1e-5
    over 20 steps), with padding (101 tokens into 2 x sp chunks): dp 2 x Ulysses 2 x ring 2 with ZeRO-3 and GQA;
    more SP ranks than heads (n_head 2, sp 4 = Ulysses 2 x ring 2) with FSDP2; a ring of 4 with a sliding window;
    a ring of 2 with packed documents."""
    extra = TRAIN_ARGS + ["--seq-len", "101"] + model
    one_process = ["--sp", "1", "--batch-size", "8"] + extra
    [(reference, reference_model)] = run_ranks(1, _train_rank, [(one_process, str(tmp_path / "one"))])[0]
    per_rank = run_ranks(world_size, _train_rank, [(layout + extra, str(tmp_path / "ring"))])
    history, trained = per_rank[0][0]
    assert_same_training(history, reference, " ".join(layout))
    assert_all_close(trained, reference_model, rtol=0, atol=1e-5, where=" ".join(layout))


@pytest.mark.parametrize("model", [["--layer-pattern", "dda", "--n-layer", "3"] + GDN_SHAPE,
                                   ["--layer-pattern", "ddda", "--n-layer", "4", "--pack"]],
                         ids=["dda-2k-4v-heads", "ddda-packed"])
def test_training_a_hybrid_model(model):
    """Hybrid models: two Gated DeltaNet layers to one softmax layer with Qwen3-Next's ratios (a key head for
    every two value heads, convolution 4; value dim 12, key dim 8), and three to one with packed documents:
    sp 4 and dp 2 x sp 2 give the one-process losses and gradient norms over 20 steps, with ZeRO-3. At
    train.py's learning rate for Gated DeltaNet models, 5e-4: at 3e-3, AdamW grows the float32 rounding of
    different summation orders (gradients summed over ranks where one device sums over tokens; a key head's
    gradient summed over its value heads before the convolution's backward on one device, after it under SP) to
    1e-5 to 5e-5 in the gradient norm by step 15, where the layer itself agrees to 1e-10 in float64 (above)."""
    argv = TRAIN_ARGS + ["--seq-len", "64", "--lr", "5e-4"] + model
    [(reference, _)] = run_ranks(1, _train_rank, [(argv + ["--batch-size", "8"], None)])[0]
    layouts = {"sp4": ["--sp", "4", "--batch-size", "8"], "dp2xsp2": ["--sp", "2", "--batch-size", "4"]}
    results = run_ranks(4, _train_rank, [(argv + layout, None) for layout in layouts.values()])[0]
    for name, (history, _) in zip(layouts, results):
        assert_same_training(history, reference, name)


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
    argv = TRAIN_ARGS + ["--seq-len", "32", "--layer-pattern", "da", "--steps", "10"]
    bf16, out_dir = argv + ["--dtype", "bfloat16"], str(tmp_path / "one")
    [(reference, _, received, _), (resumed, _, _, printed)] = run_ranks(1, _bf16_rank, [
        bf16 + ["--batch-size", "8", "--out-dir", out_dir],
        argv + ["--batch-size", "8", "--dtype", "float32", "--out-dir", out_dir, "--resume", "--steps", "12",
                "--new-schedule"]])[0]
    assert received == {(torch.float32, torch.float32)}
    saved = checkpoint.weights(os.path.join(out_dir, "step_000010"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert "carried over" in printed and [r["step"] for r in resumed] == [11, 12]
    layouts = {"dp2xsp2 zero3": ["--sp", "2", "--batch-size", "4"], "sp4 fsdp2": ["--sp", "4", "--zero", "fsdp2"]}
    float32 = argv + layouts["dp2xsp2 zero3"] + ["--steps", "1", "--dtype", "float32"]
    runs = [bf16 + layout for layout in layouts.values()] + [float32]
    *per_layout, (_, _, _, printed_float32) = run_ranks(4, _bf16_rank, runs)[0]
    sent = lambda printed: [int(n.replace(",", "")) for n in re.search(
        r"all-to-all of rank 0 per step: ([\d,]+) bytes sent \(formula ([\d,]+) bytes\)", printed).groups()]
    assert per_layout[0][1] == {torch.float32}  # the dtype of every gradient ZeRO-3 reduce-scattered
    for name, (history, _, received, printed) in zip(layouts, per_layout):
        assert received == {(torch.float32, torch.float32)}, name
        for key, rtol in (("loss", 2**-9), ("grad_norm", 2**-6)):
            torch.testing.assert_close([r[key] for r in history], [r[key] for r in reference], rtol=rtol, atol=0,
                                       msg=lambda m: f"{name}, {key}: {m}")
    measured, formula = sent(per_layout[0][3])
    assert measured == formula == sent(printed_float32)[0] // 2


def test_bf16_loss_follows_float32(tmp_path):
    """50 steps on text, bf16 against float32, a hybrid model on one process (Gated DeltaNet with a key head for
    every two value heads, value dim 12): the loss falls from 5.55 to about 1.8 nats in both, and the curves never part by
    more than 0.01 nats (bf16 rounding moves a step's loss by about 1e-4 of itself; AdamW's updates let that grow
    a little over the steps)."""
    text = tmp_path / "text.txt"
    text.write_text(PARAGRAPHS)
    argv = ["--data", str(text), "--seq-len", "64", "--steps", "50", "--n-embd", "32", "--lr", "3e-3",
            "--layer-pattern", "da"] + GDN_SHAPE
    float32, bf16 = ([r["loss"] for r in train.main(argv + ["--dtype", dtype])] for dtype in ("float32", "bfloat16"))
    assert float32[-1] < 2.0 and bf16[-1] < 2.0
    torch.testing.assert_close(bf16, float32, rtol=0, atol=0.01)


@pytest.mark.parametrize("world_size, layout", [(2, ["--sp", "2"]), (4, ["--sp", "2", "--batch-size", "4"]),
                                                (2, ["--sp", "2", "--ring", "2"])], ids=["sp2", "dp2xsp2", "ring2"])
def test_compiled_training_inductor(world_size, layout):
    """--compile (each block through inductor, ZeRO-3's hooks eager) trains as eager does: 20 steps, same losses,
    gradient norms and accuracy, also with a ring, whose passes are an operator in the graph (slow: inductor
    compiles the blocks on every rank)."""
    argv = TRAIN_ARGS + ["--seq-len", "32"] + layout
    eager, compiled = run_ranks(world_size, _train_rank, [(argv, None), (argv + ["--compile"], None)])[0]
    assert_same_training(compiled[0], eager[0], f"--compile on {world_size} ranks")


@pytest.mark.parametrize("pack", [[], ["--pack"]], ids=["plain", "packed"])
def test_training_on_text_learns(tmp_path, pack):
    """40 steps on the paragraphs take the loss from ln 256 = 5.55 (uniform over bytes) to below 2.7."""
    text = tmp_path / "text.txt"
    text.write_text(PARAGRAPHS)
    history = train.main(["--data", str(text), "--seq-len", "64", "--steps", "40", "--n-embd", "32", "--lr", "3e-3"]
                         + pack)
    assert history[0]["loss"] > 5.4 and history[-1]["loss"] < 2.7, [r["loss"] for r in history]


def test_torchrun_train_exits_zero(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    done = subprocess.run(torchrun(2) + ["--steps", "3", "--seq-len", "32", "--n-embd", "32", "--metrics",
                                         str(metrics)], cwd=HERE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"all-to-all of rank 0 per step: ([\d,]+) bytes sent \(formula \1 bytes\)", done.stdout)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


# ================================================================================================================
# --gdn-parallel context trains as one process does

HYBRID = TRAIN_ARGS + ["--seq-len", "61", "--lr", "5e-4"] + GDN_SHAPE  # 61: padded to the multiple of sp (2 sp)
MODELS = {"dda": ["--layer-pattern", "dda", "--n-layer", "3"], "ddda packed": ["--layer-pattern", "ddda", "--pack"]}
CONTEXT_LAYOUTS = [  # (model, layout)
    ("dda", ["--sp", "4", "--batch-size", "8"]),
    ("dda", ["--sp", "4", "--ring", "2", "--batch-size", "8"]),  # USP for the a layers, context over all 4 for d
    ("dda", ["--sp", "2", "--batch-size", "4", "--zero", "0"]),
    ("ddda packed", ["--sp", "4", "--batch-size", "8"]),
]


def test_context_training_equals_one_process():
    """--gdn-parallel context: 20 steps of a hybrid model with Qwen3-Next's head ratio on sp 4, on Ulysses 2 x ring
    2 (zigzag order), dp 2 x sp 2 and with packed documents give the one-process losses and gradient norms within
    1e-5."""
    argv = lambda model: HYBRID + MODELS[model] + ["--gdn-parallel", "context"]
    references = run_ranks(1, _train_rank, [(argv(m) + ["--batch-size", "8"], None) for m in MODELS])[0]
    reference = dict(zip(MODELS, (history for history, _ in references)))
    per_rank = run_ranks(4, _train_rank, [(argv(model) + layout, None) for model, layout in CONTEXT_LAYOUTS])[0]
    for (model, layout), (history, _) in zip(CONTEXT_LAYOUTS, per_rank):
        assert_same_training(history, reference[model], f"{model} {' '.join(layout)}")


def test_context_bf16_training_matches_one_bf16_process():
    """bf16 on Ulysses 2 x ring 2 with the context way against one bf16 process, within the bf16
    tolerances (2^-9 of the loss, 2^-6 of the gradient norm: see test_bf16_training_matches_one_device); the
    summary prints the bytes the context way sent, equal to the formula."""
    argv = HYBRID + MODELS["dda"] + ["--gdn-parallel", "context", "--dtype", "bfloat16", "--steps", "10"]
    [(reference, _, _, _)] = run_ranks(1, _bf16_rank, [argv + ["--batch-size", "8"]])[0]
    [(history, _, _, printed)] = run_ranks(4, _bf16_rank, [argv + ["--sp", "4", "--ring", "2", "--batch-size", "8"]])[0]
    for key, rtol in (("loss", 2**-9), ("grad_norm", 2**-6)):
        torch.testing.assert_close([r[key] for r in history], [r[key] for r in reference], rtol=rtol, atol=0)
    sent = re.search(r"context-parallel Gated DeltaNet of rank 0 per step: ([\d,]+) bytes sent \(formula ([\d,]+) "
                     r"bytes\)", printed)
    assert sent and sent.group(1) == sent.group(2) != "0", printed


def _offload_rank(rank, world_size, runs):
    """train.main once per argv: each run's metrics and what it printed."""
    results = []
    for argv in runs:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            history = train.main(argv)
        results.append((history, printed.getvalue()))
    return results


def test_optimizer_offload_trains_as_on_the_device():
    """--offload-optimizer (ZeRO-3's float32 shards, their gradients and AdamW in host memory; each gather sent from a
    host buffer in the compute dtype, refilled after every step) trains as AdamW on the device: 20 steps on 2
    ranks, in float32 and in bf16, the same losses and gradient norms within 1e-6. The summary says the model state
    is in host memory and prints the host memory beside the peak."""
    base = ["--zero", "3", "--steps", "20", "--n-layer", "2", "--n-embd", "32", "--lr", "3e-3", "--batch-size", "4"]
    runs = [base + dtype + offload for dtype in ([], ["--dtype", "bfloat16"])
            for offload in ([], ["--offload-optimizer"])]
    (device_f32, _), (host_f32, printed), (device_bf16, _), (host_bf16, _) = run_ranks(2, _offload_rank, runs)[0]
    for host, device, where in ((host_f32, device_f32, "float32"), (host_bf16, device_bf16, "bf16")):
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close([r[key] for r in host], [r[key] for r in device], rtol=0, atol=1e-6,
                                       msg=lambda m: f"{where}, {key}: {m}")
    assert re.search(r"model state per rank \(max over ranks\): .* = [\d.]+ MiB in host memory; ", printed), printed
    assert re.search(r"peak tensor memory per rank .*; host memory: the same, on a CPU", printed), printed
