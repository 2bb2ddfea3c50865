"""
Tests of Gated DeltaNet: the chunked gated delta rule against the plain recurrence, the causal convolution
against each document alone, and the layer under SP 2, 3 and 4 against one device (output, every gradient, the
bytes sent); under bf16 autocast the kernel still computes in float32.
"""

from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import deltanet
import ulysses
from conftest import (assert_all_close, grads, my_tokens, packed_batch, run_ranks, sp_slice, summed, usp_groups,
                      whole_sequence)
from gpt import GPTConfig


def _delta_rule_inputs(B, S, H, Dk, Dv, dtype):
    """Inputs as a Gated DeltaNet layer makes them (normalised q and k, beta in (0, 1), realistic decays), given
    as [B, S, H, ...] views of head-major memory."""
    g = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(B, H, S, Dk, generator=g, dtype=dtype), dim=-1) for _ in range(2))
    v, beta = torch.randn(B, H, S, Dv, generator=g, dtype=dtype), torch.rand(B, H, S, generator=g, dtype=dtype)
    rate = torch.empty(H, 1, dtype=dtype).uniform_(1, 16, generator=g)  # exp(A_log)
    decay = -rate * torch.rand(B, H, S, generator=g, dtype=dtype) / 4  # g = -exp(A_log) * softplus(...)
    return [t.transpose(1, 2).requires_grad_() for t in (q, k, v, decay, beta)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunked_gated_delta_rule_equals_the_recurrence(dtype, tolerance, chunk_size):
    """Output and every input gradient, S = 150 (not a multiple of the chunk), key dim 16 and value dim 12, with
    and without documents: one starting mid-chunk, one at a chunk boundary (64), some shorter than the
    convolution (100, 101, 103)."""
    inputs = _delta_rule_inputs(2, 150, 3, 16, 12, dtype)
    grad_out = torch.randn(2, 150, 3, 12, dtype=dtype, generator=torch.Generator().manual_seed(1))
    starts = torch.zeros(2, 150, dtype=torch.bool)
    starts[0, [37, 64, 100, 101, 103, 130]] = True  # row 1 is one document
    for documents in (None, starts):
        results = []
        for kernel in (deltanet.gated_delta_rule, partial(deltanet.chunk_gated_delta_rule, chunk_size=chunk_size)):
            out = kernel(*inputs, starts=documents)
            results.append([out, *torch.autograd.grad(out, inputs, grad_out)])
        assert_all_close(results[1], results[0], rtol=tolerance, atol=tolerance)


def test_causal_conv1d_restarts_at_every_document():
    x, weight = torch.randn(2, 40, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    bounds = [0, 9, 10, 12, 31, 40]  # documents of 9, 1, 2, 19 and 9 tokens
    starts = torch.zeros(2, 40, dtype=torch.bool)
    starts[:, bounds[:-1]] = True
    want = torch.cat([F.conv1d(x[:, s:e].transpose(1, 2), weight[:, None], padding=3, groups=6)[..., :e - s]
                      for s, e in zip(bounds, bounds[1:])], dim=2).transpose(1, 2)  # each document alone
    torch.testing.assert_close(deltanet.causal_conv1d(x, weight, starts), want, rtol=1e-12, atol=1e-12)


def test_packed_convolution_compiles_once_for_any_documents():
    """Under torch.compile, the convolution over packed documents runs eagerly between graphs (its loop follows the
    data's documents): rows of 2, 3 and 4 documents compile nothing new, and the result is eager's."""
    x, weight = torch.randn(2, 24, 6), torch.randn(6, 4)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(lambda *inputs: 2 * deltanet.causal_conv1d(*inputs), backend=counter)
    frames = []
    for length in (12, 8, 6):  # documents of `length` tokens: 2, 3 and 4 a row
        starts = (torch.arange(24) % length == 0).expand(2, 24)  # (B, S)
        torch.testing.assert_close(compiled(x, weight, starts), 2 * deltanet.causal_conv1d(x, weight, starts))
        frames.append(counter.frame_count)
    assert frames[0] > 0 and frames == frames[:1] * 3, frames


GDN_CASES = [  # (config, dtype, tolerance): today's shape, and Qwen3-Next's 16 key and 32 value heads scaled down
    (GPTConfig(n_head=4, n_embd=32), torch.float32, 1e-5),
    (GPTConfig(n_head=4, n_embd=32, gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=8, gdn_v_dim=12), torch.float32, 1e-5),
    (GPTConfig(n_head=4, n_embd=32, gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=8, gdn_v_dim=12), torch.float64, 1e-10),
]


def _deltanet_rank(rank, world_size):
    """The layer alone on this rank's tokens, one row a document and one row of packed documents, for each case;
    and the bytes its all-to-alls sent."""
    group = dist.group.WORLD if world_size > 1 else None
    full_positions = packed_batch()[2]  # documents at 0, 8, 19, 22 (S/4 = 8 tokens a rank at sp 4)
    results = []
    for cfg, dtype, _ in GDN_CASES:
        torch.manual_seed(0)
        layer = deltanet.GatedDeltaNet(cfg, group).to(dtype)
        x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(1), dtype=dtype)  # (B, S, h)
        for starts in (None, full_positions[:, :24] == 0):
            local = sp_slice(x, rank, world_size).clone().requires_grad_()
            ulysses.reset_all_to_all_stats()
            out = layer(local, None, None, partial(deltanet.gated_delta_net, starts=starts))
            out.backward(sp_slice(torch.cos(x), rank, world_size))  # any fixed gradient
            sent = tuple(ulysses.all_to_all_stats[d]["bytes"] for d in ("forward", "backward"))
            results.append((out.detach(), local.grad, grads(layer), sent, layer.all_to_all_bytes(24 // world_size *
                                                                                                 2, dtype.itemsize)))
            layer.zero_grad()
    return results


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gated_deltanet_layer_under_sp(world_size):
    """Output, input gradient and every parameter gradient (conv weights, A_log and dt_bias included: each rank
    uses its heads' slices, and their gradients reach the whole parameters once) equal one device: today's shape
    in float32, and 2 key heads for 4 value heads with key dim 8 and value dim 12 in float32 and float64 (at sp 3
    the value heads split 2, 1, 1 and key head 1 goes to two ranks), one document a row and packed documents.
    Each rank sends the bytes of the layer's formula; where sp divides both head counts, the bytes counted by
    hand too: each all-to-all sends the (P-1)/P of its input that the other ranks hold, forward q and k (Dk a key
    head), v, b and a (Dv + 2 a value head) and the output back (Dv a value head), backward their gradients."""
    per_rank = run_ranks(world_size, _deltanet_rank)
    P, cases = world_size, [case for case in GDN_CASES for _ in range(2)]
    for i, ((out, input_grad, reference_grads, _, _), (cfg, dtype, tolerance)) in enumerate(zip(_deltanet_rank(0, 1),
                                                                                                 cases)):
        where = f"sp {world_size}, case {i}"
        assert_all_close(whole_sequence([r[i][0] for r in per_rank]), out, tolerance, tolerance, where)
        assert_all_close(whole_sequence([r[i][1] for r in per_rank]), input_grad, tolerance, tolerance, where)
        assert_all_close(summed([r[i][2] for r in per_rank]), reference_grads, tolerance, tolerance, where)
        assert all(r[i][3] == r[i][4] for r in per_rank), [(r[i][3], r[i][4]) for r in per_rank]
        Hk, Hv, Dk, Dv = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim
        if Hk % P == 0 and Hv % P == 0:
            local = 2 * 24 // P * (2 * Hk * Dk + Hv * (Dv + 2) + Hv * Dv) * dtype.itemsize  # bytes, B 2 x S/P tokens
            assert [r[i][3] for r in per_rank] == [(local * (P - 1) // P,) * 2] * P, where


def test_gated_deltanet_runs_in_float32_under_bf16(monkeypatch):
    """Under bf16 autocast, with bf16 inputs, the chunked kernel gets float32 q, k, v, gates and beta (so its
    state, cumulative decays and triangular solve are float32), and the output comes back in bf16."""
    seen = []

    def recording(q, k, v, g, beta, starts=None):
        seen.extend(t.dtype for t in (q, k, v, g, beta))
        return chunk(q, k, v, g, beta, starts)

    chunk = deltanet.chunk_gated_delta_rule
    monkeypatch.setattr(deltanet, "chunk_gated_delta_rule", recording)
    layer = deltanet.GatedDeltaNet(GPTConfig(n_head=4, n_embd=32, gdn_k_heads=2, gdn_v_heads=4, gdn_v_dim=12), None).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = deltanet.gated_delta_net(*(torch.randn(1, 16, h, d, dtype=torch.bfloat16)
                                    for h, d in ((2, 8), (2, 8), (4, 12))),
                                  *(torch.randn(1, 16, 4, 1, dtype=torch.bfloat16) for _ in range(2)),
                                  torch.cat([layer.conv_qk.flatten(0, 2), layer.conv_v.flatten(0, 1)]), layer.A_log,
                                  layer.dt_bias, [0, 0, 1, 1])
    assert seen == [torch.float32] * 5 and out.dtype == torch.bfloat16 and out.shape == (1, 16, 4, 12)


# ================================================================================================================
# context parallel: the state travels, not the tokens

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


def _context_rank(rank, world_size, U, R, compiled):
    groups = usp_groups(U, R)
    index = my_tokens(S, *groups)  # (S/P,): my global tokens
    results = []
    for case, dtype, _ in CASES[1:2] if compiled else CASES:  # compiled: float32
        layer = _layer(case, dtype, "context", groups)
        if compiled:
            layer.forward = torch.compile(layer.forward, backend="eager")
        results.append(_layer_results(layer, index, dtype))
    return index, results


@pytest.mark.parametrize("U, R, compiled", [(2, 1, False), (3, 1, False), (4, 1, False), (1, 2, False),
                                            (2, 2, False), (1, 4, False), (3, 2, False), (1, 2, True)])
def test_context_layer_equals_one_device(U, R, compiled):
    """The context-parallel layer on P = U x R ranks, in the SP group's token order (zigzag with a ring: at U = 1
    a rank's tokens are two runs of the sequence; at U = 2 one; at U = 3 one for some ranks, two for the middle
    one), against the layer on one device: output, input gradient and every parameter gradient, float64 within 1e-10 and
    float32 within 1e-5, one document a row and packed documents; 2 key and 4 value heads with Dk 8 and Dv 12,
    and 1 key and 2 value heads on more ranks than value heads. Each rank sends the bytes of the formula. Compiled
    too, by Dynamo with its eager backend, whose graphs break at the gathers (inductor would add a minute here)."""
    per_rank = run_ranks(U * R, _context_rank, U, R, compiled)
    assert sorted(torch.cat([index for index, _ in per_rank]).tolist()) == list(range(S))
    for c, (case, dtype, tolerance) in enumerate(CASES[1:2] if compiled else CASES):
        reference = _layer_results(_layer(case, dtype, "ulysses"), torch.arange(S), dtype)
        indices = [index for index, _ in per_rank]
        for d, (out, input_grad, parameter_grads, _, _) in enumerate(reference):
            where = f"U {U} x R {R}, case {c}, {'packed' if d else 'one document a row'}"
            got = [whole_sequence([results[c][d][k] for _, results in per_rank], indices) for k in (0, 1)]
            assert_all_close(got, [out, input_grad], tolerance, tolerance, where)
            assert_all_close(summed([results[c][d][2] for _, results in per_rank]), parameter_grads, tolerance,
                             tolerance, where)
            assert all(results[c][d][3] == results[c][d][4] for _, results in per_rank), where
