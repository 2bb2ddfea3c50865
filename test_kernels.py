"""
The CUDA branches of ring.py and ulysses.py, run on CPU. Which kernel runs is a function of what decides it
(ring.block_kernel, ulysses.use_flash_attn, ulysses.sdpa_takes_groups), so a test can ask it what a GPU would run.
Each CUDA kernel the code may call has a stand-in here, under the kernel's own name and argument list, that checks
its inputs as the real kernel reads them (dtypes, head sizes, grouped-query heads, the layout and contiguity of the
log-sum-exp, the arguments of flash-attn 2.7 and 2.8) and computes with PyTorch's CPU kernels in float32, rounding
what it returns as the real kernel does. `on_cuda` puts them in place; the tests then run ring attention, USP and
Ulysses' kernels end to end as a GPU would, against one device in float64.

A contract here was read from the kernels' sources (flash-attn 2.7.0 to 2.8.3, PyTorch 2.11) and, where a GPU was
lent, checked against the real kernels on an H100 (BENCHMARKS.md, the kernel table).
"""

from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ring
import ulysses
from conftest import assert_all_close, qkv, run_ranks, usp_groups

SIXTEEN_BIT = (torch.float16, torch.bfloat16)
cpu_sdpa = F.scaled_dot_product_attention
choose_block_kernel, choose_flash_attn, choose_sdpa_groups = (ring.block_kernel, ulysses.use_flash_attn,
                                                             ulysses.sdpa_takes_groups)


def need(condition, what):
    if not condition:
        raise AssertionError(f"CUDA kernel contract broken: {what}")


def cpu_attention(q, k, v, causal, scale):
    """What every stand-in computes with: (out, lse) of head-major q [B, Hq, L, D], k, v [B, Hkv, L, D], in float32
    (float64 stays), by PyTorch's CPU flash kernel. Its backward is cpu_attention_backward."""
    wide = [t.to(torch.promote_types(t.dtype, torch.float32)) for t in (q, k, v)]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*wide, 0.0, causal, scale=scale)


def cpu_attention_backward(dout, q, k, v, out, lse, causal, scale):
    wide = [t.to(torch.promote_types(t.dtype, torch.float32)) for t in (dout, q, k, v, out)]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(*wide, lse, 0.0, causal, scale=scale)


def maybe_contiguous(t):
    """What flash-attn's wrappers do to q, k, v (and dout, out): a copy only when the last dim is strided."""
    return t if t.stride(-1) == 1 else t.contiguous()


def flash_head_size(q, k, v):
    need(q.dtype in SIXTEEN_BIT and k.dtype == v.dtype == q.dtype, f"fp16 or bf16 alike: {q.dtype, k.dtype, v.dtype}")
    need(q.shape[-1] % 8 == 0, f"a head size that is a multiple of 8, got {q.shape[-1]} (only the public calls pad)")
    need(q.shape[-1] <= 256, f"a head size up to 256, got {q.shape[-1]}")


# ----------------------------------------------------------------------------------------------------------------
# flash-attn 2.7 - 2.8: the private calls ring.py makes, [B, L, heads, D]


def flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
                       alibi_slopes, return_softmax):
    """flash_attn.flash_attn_interface._flash_attn_forward as of 2.7: eleven arguments, four results."""
    q, k, v = (maybe_contiguous(t) for t in (q, k, v))
    flash_head_size(q, k, v)
    need(q.shape[2] % k.shape[2] == 0, "query heads a multiple of the kv heads")
    need((dropout_p, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax) ==
         (0.0, -1, -1, 0.0, None, False), "no dropout, window, softcap or alibi (the ring uses none)")
    out, lse = cpu_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal, softmax_scale)
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse.contiguous(), None, None  # (B, L, Hq, D), (B, Hq, L)


def flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                        window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    """flash_attn.flash_attn_interface._flash_attn_backward as of 2.7: writes dq, dk, dv. Its kernel reads
    softmax_lse as a contiguous [B, Hq, Lq] float32 array, and nothing makes it one."""
    dout, q, k, v, out = (maybe_contiguous(t) for t in (dout, q, k, v, out))
    flash_head_size(q, k, v)
    need(dout.dtype == out.dtype == q.dtype, f"dout and out in q's dtype, got {dout.dtype}, {out.dtype}")
    B, Lq, Hq, _ = q.shape
    need(softmax_lse.dtype == torch.float32 and softmax_lse.shape == (B, Hq, Lq), "lse [B, Hq, Lq] float32")
    need(softmax_lse.is_contiguous(), f"lse read as contiguous memory, got strides {softmax_lse.stride()}")
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        need(grad.shape == like.shape and grad.dtype == q.dtype and grad.stride(-1) == 1, "dq, dk, dv like q, k, v")
    heads = [t.transpose(1, 2) for t in (dout, q, k, v, out)]  # (B, L, H, D) -> (B, H, L, D)
    for grad, value in zip((dq, dk, dv), cpu_attention_backward(*heads, softmax_lse, causal, softmax_scale)):
        grad.copy_(value.transpose(1, 2))
    return (dout.float() * out.float()).sum(-1).transpose(1, 2)  # softmax_d (B, Hq, Lq)


# flash-attn's public calls, which ulysses.py makes: any head size up to 256, padded to a multiple of 8 inside, the
# output handed back as a view of the padded one


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    need(q.dim() == 4 and q.shape[:2] == k.shape[:2] == v.shape[:2], "q, k, v [B, S, heads, D]")
    need(not return_attn_probs, "no probabilities returned, as ulysses.py calls it")
    return padded_attention(q, k, v, softmax_scale, causal, window_size)[..., :q.shape[-1]]  # (B, S, H, D): a view


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), **rest):
    """Sequences packed as [total, heads, D], cut by cu_seqlens: int32, contiguous, from 0 to total."""
    need(q.dim() == 3 and cu_seqlens_q is cu_seqlens_k, "q, k, v [total, heads, D], one cu_seqlens for both")
    need(cu_seqlens_q.dtype == torch.int32 and cu_seqlens_q.is_contiguous(), "cu_seqlens int32, contiguous")
    bounds = cu_seqlens_q.tolist()
    need(bounds[0] == 0 and bounds[-1] == q.shape[0] and bounds == sorted(bounds), f"cu_seqlens {bounds}")
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    need(max_seqlen_q == max_seqlen_k == max(lengths) and isinstance(max_seqlen_q, int), "max_seqlen, an int")
    out = [padded_attention(*(t[None, a:b] for t in (q, k, v)), softmax_scale, causal, window_size)[0]
           for a, b in zip(bounds, bounds[1:])]  # (n, H, D rounded up to 8) each
    return torch.cat(out)[..., :q.shape[-1]]  # (total, H, D): a view of the padded output, strided when D % 8


def padded_attention(q, k, v, softmax_scale, causal, window_size):
    """What flash-attn's public calls compute: fp16 or bf16, any head size up to 256, padded to a multiple of 8
    (returned padded, [B, S, H, D rounded up to 8]), grouped-query heads, causal with a window to the left."""
    need(q.dtype in SIXTEEN_BIT and k.dtype == v.dtype == q.dtype and q.shape[-1] <= 256, "fp16/bf16, head <= 256")
    need(q.shape[2] % k.shape[2] == 0 and causal, "grouped heads; causal, as ulysses.py calls it")
    D, S, G = q.shape[-1], q.shape[1], q.shape[2] // k.shape[2]
    padded = [F.pad(t, (0, -D % 8)).float().transpose(1, 2) for t in (q, k, v)]  # (B, H, S, D rounded up to 8)
    padded[1:] = [t.repeat_interleave(G, dim=1) for t in padded[1:]]
    i = torch.arange(S)
    visible = (i[:, None] >= i) & ((i[:, None] - i < window_size[0] + 1) if window_size[0] >= 0 else True)
    out = cpu_sdpa(*padded, attn_mask=visible, scale=softmax_scale or D ** -0.5)  # (B, H, S, D8)
    return out.transpose(1, 2).to(q.dtype)  # (B, S, H, D8)


# ----------------------------------------------------------------------------------------------------------------
# PyTorch's CUDA kernels ring.py calls by name, and SDPA as CUDA runs it; [B, heads, L, D]


def sdpa_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """aten._scaled_dot_product_flash_attention on CUDA: fp16/bf16, head size a multiple of 8 up to 256 (an H100
    refuses 12: "head_size must be a multiple of 8, this is ensured by padding!"), query heads a multiple of kv
    heads."""
    flash_head_size(query, key, value)
    need(query.stride(-1) == key.stride(-1) == value.stride(-1) == 1, "the last dim contiguous")
    need(query.shape[1] % key.shape[1] == 0 and dropout_p == 0.0, "grouped heads, no dropout")
    out, lse = cpu_attention(query, key, value, is_causal, scale)
    L, Lk = query.shape[2], key.shape[2]
    rng = torch.zeros(2, dtype=torch.int64)
    return out.to(query.dtype).contiguous(), lse.contiguous(), None, None, L, Lk, rng, torch.empty(()), torch.empty(0)


def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, philox_seed, philox_offset, *, scale=None):
    """Its backward reads logsumexp as contiguous memory (an H100: a strided view gave dq 56% off)."""
    flash_head_size(query, key, value)
    need(grad_out.dtype == out.dtype == query.dtype, "grad_out and out in the query's dtype")
    need(cum_seq_q is None and cum_seq_k is None and (max_q, max_k) == (query.shape[2], key.shape[2]), "not varlen")
    need(logsumexp.is_contiguous() and logsumexp.dtype == torch.float32, "lse float32, contiguous memory")
    grads = cpu_attention_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale)
    return tuple(g.to(query.dtype) for g in grads)


def efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """aten._scaled_dot_product_efficient_attention on CUDA (read off an H100): float32, fp16 or bf16 ("Only fp32,
    half & bf16 supported at the moment"); as many kv heads as query heads ("Expected query.size(2) == key.size(2)");
    16-bit rows aligned to 8 ("query is not correctly aligned (strideM)"); the lse padded to a multiple of 32 with
    inf; the output's memory token-major."""
    need(query.dtype in (torch.float32, *SIXTEEN_BIT) and key.dtype == value.dtype == query.dtype,
         f"float32, fp16 or bf16, got {query.dtype}")
    need(query.shape[1] == key.shape[1] == value.shape[1], "one kv head per query head")
    if query.dtype in SIXTEEN_BIT:
        need(all(t.stride(2) % 8 == 0 for t in (query, key, value)), "16-bit rows aligned to 8 elements")
    need(attn_bias is None and compute_log_sumexp and dropout_p == 0.0, "no bias or dropout, the lse returned")
    out, lse = cpu_attention(query, key, value, is_causal, scale)
    B, H, L, D = query.shape
    out = out.transpose(1, 2).to(query.dtype).contiguous().transpose(1, 2)  # [B, L, H, D] memory
    padded = lse.new_full((B, H, -(-L // 32) * 32), float("inf"))
    padded[..., :L] = lse
    return out, padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset, dropout_p,
                       grad_input_mask, is_causal=False, *, scale=None):
    """Its backward wants the lse's head stride a multiple of 32, as the forward padded it ("LSE is not correctly
    aligned (strideH)" for a contiguous [B, H, L] copy)."""
    need(query.shape[1] == key.shape[1] and grad_out_.dtype == out.dtype == query.dtype, "heads and dtypes as forward")
    need(logsumexp.stride(1) % 32 == 0 and logsumexp.shape[-1] >= query.shape[2], "lse padded to a multiple of 32")
    lse = logsumexp[..., :query.shape[2]].contiguous()
    grads = cpu_attention_backward(grad_out_, query, key, value, out, lse, is_causal, scale)
    return (*(g.to(query.dtype) for g in grads), None)


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention as CUDA runs it: grouped-query attention only in its flash kernel (fp16 or bf16,
    no mask, heads of at most 256); elsewhere the math kernel, which holds every score. On an H100: float32 and GQA
    held 82 MiB for 32 MiB of scores; bf16 without a mask, 1 MiB."""
    if enable_gqa and query.shape[1] != key.shape[1]:
        need(query.dtype in SIXTEEN_BIT and attn_mask is None and query.shape[-1] <= 256, "grouped-query attention "
             "in fp16/bf16 without a mask and heads of at most 256, else SDPA's math kernel holds the [B, Hq, S, S] "
             "scores")
    wide = (t.to(torch.promote_types(t.dtype, torch.float32)) for t in (query, key, value))  # CUDA's accumulate so
    out = cpu_sdpa(*wide, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return out.to(query.dtype)


class CudaKernels(SimpleNamespace):
    """torch.ops.aten with stand-ins for the CUDA kernels: what ring.py calls by name."""

    def __getattr__(self, name):
        return getattr(torch.ops.aten, name)


def on_cuda(patch, flash_attn_version=(2, 8)):
    """Make ring.py and ulysses.py choose their kernels as on a CUDA GPU, with flash-attn of this version installed
    (None: none), and put the stand-ins in place of the CUDA kernels. patch(owner, name, value): setattr in a rank
    process, monkeypatch.setattr in the test's own."""
    patch(ring, "block_kernel", lambda device, dtype, head_dim: choose_block_kernel("cuda", dtype, head_dim,
                                                                                     flash_attn_version))
    patch(ulysses, "use_flash_attn", lambda device, dtype, head_dim: choose_flash_attn("cuda", dtype, head_dim,
                                                                                        flash_attn_version))
    patch(ulysses, "sdpa_takes_groups", lambda device, dtype, masked, head_dim: choose_sdpa_groups("cuda", dtype,
                                                                                                  masked, head_dim))
    patch(ring, "flash_attn_interface", SimpleNamespace(_flash_attn_forward=flash_attn_forward,
                                                        _flash_attn_backward=flash_attn_backward))
    patch(ulysses, "flash_attn_func", flash_attn_func)
    patch(ulysses, "flash_attn_varlen_func", flash_attn_varlen_func)
    patch(ring, "aten", CudaKernels(_scaled_dot_product_flash_attention=sdpa_flash,
                                    _scaled_dot_product_flash_attention_backward=sdpa_flash_backward,
                                    _scaled_dot_product_efficient_attention=efficient,
                                    _scaled_dot_product_efficient_attention_backward=efficient_backward))
    patch(F, "scaled_dot_product_attention", cuda_sdpa)


# ----------------------------------------------------------------------------------------------------------------
# the choice


def test_kernel_choice():
    """Which kernel computes what, by device, dtype, head size and flash-attn's version: the kernel table of
    BENCHMARKS.md. flash-attn before 2.7 (other private arguments) is never called; float64 and head sizes that no
    CUDA kernel takes go to the einsum tiles; grouped-query attention goes to SDPA as it is only where a fused
    kernel takes it."""
    bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    table = {("cpu", bf16, 12, (2, 8)): "cpu_flash", ("cpu", fp64, 64, None): "cpu_flash",
             ("cuda", bf16, 64, (2, 8)): "flash_attn", ("cuda", fp16, 256, (2, 7)): "flash_attn",
             ("cuda", bf16, 64, (2, 6)): "sdpa_flash", ("cuda", bf16, 64, None): "sdpa_flash",
             ("cuda", bf16, 320, (2, 8)): "efficient", ("cuda", fp32, 12, (2, 8)): "efficient",
             ("cuda", bf16, 12, (2, 8)): "tiles", ("cuda", fp32, 6, None): "tiles", ("cuda", fp64, 64, (2, 8)): "tiles",
             ("mps", fp32, 64, None): "tiles"}
    assert {case: ring.block_kernel(*case) for case in table} == table
    assert [ulysses.use_flash_attn(*case) for case in (("cuda", bf16, 12, (2, 8)), ("cuda", fp16, 256, (2, 7)),
                                                       ("cuda", bf16, 320, (2, 8)), ("cuda", bf16, 64, (2, 6)),
                                                       ("cuda", fp32, 64, (2, 8)), ("cpu", bf16, 64, (2, 8)),
                                                       ("cuda", bf16, 64, None))] == [True, True] + [False] * 5
    assert [ulysses.sdpa_takes_groups(*case) for case in (("cpu", fp32, True, 320), ("cuda", bf16, False, 256),
                                                          ("cuda", bf16, True, 64), ("cuda", fp32, False, 64),
                                                          ("cuda", bf16, False, 264))] == [True, True, False, False,
                                                                                           False]


# ----------------------------------------------------------------------------------------------------------------
# ring attention and USP through the CUDA kernels' stand-ins


def reference(q, k, v, grad_out, window=None, position_ids=None):
    """Output and dq, dk, dv of causal attention (a sliding window, documents) over the whole sequence, by the
    formula, in float64: [B, S, heads, D] in, the same out."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    S, G = q.shape[1], q.shape[2] // k.shape[2]
    i = torch.arange(S, device=q.device)
    visible = (i[:, None] >= i) & ((i[:, None] - i < window) if window else True)  # (S, S)
    if position_ids is not None:
        document = (position_ids == 0).cumsum(1)  # (B, S)
        visible = visible & (document[:, :, None] == document[:, None, :])  # (B, S, S)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(G, dim=2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible.view(-1, 1, S, S), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v.repeat_interleave(G, dim=2))
    out.backward(grad_out.double())
    return [out.detach(), q.grad, k.grad, v.grad]


PACKED_POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6, 7],
                                 [7, 8, 9, 10, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 1, 0, 1, 2, 3]])
# (flash-attn version, dtype, head size, window, packed, scale of q and k): what runs on CUDA
RING_CASES = [((2, 8), torch.bfloat16, 8, None, False, 1), ((2, 8), torch.bfloat16, 8, None, True, 1),
              ((2, 8), torch.bfloat16, 12, None, False, 1), ((2, 8), torch.float16, 8, 5, False, 100),
              ((2, 8), torch.float32, 8, None, True, 1), ((2, 8), torch.float64, 8, None, False, 1),
              (None, torch.bfloat16, 8, None, False, 1), (None, torch.float16, 8, None, True, 1),
              (None, torch.bfloat16, 264, None, False, 1)]


def ring_case(case, S=24, heads=(4, 2)):
    """q, k, v and the output's gradient [B, S, heads, D] of a case: random, scaled; fp16 with scale 100 has scores
    past fp16's range (65504) before the 1/sqrt(D)."""
    _, dtype, D, _, _, scale = case
    q, k, v, grad_out = qkv(2, S, *heads, D)
    return [(t * s).to(dtype) for t, s in zip((q, k, v, grad_out), (scale, scale, 1, 1))]


def _ring_on_cuda_rank(rank, R, cases):
    results = []
    for case in cases:
        on_cuda(setattr, case[0])
        ring.QUERY_TILE = 5  # several query tiles a block
        index = ring.token_index("zigzag", rank, R, 24 // R)
        q, k, v, grad_out = (t[:, index].requires_grad_() for t in ring_case(case))
        positions = PACKED_POSITIONS[:, index] if case[4] else None
        out = ring.ring_attention(q, k, v, dist.group.WORLD, "zigzag", case[3], position_ids=positions)
        out.backward(grad_out)
        results.append([out.detach(), q.grad, k.grad, v.grad])
    return results


def tolerance(dtype):
    """bf16: the kernels round each block's output and gradients to bf16 (2^-9 relative), the ring sums them in
    float32; fp16 keeps 3 more bits; float32 the ring's order of sums; float64 exact to rounding."""
    return {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]


def test_ring_through_the_cuda_kernels():
    """Ring attention on 2 ranks (zigzag, 4 query and 2 kv heads), forward and backward, as a GPU runs it: through
    flash-attn 2.8's private kernels (bf16; packed documents, whose partly visible blocks go to the tiles), PyTorch's
    CUDA flash kernel (no flash-attn: bf16, fp16 with documents), its memory-efficient kernel (float32; bf16 with a
    head size past 256), and the einsum tiles (a head size of 12, a window in fp16 with scores past fp16's range,
    float64), each against one device in float64 from the same inputs. A view of the ring's lse handed to a kernel
    that reads contiguous memory, a 16-bit tile, float64 or a head size of 12 sent to a CUDA kernel, or flash-attn's
    arguments of 2.6 all fail here."""
    per_rank = run_ranks(2, _ring_on_cuda_rank, RING_CASES)
    for i, case in enumerate(RING_CASES):
        q, k, v, grad_out = ring_case(case)
        want = reference(q, k, v, grad_out, case[3], PACKED_POSITIONS if case[4] else None)
        got = [torch.zeros_like(t) for t in want]
        for rank, parts in enumerate(r[i] for r in per_rank):
            index = ring.token_index("zigzag", rank, 2, 12)
            for full, part in zip(got, parts):
                full[:, index] = part.double()
        scale = max(t.abs().max().item() for t in want)  # fp16's large scores make large gradients
        assert_all_close(got, want, tolerance(case[1]), tolerance(case[1]) * scale, where=f"case {case}")


def _usp_on_cuda_rank(rank, P, cases):
    ulysses_group, ring_group = usp_groups(2, 2)
    index = ulysses.shard_for_sp(*[torch.arange(24)[None]] * 3, ulysses_group, ring_group)[0][0]  # my tokens
    positions = ulysses.gather_sequence(PACKED_POSITIONS[:, index], ulysses_group)  # of my ring rank's tokens
    results = []
    for case in cases:
        on_cuda(setattr, case[0])
        q, k, v, grad_out = (t[:, index].requires_grad_() for t in ring_case(case))
        attend = partial(ring.ring_attention, group=ring_group, layout="zigzag", window=case[3],
                         position_ids=positions if case[4] else None)
        out = ulysses.ulysses_attention(q, k, v, ulysses_group, attend)
        out.backward(grad_out)
        results.append((index, [out.detach(), q.grad, k.grad, v.grad]))
    return results


def test_usp_through_the_cuda_kernels():
    """Ulysses 2 x ring 2 on 4 ranks as a GPU runs it: flash-attn's kernels in bf16 with packed documents, PyTorch's
    memory-efficient kernel in float32 (its kv heads expanded), against one device in float64."""
    cases = [((2, 8), torch.bfloat16, 8, None, True, 1), (None, torch.float32, 8, 3, False, 1)]
    per_rank = run_ranks(4, _usp_on_cuda_rank, cases)
    for i, case in enumerate(cases):
        q, k, v, grad_out = ring_case(case)
        want = reference(q, k, v, grad_out, case[3], PACKED_POSITIONS if case[4] else None)
        got = [torch.zeros_like(t) for t in want]
        for index, parts in (r[i] for r in per_rank):
            for full, part in zip(got, parts):
                full[:, index] = part.double()
        assert_all_close(got, want, tolerance(case[1]), tolerance(case[1]), where=f"case {case}")


# ----------------------------------------------------------------------------------------------------------------
# Ulysses' kernels (what runs between its all-to-alls) through flash-attn's public calls and CUDA's SDPA

# (flash-attn version, dtype, head size, window, packed)
ULYSSES_CASES = [((2, 8), torch.bfloat16, 8, None, False), ((2, 8), torch.bfloat16, 12, 5, False),
                 ((2, 8), torch.float16, 12, None, True), ((2, 7), torch.bfloat16, 12, 5, True),
                 (None, torch.float32, 8, None, False), (None, torch.bfloat16, 8, 5, False),
                 (None, torch.float32, 12, 5, True), (None, torch.bfloat16, 8, None, True),
                 (None, torch.float16, 264, None, False)]


@pytest.mark.parametrize("case", ULYSSES_CASES, ids=lambda case: "-".join(map(str, case)))
def test_ulysses_kernels_through_the_cuda_kernels(monkeypatch, case):
    """causal_attention, sliding_window_attention and document_attention (flash-attn's variable-length call) as a
    GPU runs them, 4 query heads on 2 kv heads, forward and backward, against one device in float64: flash-attn's
    public calls (which pad a head size of 12 to 16 and hand back a strided view), and without flash-attn CUDA's SDPA,
    which must never get grouped-query attention in float32 or with a mask (its math kernel would hold every
    score)."""
    version, dtype, D, window, packed = case
    on_cuda(monkeypatch.setattr, version)
    q, k, v, grad_out = ring_case((version, dtype, D, window, packed, 1))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if packed:
        out = ulysses.document_attention(q, k, v, PACKED_POSITIONS, window)
    else:
        out = ulysses.sliding_window_attention(q, k, v, window) if window else ulysses.causal_attention(q, k, v)
    out.backward(grad_out)
    want = reference(q, k, v, grad_out, window, PACKED_POSITIONS if packed else None)
    assert_all_close([out.detach(), q.grad, k.grad, v.grad], [t.to(dtype) for t in want], tolerance(dtype),
                     tolerance(dtype))


# ----------------------------------------------------------------------------------------------------------------
# on a machine with a GPU: the stand-ins held against the real kernels (skipped on CPU)

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def outcome(call):
    """("ok", what the call returned) or ("refused", its error)."""
    try:
        return "ok", call()
    except (RuntimeError, AssertionError) as e:
        return "refused", e


def relative(a, b):
    return ((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm()).item()


@cuda_only
@pytest.mark.parametrize("name", ["sdpa_flash", "efficient"])
def test_stand_ins_take_what_the_cuda_kernels_take(name):
    """Each stand-in runs where its CUDA kernel runs and refuses what it refuses (dtypes, head sizes, grouped heads),
    and returns the same numbers (bf16's rounding apart), the same lse layout and padding, and the same output
    strides."""
    real, stand_in = {"sdpa_flash": (torch.ops.aten._scaled_dot_product_flash_attention, sdpa_flash),
                      "efficient": (torch.ops.aten._scaled_dot_product_efficient_attention, efficient)}[name]
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for D, Hkv in ((64, 4), (64, 2), (12, 4), (72, 4), (256, 2), (320, 4)):
            q, k, v = (torch.randn(2, h, 100, D).to(dtype) for h in (4, Hkv, Hkv))
            call = ((lambda f, *t: f(*t, 0.0, True, False, scale=D ** -0.5)) if name == "sdpa_flash" else
                    (lambda f, *t: f(*t, None, True, 0.0, True, scale=D ** -0.5)))
            (verdict, got), (expected, want) = (outcome(lambda: call(real, *(t.cuda() for t in (q, k, v)))),
                                                outcome(lambda: call(stand_in, q, k, v)))
            assert verdict == expected, (dtype, D, Hkv, got, want)
            if verdict == "ok":
                assert relative(got[0], want[0]) < tolerance(dtype) and relative(got[1], want[1]) < 1e-6
                assert got[0].stride() == want[0].stride() and got[1].shape == want[1].shape


@cuda_only
@pytest.mark.parametrize("name", ["sdpa_flash", "efficient"])
def test_cuda_backwards_read_the_lse_as_the_stand_ins_say(name):
    """PyTorch's CUDA flash backward reads the lse as contiguous memory: handed a strided view it runs and its
    gradients come out wrong, where the stand-in refuses. The memory-efficient backward takes its lse padded (or a
    view of it) and refuses a contiguous copy, as the stand-in does."""
    q, grad_out = (torch.randn(2, 4, 100, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 4 if name == "efficient" else 2, 100, 64, dtype=torch.bfloat16) for _ in range(2))
    want = [t.transpose(1, 2) for t in reference(*(t.transpose(1, 2) for t in (q, k, v, grad_out)))[1:]]

    def gradients(device, real, layout):
        tensors = [t.to(device) for t in (q, k, v, grad_out)]
        if name == "sdpa_flash":
            forward, backward = ((torch.ops.aten._scaled_dot_product_flash_attention,
                                  torch.ops.aten._scaled_dot_product_flash_attention_backward) if real
                                 else (sdpa_flash, sdpa_flash_backward))
            r = forward(*tensors[:3], 0.0, True, False, scale=0.125)
            lse = {"returned": r[1], "view": torch.cat([r[1], r[1]], -1)[..., 100:]}[layout]
            return backward(tensors[3], *tensors[:3], r[0], lse, *r[2:6], 0.0, True, *r[6:8], scale=0.125)
        forward, backward = ((torch.ops.aten._scaled_dot_product_efficient_attention,
                              torch.ops.aten._scaled_dot_product_efficient_attention_backward) if real
                             else (efficient, efficient_backward))
        r = forward(*tensors[:3], None, True, 0.0, True, scale=0.125)
        lse = {"returned": r[1], "view": r[1][..., :100], "copy": r[1][..., :100].contiguous()}[layout]
        return backward(tensors[3], *tensors[:3], None, r[0], lse, *r[2:4], 0.0, [True] * 3 + [False], True,
                        scale=0.125)[:3]

    for layout in ("returned", "view") + (("copy",) if name == "efficient" else ()):
        (verdict, got), (expected, _) = outcome(lambda: gradients("cuda", True, layout)), outcome(
            lambda: gradients("cpu", False, layout))
        right = verdict == "ok" and max(relative(g, w) for g, w in zip(got, want)) < 1e-2
        if name == "sdpa_flash" and layout == "view":
            assert verdict == "ok" and not right and expected == "refused"  # wrong numbers, silently
        else:
            assert (verdict, expected) in (("ok", "ok"), ("refused", "refused")) and (right or verdict == "refused")


@cuda_only
@pytest.mark.parametrize("case", RING_CASES[2:], ids=lambda case: "-".join(map(str, case)))
def test_the_cuda_paths_match_one_device_and_the_stand_ins(monkeypatch, case):
    """ring_attention(group=None) on the GPU, through whichever kernel block_kernel picks there, against the formula
    in float64 on the GPU, and against the same call on CPU through the stand-ins."""
    _, dtype, D, window, packed, _ = case
    q, k, v, grad_out = ring_case(case)
    want = reference(*(t.cuda() for t in (q, k, v, grad_out)), window, PACKED_POSITIONS.cuda() if packed else None)

    def run(device):
        inputs = [t.to(device).requires_grad_() for t in (q, k, v)]
        out = ring.ring_attention(*inputs, window=window, position_ids=PACKED_POSITIONS.to(device) if packed else None)
        out.backward(grad_out.to(device))
        return [t.double().cpu() for t in (out, *(t.grad for t in inputs))]

    got = run("cuda")
    scale = max(t.abs().max().item() for t in want)
    assert_all_close(got, [t.cpu() for t in want], tolerance(dtype), tolerance(dtype) * scale)
    on_cuda(monkeypatch.setattr, None)
    assert_all_close(got, run("cpu"), tolerance(dtype), tolerance(dtype) * scale)
