"""
Tests of bench.py's attention baselines against one device: what `python bench.py attention` times against
ulysses_attention computes the same attention and sends the bytes of its formula.
"""

import pytest
import torch.distributed as dist

import bench
import ulysses
from conftest import assert_all_close, attention_and_grads, qkv, run_ranks, sp_slice, whole_sequence


BASELINE = dict(S=24, Hq=8, Hkv=4, D=8)  # (c) needs P to divide both head counts


def _baselines_rank(rank, world_size):
    results = []
    for B in (1, 2):  # B = 1: (c) copies once per all-to-all; B = 2: twice
        for baseline in (bench.three_all_to_alls, bench.gathered_kv):
            q, k, v, grad_out = (sp_slice(t, rank, world_size) for t in qkv(B, *BASELINE.values()))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            ulysses.reset_all_to_all_stats()
            bench.gather_stats["bytes"] = 0
            out = baseline(q, k, v, dist.group.WORLD)
            out.backward(grad_out)
            sent = bench.gather_stats["bytes"] + sum(c["bytes"] for c in ulysses.all_to_all_stats.values())
            results.append(((out.detach(), q.grad, k.grad, v.grad), sent))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_benchmark_baselines_match_one_device(world_size):
    """What python bench.py attention times against ulysses_attention computes the same attention: (c) q, k and
    v in three all-to-alls and (d) all-gathered k and v, output and dq, dk, dv against one device, B = 1 and 2,
    each sending the bytes of its formula."""
    per_rank = run_ranks(world_size, _baselines_rank)
    P, (S, Hq, Hkv, D) = world_size, BASELINE.values()
    for i, (B, name) in enumerate((B, name) for B in (1, 2) for name in ("(c)", "(d)")):
        got = [whole_sequence(parts) for parts in zip(*(r[i][0] for r in per_rank))]
        assert_all_close(got, attention_and_grads(*qkv(B, S, Hq, Hkv, D)), where=f"{name} B={B}")
        head = B * S // P * D * 4  # bytes of one head of a rank's tokens, float32
        formula = {"(c)": 2 * (Hq + 2 * Hkv + Hq) * head * (P - 1) // P,  # (P-1)/P of q, k, v and out, both ways
                   "(d)": 4 * Hkv * head * (P - 1)}[name]  # k and v to every other rank, their gradients back
        assert [r[i][1] for r in per_rank] == [formula] * P, f"{name} B={B}"
