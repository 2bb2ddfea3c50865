"""
Gated DeltaNet by context parallelism (deltanet.py's second way): each rank keeps its tokens, the state's summaries
travel. Every multi-rank case runs over gloo and compares against one device.
"""
import re
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import deltanet
import launch
import memory
import train
import ulysses
from gpt import GPTConfig
from test_ulysses import (GDN_SHAPE, TRAIN_ARGS, _assert_same_training, _bf16_rank, _delta_rule_inputs, _train_rank,
                          _usp_groups, assert_all_close, grads, run_ranks)

S = 48
STARTS = torch.zeros(2, S, dtype=torch.bool)  # packed documents, the same for every layout
STARTS[0, [0, 16, 24, 30, 31]] = True  # starts at rank boundaries (16 at P = 3; 24 at P = 2 and 4), a 1-token document
STARTS[1, [0, 7, 41]] = True  # 7 .. 40 spans three ranks at P = 3 and four at P = 4
CASES = [  # (config, dtype, tolerance): Qwen3-Next's 1 key head : 2 value heads, scaled down, Dk != Dv
    (dict(gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=8, gdn_v_dim=12), torch.float64, 1e-10),
    (dict(gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=8, gdn_v_dim=12), torch.float32, 1e-5),
    (dict(gdn_k_heads=1, gdn_v_heads=2, gdn_k_dim=8, gdn_v_dim=12), torch.float64, 1e-10),  # fewer heads than ranks
]


def test_chunked_rule_hands_its_state_on():
    """The kernel from a starting state: two halves, the second started from the first's final state, equal the
    whole sequence (outputs, final state and every input gradient), with documents, in chunks of 16."""
    inputs = _delta_rule_inputs(2, 100, 3, 16, 12, torch.float64)
    starts = torch.zeros(2, 100, dtype=torch.bool)
    starts[0, [37, 60, 61]] = True  # 60: where the second half begins
    kernel = partial(deltanet.chunk_gated_delta_rule, chunk_size=16, output_final_state=True)
    whole, final = kernel(*inputs, starts=starts)
    first, middle = kernel(*(t[:, :60] for t in inputs), starts=starts[:, :60])
    second, last = kernel(*(t[:, 60:] for t in inputs), starts=starts[:, 60:], initial_state=middle)
    halves = [torch.cat([first, second], dim=1), last]
    grad_out = [torch.cos(whole), torch.sin(final)]
    assert_all_close([*halves, *torch.autograd.grad(halves, inputs, grad_out)],
                     [whole, final, *torch.autograd.grad([whole, final], inputs, grad_out)], 1e-12, 1e-12)


def _layer(case, dtype, parallel, groups=(None, None)):
    torch.manual_seed(0)
    cfg = GPTConfig(n_head=4, n_embd=32, gdn_parallel=parallel, **case)
    return deltanet.GatedDeltaNet(cfg, *groups).to(dtype)


def _layer_results(layer, index, dtype):
    """Output, input gradient and parameter gradients of the layer on the tokens `index` of a fixed batch, one row a
    document and packed; with the bytes the context way sent and its formula."""
    x = torch.randn(2, S, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)  # (B, S, h)
    results = []
    for starts in (None, STARTS):
        local = x[:, index].clone().requires_grad_()  # (B, S/P, h)
        deltanet.reset_context_stats()
        out = layer(local, None, None, partial(deltanet.gated_delta_net, starts=None if starts is None else
                                               starts[:, index]))
        out.backward(torch.cos(x)[:, index])  # any fixed gradient
        sent = deltanet.context_stats["forward"], deltanet.context_stats["backward"]
        results.append((out.detach(), local.grad, grads(layer), sent, layer.context_bytes(2, len(index),
                                                                                          dtype.itemsize)))
        layer.zero_grad()
    return results


def _context_rank(rank, world_size, U, R):
    groups = _usp_groups(U, R)
    index = ulysses.shard_for_sp(*[torch.arange(S)[None]] * 3, *groups)[0][0]  # (S/P,): my global tokens
    return index, [_layer_results(_layer(case, dtype, "context", groups), index, dtype) for case, dtype, _ in CASES]


@pytest.mark.parametrize("U, R", [(2, 1), (3, 1), (4, 1), (1, 2), (2, 2), (1, 4), (3, 2)])
def test_context_layer_equals_one_device(U, R):
    """The context-parallel layer on P = U x R ranks, in the SP group's token order (zigzag with a ring: a rank's
    tokens are two runs of the sequence, or, at U = 3, one for some ranks and two for the middle one), against
    the layer on one device: output, input gradient and every parameter gradient, float64 within 1e-10 and
    float32 within 1e-5, one document a row and packed documents; 2 key and 4 value heads with Dk 8 and Dv 12,
    and 1 key and 2 value heads on more ranks than value heads. Each rank sends the bytes of the formula."""
    per_rank = run_ranks(U * R, _context_rank, U, R)
    assert sorted(torch.cat([index for index, _ in per_rank]).tolist()) == list(range(S))
    for c, (case, dtype, tolerance) in enumerate(CASES):
        reference = _layer_results(_layer(case, dtype, "ulysses"), torch.arange(S), dtype)
        for d, (out, input_grad, parameter_grads, _, _) in enumerate(reference):
            where = f"U {U} x R {R}, case {c}, {'packed' if d else 'one document a row'}"
            got_out, got_grad = torch.zeros_like(out), torch.zeros_like(input_grad)
            for index, results in per_rank:
                got_out[:, index], got_grad[:, index] = results[c][d][0], results[c][d][1]
            assert_all_close([got_out, got_grad], [out, input_grad], tolerance, tolerance, where)
            summed = {name: sum(results[c][d][2][name] for _, results in per_rank) for name in parameter_grads}
            assert_all_close(summed, parameter_grads, tolerance, tolerance, where)
            assert all(results[c][d][3] == results[c][d][4] for _, results in per_rank), where


# train.py: --gdn-parallel context trains as one process does

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
        _assert_same_training(history, reference[model], f"{model} {' '.join(layout)}")


def test_context_bf16_training_matches_one_bf16_process():
    """bf16 on Ulysses 2 x ring 2 with the context way against one bf16 process, within test_ulysses's bf16
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


def _memory_rank(rank, world_size, argv):
    return train.main(argv + ["--steps", "2", "--batch-size", "1"])[-1]["peak_bytes"]


@pytest.mark.parametrize("world_size, argv", [(4, ["--sp", "4"]), (4, ["--sp", "4", "--ring", "2"])],
                         ids=["sp4", "ulysses2xring2"])
def test_context_memory_prediction_is_within_20_percent(world_size, argv):
    """memory.predict_memory counts what the context way keeps: within 20% of the measured peak of the busiest
    rank, as for the other layouts (test_memory_prediction_is_within_20_percent)."""
    argv += ["--layer-pattern", "ddda", "--gdn-parallel", "context", "--seq-len", "4096"]
    peak = max(run_ranks(world_size, _memory_rank, argv))
    args = launch.parse_args(argv + ["--batch-size", "1"])
    launch.check_args(args, world_size)
    predicted = memory.predicted(args, world_size)["peak"]
    assert abs(predicted / peak - 1) < 0.2, (predicted, peak)
