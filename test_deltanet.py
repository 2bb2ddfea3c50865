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

import deltanet
import ulysses
from conftest import assert_all_close, grads, packed_batch, run_ranks, sp_slice
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
    Each rank sends the bytes of the layer's formula."""
    per_rank = run_ranks(world_size, _deltanet_rank)
    cases = [case for case in GDN_CASES for _ in range(2)]
    for i, ((out, input_grad, reference_grads, _, _), (_, _, tolerance)) in enumerate(zip(_deltanet_rank(0, 1), cases)):
        where = f"sp {world_size}, case {i}"
        assert_all_close(torch.cat([r[i][0] for r in per_rank], dim=1), out, tolerance, tolerance, where)
        assert_all_close(torch.cat([r[i][1] for r in per_rank], dim=1), input_grad, tolerance, tolerance, where)
        summed = {name: sum(r[i][2][name] for r in per_rank) for name in reference_grads}
        assert_all_close(summed, reference_grads, tolerance, tolerance, where)
        assert all(r[i][3] == r[i][4] for r in per_rank), [(r[i][3], r[i][4]) for r in per_rank]


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
