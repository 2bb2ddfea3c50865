"""
The CUDA branches of ring.py, ulysses.py and documents.py, run on CPU. Which kernel runs is a function of what
decides it (ring.block_kernel, ulysses.sdpa_takes_groups), so a test can ask it what a GPU would run. Each CUDA
kernel the code may call (PyTorch's flash kernel, cuDNN's, SDPA) has a stand-in here, under the kernel's own name and
argument list, that checks its inputs as the real kernel reads them (dtypes, head sizes, grouped-query heads, the
blocks it was held to, the layout and contiguity of the log-sum-exp) and computes with PyTorch's CPU kernels in
float32, rounding what it returns as the real kernel does. `on_cuda` puts them in place, for a GPU that runs flash or
one that runs cuDNN; the tests then run ring attention, USP and Ulysses' kernels end to end as that GPU would, against
one device in float64. The tests at the end, on a machine with a GPU, hold each stand-in to its kernel.
"""

import inspect
from functools import partial
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import documents
import ring
import ulysses
from conftest import assert_all_close, qkv, run_ranks, usp_groups

SIXTEEN_BIT = (torch.float16, torch.bfloat16)
# block_kernel's gpu, (compute capability, cuDNN version): an H100 or H200 with torch 2.11's cuDNN runs cuDNN's kernel
HOPPER, AMPERE, OLD_CUDNN, BLACKWELL = ((9, 0), 91900), ((8, 0), 91900), ((9, 0), 91002), ((10, 0), 91900)
cpu_sdpa = F.scaled_dot_product_attention
choose_block_kernel, choose_sdpa_groups = ring.block_kernel, ulysses.sdpa_takes_groups


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


def flash_head_size(q, k, v):
    need(q.dtype in SIXTEEN_BIT and k.dtype == v.dtype == q.dtype, f"fp16 or bf16 alike: {q.dtype, k.dtype, v.dtype}")
    need(q.shape[-1] % 8 == 0, f"a head size that is a multiple of 8, got {q.shape[-1]} (SDPA pads; the op does not)")
    need(q.shape[-1] <= 256, f"a head size up to 256, got {q.shape[-1]}")


# ----------------------------------------------------------------------------------------------------------------
# PyTorch's CUDA flash kernel, which ring.py calls by name, and SDPA as CUDA runs it; [B, heads, L, D]


def cuda_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
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


def cuda_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, philox_seed, philox_offset, *, scale=None):
    """Its backward reads logsumexp as contiguous memory (an H100: a strided view gave dq 56% off)."""
    flash_head_size(query, key, value)
    need(grad_out.dtype == out.dtype == query.dtype, "grad_out and out in the query's dtype")
    need(cum_seq_q is None and cum_seq_k is None and (max_q, max_k) == (query.shape[2], key.shape[2]), "not varlen")
    need(logsumexp.is_contiguous() and logsumexp.dtype == torch.float32, "lse float32, contiguous memory")
    grads = cpu_attention_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale)
    return tuple(g.to(query.dtype) for g in grads)


def cudnn_takes(query, key, value, is_causal):
    """What cuDNN's attention takes, as SDPA sends it there on an H100 or H200, and the blocks a GPU held it to."""
    need(query.dtype in SIXTEEN_BIT and key.dtype == value.dtype == query.dtype,
         f"fp16 or bf16 alike: {query.dtype, key.dtype, value.dtype}")
    need(query.shape[-1] == key.shape[-1] == value.shape[-1] and query.shape[-1] % 8 == 0 and query.shape[-1] <= 128,
         f"one head size, a multiple of 8 up to 128, got {query.shape[-1]}")
    need(query.stride(-1) == key.stride(-1) == value.stride(-1) == 1, "the last dim contiguous")
    need(query.shape[1] % key.shape[1] == 0, "query heads a multiple of kv heads")
    need(key.shape[2] > 1, "two keys or more (SDPA never sends cuDNN one)")
    need(is_causal and query.shape[2] == key.shape[2], "a causal square block, all a GPU held it to so far")


def cuda_cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
               return_debug_mask=False, *, scale=None):
    """aten._scaled_dot_product_cudnn_attention on an H200 (cuDNN 9.19), as `cudnn_takes` says. Of its 9 results the
    ring reads two: out [B, Hq, Lq, D] in the input dtype, contiguous, and lse [B, Hq, Lq, 1] float32, contiguous."""
    cudnn_takes(query, key, value, is_causal)
    need(attn_bias is None and compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask,
         "no bias, the lse, no dropout")
    out, lse = cpu_attention(query, key, value, is_causal, scale)
    rng = torch.zeros((), dtype=torch.int64)
    return (out.to(query.dtype).contiguous(), lse[..., None].contiguous(), None, None, query.shape[2], key.shape[2],
            rng, rng, torch.empty(0, dtype=query.dtype))


def cuda_cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
                        cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
    """Its backward reads logsumexp as contiguous [B, Hq, Lq, 1] memory (taken as flash's backward reads its own), and
    wants grad_out and out in the query's dtype with equal strides (PyTorch's own context-parallel ring tripped that
    assert), laid out as the query: PyTorch caches cuDNN's graph by q, k and v's strides, and on an H200 a call whose
    out and grad_out came in another layout than the graph's first got wrong gradients, silently."""
    cudnn_takes(query, key, value, is_causal)
    need(grad_out.dtype == out.dtype == query.dtype and layout(grad_out) == layout(out)
         and [d for d, _ in layout(out)] == [d for d, _ in layout(query)],
         "grad_out and out in the query's dtype and layout, with equal strides")
    need(logsumexp.dtype == torch.float32 and logsumexp.shape == (*query.shape[:3], 1) and logsumexp.is_contiguous(),
         f"lse [B, Hq, Lq, 1] float32 in contiguous memory, got {tuple(logsumexp.shape)} {logsumexp.stride()}")
    need(attn_bias is None and cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0
         and (max_q, max_k) == (query.shape[2], key.shape[2]), "dense, no bias, no dropout")
    grads = cpu_attention_backward(grad_out, query, key, value, out, logsumexp[..., 0], is_causal, scale)
    return tuple(g.to(query.dtype) for g in grads)


def layout(t):
    """(dim, stride) of t's dims in memory order, outermost first; a dim of one element is never stepped: left out."""
    return sorted(((d, t.stride(d)) for d in range(t.dim()) if t.shape[d] > 1), key=lambda ds: -ds[1])


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


STAND_INS = {"_scaled_dot_product_flash_attention": cuda_flash,  # the CUDA kernels ring.py calls by name
             "_scaled_dot_product_flash_attention_backward": cuda_flash_backward,
             "_scaled_dot_product_cudnn_attention": cuda_cudnn,
             "_scaled_dot_product_cudnn_attention_backward": cuda_cudnn_backward}
CALLED = set()  # the kernels whose stand-ins ran in this process


def noting(name, stand_in):
    """The stand-in, noting in CALLED that it ran."""
    def call(*args, **kwargs):
        CALLED.add(name)
        return stand_in(*args, **kwargs)
    return call


class CudaKernels(SimpleNamespace):
    """torch.ops.aten with stand-ins for the CUDA kernels: what ring.py calls by name."""

    def __getattr__(self, name):
        return getattr(torch.ops.aten, name)


def on_cuda(patch, gpu=HOPPER):
    """Make ring.py and ulysses.py choose their kernels as on a CUDA GPU (gpu: for ring.block_kernel), and put the
    stand-ins in place of the CUDA kernels. patch(owner, name, value): setattr in a rank process, monkeypatch.setattr
    in the test's own."""
    patch(ring, "block_kernel", lambda device, dtype, head_dim: choose_block_kernel("cuda", dtype, head_dim, gpu))
    patch(ulysses, "sdpa_takes_groups", lambda device, dtype, masked, head_dim: choose_sdpa_groups("cuda", dtype,
                                                                                                  masked, head_dim))
    patch(ring, "aten", CudaKernels(**{name: noting(name, stand_in) for name, stand_in in STAND_INS.items()}))
    patch(F, "scaled_dot_product_attention", cuda_sdpa)


# ----------------------------------------------------------------------------------------------------------------
# the choice


def test_kernel_choice():
    """Which kernel computes what, by device, dtype, head size and GPU. A ring's blocks: PyTorch's flash kernel on CPU
    (any dtype and head size) and on CUDA (fp16 and bf16, head sizes a multiple of 8 up to 256), cuDNN's in its stead
    up to 128 on a GPU where SDPA runs cuDNN first (compute capability 9 and cuDNN after 9.15.0, not an A100, an older
    cuDNN or, not yet held to it, Blackwell); the einsum tiles for the rest (float32 and float64 on CUDA, other head
    sizes, other devices). Between Ulysses' all-to-alls, SDPA: it gets grouped-query attention as it is only where a
    fused kernel takes it."""
    bf16, fp16, fp32, fp64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    table = {("cpu", bf16, 12): "cpu_flash", ("cpu", fp64, 64): "cpu_flash", ("mps", fp16, 64): "tiles",
             ("cuda", bf16, 64, AMPERE): "cuda_flash", ("cuda", fp16, 256, AMPERE): "cuda_flash",
             ("cuda", fp16, 8, AMPERE): "cuda_flash", ("cuda", bf16, 264, AMPERE): "tiles",
             ("cuda", bf16, 12, AMPERE): "tiles", ("cuda", fp32, 64, AMPERE): "tiles",
             ("cuda", fp64, 64, AMPERE): "tiles", ("cuda", bf16, 128, HOPPER): "cudnn",
             ("cuda", fp16, 64, HOPPER): "cudnn", ("cuda", bf16, 8, HOPPER): "cudnn",
             ("cuda", bf16, 136, HOPPER): "cuda_flash", ("cuda", fp16, 256, HOPPER): "cuda_flash",
             ("cuda", bf16, 128, OLD_CUDNN): "cuda_flash", ("cuda", bf16, 128, BLACKWELL): "cuda_flash",
             ("cuda", bf16, 12, HOPPER): "tiles", ("cuda", fp32, 64, HOPPER): "tiles",
             ("cuda", fp64, 128, HOPPER): "tiles", ("cuda", bf16, 264, HOPPER): "tiles"}
    assert {case: ring.block_kernel(*case) for case in table} == table
    assert [ulysses.sdpa_takes_groups(*case) for case in (("cpu", fp32, True, 320), ("cuda", bf16, False, 256),
                                                          ("cuda", bf16, True, 64), ("cuda", fp32, False, 64),
                                                          ("cuda", bf16, False, 264))] == [True, True, False, False,
                                                                                           False]


# ----------------------------------------------------------------------------------------------------------------
# the stand-ins themselves


def test_the_stand_ins_take_the_kernels_arguments():
    """Each CUDA kernel's stand-in takes the kernel's arguments: the names, defaults and keyword-only marks of its
    schema, which a CPU build of PyTorch holds too. A call ring.py makes of one then fits the other."""
    for name, stand_in in STAND_INS.items():
        schema = getattr(torch.ops.aten, name).default._schema
        want = [(a.name, a.default_value if a.has_default_value() else "required", a.kwarg_only)
                for a in schema.arguments]
        got = [(p.name, "required" if p.default is p.empty else p.default, p.kind == p.KEYWORD_ONLY)
               for p in inspect.signature(stand_in).parameters.values()]
        assert got == want, name


def block_reference(q, k, v, dout, causal, scale):
    """out, lse, dq, dk, dv of one block by the formula, in float64: head-major q [B, Hq, Lq, D], k and v
    [B, Hkv, Lk, D]; causal: query i sees keys 0 .. i."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(G, 1)) * scale  # (B, Hq, Lq, Lk)
    if causal:
        hidden = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)  # (Lq, Lk)
        scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.einsum("bhqk,bhkd->bhqd", scores.softmax(-1), v.repeat_interleave(G, 1))
    out.backward(dout.double())
    return [out.detach(), scores.logsumexp(-1).detach(), q.grad, k.grad, v.grad]


def test_the_cudnn_stand_in_keeps_the_kernels_contract():
    """cuDNN's stand-in called as ring.py calls it (bf16, 4 query heads on 2 kv heads): its 9 results, out in bf16 and
    lse [B, Hq, L, 1] float32 in contiguous memory, then dq, dk, dv, against float64 math. And a refusal for each call
    outside the contract: float32, float64, head sizes 12 and 136, one key, a block that is not causal or not square,
    a bias, dropout; in backward an lse that is a view (zigzag's half rows) or [B, Hq, L], grad_out and out of other
    strides or dtypes."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, h, 10, 64, generator=g).to(torch.bfloat16) for h in (4, 2, 2, 4))
    result = cuda_cudnn(q, k, v, None, True, 0.0, True, scale=0.125)
    want = block_reference(q, k, v, dout, True, 0.125)
    out, lse = result[:2]
    assert len(result) == 9 and result[4:6] == (10, 10) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, 10, 1) and lse.is_contiguous()
    assert relative(out, want[0]) < tolerance(torch.bfloat16) and relative(lse[..., 0], want[1]) < 1e-6

    def backward(dout=dout, out=out, lse=lse):
        return cuda_cudnn_backward(dout, q, k, v, out, lse, *result[6:8], None, *result[2:6], 0.0, True, scale=0.125)
    assert max(relative(got, w) for got, w in zip(backward(), want[2:])) < tolerance(torch.bfloat16)

    def forward(q=q, k=k, v=v, **change):
        return cuda_cudnn(q, k, v, **{"attn_bias": None, "compute_log_sumexp": True, "is_causal": True} | change)
    d136 = torch.randn(2, 4, 10, 136, dtype=torch.bfloat16)
    calls = [lambda: forward(q.float(), k.float(), v.float()), lambda: forward(q.double(), k.double(), v.double()),
             lambda: forward(q[..., :12], k[..., :12], v[..., :12]), lambda: forward(d136, d136, d136),
             lambda: forward(q[:, :, :1], k[:, :, :1], v[:, :, :1]), lambda: forward(is_causal=False),
             lambda: forward(q[:, :, :5]), lambda: forward(attn_bias=torch.zeros(10, 10, dtype=torch.bfloat16)),
             lambda: forward(dropout_p=0.5), lambda: backward(lse=torch.cat([lse, lse], 2)[:, :, 10:]),
             lambda: backward(lse=lse[..., 0]), lambda: backward(dout=dout.float()),
             lambda: backward(dout=dout.transpose(1, 2).contiguous().transpose(1, 2))]  # in [B, L, H, D] memory
    assert [i for i, call in enumerate(calls) if not refused(call)] == []


def refused(call):
    """Whether a stand-in refuses the call for its kernel's contract."""
    try:
        call()
    except AssertionError as e:
        return str(e).startswith("CUDA kernel contract broken")
    return False


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
                                 [7, 8, 9, 10, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 1, 0, 0, 1, 2]])
# a document of one token (position 20): a block of one key, which sees every key (cuDNN takes two or more)
# (dtype, head size, window, packed, scale of q and k): what runs on CUDA
RING_CASES = [(torch.bfloat16, 8, None, False, 1), (torch.bfloat16, 8, None, True, 1),
              (torch.float16, 8, None, True, 1), (torch.bfloat16, 12, None, False, 1),
              (torch.float16, 8, 5, False, 100), (torch.float32, 8, None, True, 1),
              (torch.float64, 8, None, False, 1), (torch.bfloat16, 264, None, False, 1),
              (torch.bfloat16, 136, None, False, 1)]
GPUS = {"flash": AMPERE, "cudnn": HOPPER}  # a GPU whose ring runs PyTorch's flash kernel, and one that runs cuDNN's


def case_inputs(dtype, D, scale=1, S=24, heads=(4, 2)):
    """q, k, v and the output's gradient [B, S, heads, D]: random, q and k times scale; fp16 with scale 100 has scores
    past fp16's range (65504) before the 1/sqrt(D)."""
    q, k, v, grad_out = qkv(2, S, *heads, D)
    return [(t * s).to(dtype) for t, s in zip((q, k, v, grad_out), (scale, scale, 1, 1))]


def _ring_on_cuda_rank(rank, R, cases, gpu):
    on_cuda(setattr, gpu)
    ring.QUERY_TILE = 5  # several query tiles a block
    results = []
    for dtype, D, window, packed, scale in cases:
        index = ring.token_index("zigzag", rank, R, 24 // R)
        q, k, v, grad_out = (t[:, index] for t in case_inputs(dtype, D, scale))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        positions = PACKED_POSITIONS[:, index] if packed else None
        out = ring.ring_attention(q, k, v, dist.group.WORLD, "zigzag", window, position_ids=positions)
        out.backward(grad_out.transpose(1, 2).contiguous().transpose(1, 2))  # [B, H, L, D] memory, as from a transpose
        results.append([out.detach(), q.grad, k.grad, v.grad])
    assert ("_scaled_dot_product_cudnn_attention" in CALLED) == (gpu == HOPPER)  # each GPU's own path ran
    return results


def tolerance(dtype):
    """bf16: the kernels round each block's output and gradients to bf16 (2^-9 relative), the ring sums them in
    float32; fp16 keeps 3 more bits; float32 the ring's order of sums; float64 exact to rounding."""
    return {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -9, torch.float32: 1e-5, torch.float64: 1e-12}[dtype]


@pytest.mark.parametrize("gpu", GPUS)
def test_ring_through_the_cuda_kernels(gpu):
    """Ring attention on 2 ranks (zigzag, 4 query and 2 kv heads), forward and backward, as a GPU runs it, one that
    runs PyTorch's flash kernel (an A100) and one that runs cuDNN's (an H100 or H200: its causal square blocks, flash
    the blocks that see every key, a one-token document's block and a head size of 136): bf16, and bf16 and fp16 with
    packed documents, whose partly visible blocks go to the tiles; the einsum tiles alone for a head size of 12 or
    264, a window in fp16 with scores past fp16's range, float32 and float64. Each against one device in float64 from
    the same inputs. A view of the ring's lse handed to either backward, which reads contiguous memory, an lse of the
    wrong shape, a 16-bit tile, or float32, float64, a head size of 12 or 136, a block of one key or a block that sees
    every key sent to cuDNN all fail here."""
    per_rank = run_ranks(2, _ring_on_cuda_rank, RING_CASES, GPUS[gpu])
    for i, (dtype, D, window, packed, scale) in enumerate(RING_CASES):
        q, k, v, grad_out = case_inputs(dtype, D, scale)
        want = reference(q, k, v, grad_out, window, PACKED_POSITIONS if packed else None)
        got = [torch.zeros_like(t) for t in want]
        for rank, parts in enumerate(r[i] for r in per_rank):
            index = ring.token_index("zigzag", rank, 2, 12)
            for full, part in zip(got, parts):
                full[:, index] = part.double()
        largest = max(t.abs().max().item() for t in want)  # fp16's large scores make large gradients
        assert_all_close(got, want, tolerance(dtype), tolerance(dtype) * largest, where=f"case {RING_CASES[i]}")


def _usp_on_cuda_rank(rank, P, cases, gpu):
    on_cuda(setattr, gpu)
    ulysses_group, ring_group = usp_groups(2, 2)
    index = ring.shard_for_ring(*[torch.arange(24)[None]] * 3, ulysses_group, ring_group)[3][0]  # my tokens
    positions = documents.gather_sequence(PACKED_POSITIONS[:, index], ulysses_group)  # of my ring rank's tokens
    results = []
    for dtype, D, window, packed, scale in cases:
        q, k, v, grad_out = (t[:, index].requires_grad_() for t in case_inputs(dtype, D, scale))
        attend = partial(ring.ring_attention, group=ring_group, layout="zigzag", window=window,
                         position_ids=positions if packed else None)
        out = ulysses.ulysses_attention(q, k, v, ulysses_group, attend)
        out.backward(grad_out)
        results.append((index, [out.detach(), q.grad, k.grad, v.grad]))
    assert ("_scaled_dot_product_cudnn_attention" in CALLED) == (gpu == HOPPER)  # each GPU's own path ran
    return results


@pytest.mark.parametrize("gpu", GPUS)
def test_usp_through_the_cuda_kernels(gpu):
    """Ulysses 2 x ring 2 on 4 ranks as a GPU runs it, one that runs PyTorch's flash kernel and one that runs cuDNN's:
    the fused kernels in bf16 with packed documents, the einsum tiles in float32 with a window, against one device in
    float64."""
    cases = [(torch.bfloat16, 8, None, True, 1), (torch.float32, 8, 3, False, 1)]
    per_rank = run_ranks(4, _usp_on_cuda_rank, cases, GPUS[gpu])
    for i, (dtype, D, window, packed, scale) in enumerate(cases):
        q, k, v, grad_out = case_inputs(dtype, D, scale)
        want = reference(q, k, v, grad_out, window, PACKED_POSITIONS if packed else None)
        got = [torch.zeros_like(t) for t in want]
        for index, parts in (r[i] for r in per_rank):
            for full, part in zip(got, parts):
                full[:, index] = part.double()
        assert_all_close(got, want, tolerance(dtype), tolerance(dtype), where=f"case {cases[i]}")


# ----------------------------------------------------------------------------------------------------------------
# Ulysses' kernels (what runs between its all-to-alls) through CUDA's SDPA

# (dtype, head size, window, packed)
ULYSSES_CASES = [(torch.float32, 8, None, False), (torch.bfloat16, 8, 5, False), (torch.float32, 12, 5, True),
                 (torch.bfloat16, 8, None, True), (torch.float16, 264, None, False), (torch.float16, 12, None, True)]


@pytest.mark.parametrize("case", ULYSSES_CASES, ids=lambda case: "-".join(map(str, case)))
def test_ulysses_kernels_through_the_cuda_kernels(monkeypatch, case):
    """ulysses.causal_attention, ulysses.sliding_window_attention and documents.document_attention as a GPU runs
    them, 4 query heads on 2 kv heads, forward and backward, against one device in float64: CUDA's SDPA, which must
    never get grouped-query attention in float32 or with a mask (its math kernel would hold every score)."""
    dtype, D, window, packed = case
    on_cuda(monkeypatch.setattr)
    q, k, v, grad_out = case_inputs(dtype, D)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    if packed:
        out = documents.document_attention(q, k, v, PACKED_POSITIONS, window)
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
def test_the_stand_in_takes_what_the_cuda_kernel_takes():
    """The CUDA flash kernel's stand-in runs where the kernel runs and refuses what it refuses (dtypes, head sizes,
    grouped heads), and returns the same numbers (bf16's rounding apart), the same lse layout and the same output
    strides."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for D, Hkv in ((64, 4), (64, 2), (12, 4), (72, 4), (256, 2), (320, 4)):
            q, k, v = (torch.randn(2, h, 100, D).to(dtype) for h in (4, Hkv, Hkv))

            def call(f, *t):
                return f(*t, 0.0, True, False, scale=D ** -0.5)
            real = torch.ops.aten._scaled_dot_product_flash_attention
            (verdict, got), (expected, want) = (outcome(lambda: call(real, *(t.cuda() for t in (q, k, v)))),
                                                outcome(lambda: call(cuda_flash, q, k, v)))
            assert verdict == expected, (dtype, D, Hkv, got, want)
            if verdict == "ok":
                assert relative(got[0], want[0]) < tolerance(dtype) and relative(got[1], want[1]) < 1e-6
                assert got[0].stride() == want[0].stride() and got[1].shape == want[1].shape


@cuda_only
def test_the_cuda_backward_reads_the_lse_as_the_stand_in_says():
    """PyTorch's CUDA flash backward reads the lse as contiguous memory: handed a strided view it runs and its
    gradients come out wrong, where the stand-in refuses; handed the lse its forward returned, both are right."""
    q, grad_out = (torch.randn(2, 4, 100, 64, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 2, 100, 64, dtype=torch.bfloat16) for _ in range(2))
    want = [t.transpose(1, 2) for t in reference(*(t.transpose(1, 2) for t in (q, k, v, grad_out)))[1:]]

    def gradients(device, real, layout):
        tensors = [t.to(device) for t in (q, k, v, grad_out)]
        forward, backward = ((torch.ops.aten._scaled_dot_product_flash_attention,
                              torch.ops.aten._scaled_dot_product_flash_attention_backward) if real
                             else (cuda_flash, cuda_flash_backward))
        r = forward(*tensors[:3], 0.0, True, False, scale=0.125)
        lse = {"returned": r[1], "view": torch.cat([r[1], r[1]], -1)[..., 100:]}[layout]
        return backward(tensors[3], *tensors[:3], r[0], lse, *r[2:6], 0.0, True, *r[6:8], scale=0.125)

    for layout in ("returned", "view"):
        (verdict, got), (expected, _) = outcome(lambda: gradients("cuda", True, layout)), outcome(
            lambda: gradients("cpu", False, layout))
        right = verdict == "ok" and max(relative(g, w) for g, w in zip(got, want)) < 1e-2
        if layout == "view":
            assert verdict == "ok" and not right and expected == "refused"  # wrong numbers, silently
        else:
            assert verdict == expected == "ok" and right


@cuda_only
@pytest.mark.parametrize("case", RING_CASES, ids=lambda case: "-".join(map(str, case)))
def test_the_cuda_paths_match_one_device_and_the_stand_ins(monkeypatch, case):
    """ring_attention(group=None) on the GPU, through whichever kernel block_kernel picks there (cuDNN's on an H100 or
    H200, for its causal square blocks), against the formula in float64 on the GPU, and against the same call on CPU
    through the stand-ins of the kernels this GPU runs."""
    dtype, D, window, packed, scale = case
    q, k, v, grad_out = case_inputs(dtype, D, scale)
    want = reference(*(t.cuda() for t in (q, k, v, grad_out)), window, PACKED_POSITIONS.cuda() if packed else None)

    def run(device):
        inputs = [t.to(device).requires_grad_() for t in (q, k, v)]
        out = ring.ring_attention(*inputs, window=window, position_ids=PACKED_POSITIONS.to(device) if packed else None)
        out.backward(grad_out.to(device))
        return [t.double().cpu() for t in (out, *(t.grad for t in inputs))]

    got = run("cuda")
    largest = max(t.abs().max().item() for t in want)
    assert_all_close(got, [t.cpu() for t in want], tolerance(dtype), tolerance(dtype) * largest)
    on_cuda(monkeypatch.setattr, ring.cuda_gpu())
    assert_all_close(got, run("cpu"), tolerance(dtype), tolerance(dtype) * largest)


def as_the_ring_passes(t, start, L):
    """Rows start .. start + L - 1 of t [B, S, heads, D] as ring.py hands a block to a kernel: a head-major view
    [B, heads, L, D], neither contiguous nor at the start of its memory."""
    return t.transpose(1, 2)[:, :, start:start + L]


def skip_unless_cudnn(dtype, D):
    if ring.block_kernel("cuda", dtype, D) != "cudnn":
        pytest.skip(f"block_kernel gives a ring's blocks to cuDNN only on another GPU, not {ring.cuda_gpu()}")


@cuda_only
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_the_cudnn_pair_matches_float64_and_its_stand_in(dtype, D):
    """ring.py's cuDNN pair on this GPU (where block_kernel gives it a ring's blocks) on the blocks it takes, causal
    and square: of 100 keys (not a multiple of 128) and of 2. Inputs as the ring passes them: head-major views of rows
    of [B, S, heads, D] tensors, 4 query heads on 2 kv heads, out and the lse views of the ring's. Forward and backward
    against float64 math, and against the same calls on CPU through the stand-in. Then the kernel called directly, out
    and dout laid out as q as the ring passes them, right too: PyTorch caches cuDNN's graph for a shape and q, k, v's
    strides at its first backward, whatever the strides of out and dout later (an H200: with a second layout,
    gradients off by 0.9 to 5 times their largest). And the op's own results as the stand-in returns them: 9, out in
    q's dtype [B, Hq, L, D] of contiguous strides, lse [B, Hq, L, 1] float32."""
    skip_unless_cudnn(dtype, D)
    forward, backward = ring.FUSED["cudnn"]
    g = torch.Generator().manual_seed(D)
    for L in (100, 2):
        bases = [torch.randn(2, L + 5, h, D, generator=g).to(dtype) for h in (4, 2, 2, 4)]  # q, k, v, dout

        def run(device):
            q, k, v, dout = (as_the_ring_passes(t.to(device), 3, L) for t in bases)
            out, lse = forward(q, k, v, True, D ** -0.5)
            ring_out = as_the_ring_passes(torch.zeros_like(bases[0], device=device), 3, L).copy_(out)
            ring_lse = lse.new_full((2, 4, L + 4), float("nan"))  # (B, Hq, more rows)
            ring_lse[:, :, 2:2 + L] = lse
            return [out, lse, *backward(dout, q, k, v, ring_out, ring_lse[:, :, 2:2 + L], True, D ** -0.5)]

        got = run("cuda")
        want = block_reference(*(as_the_ring_passes(t.cuda(), 3, L) for t in bases), True, D ** -0.5)
        q, k, v, dout = (as_the_ring_passes(t.cuda(), 3, L) for t in bases)  # then directly: out laid out as q
        aten, no_rng = torch.ops.aten, torch.zeros((), dtype=torch.int64, device="cuda")
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, scale=D ** -0.5)[:2]
        out = as_the_ring_passes(torch.zeros_like(bases[0], device="cuda"), 3, L).copy_(out)  # dout's strides
        direct = aten._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse, no_rng, no_rng, None, None,
                                                                   None, L, L, 0.0, True, scale=D ** -0.5)
        assert max(relative(mine, w) for mine, w in zip(direct, want[2:])) < tolerance(dtype), L
        with pytest.MonkeyPatch.context() as patch:
            on_cuda(patch.setattr, ring.cuda_gpu())
            stand_in = run("cpu")
        for name, mine, w, theirs in zip(("out", "lse", "dq", "dk", "dv"), got, want, stand_in):
            error = (mine.double() - w).abs().max().item() if name == "lse" else relative(mine, w)
            assert error < (1e-4 if name == "lse" else tolerance(dtype)), (L, name, error)
            assert relative(theirs, mine) < 2 * tolerance(dtype), (L, name)
        q, k, v = (as_the_ring_passes(t, 3, L).contiguous() for t in bases[:3])
        real = torch.ops.aten._scaled_dot_product_cudnn_attention(q.cuda(), k.cuda(), v.cuda(), None, True, 0.0, True,
                                                                  scale=D ** -0.5)
        mine = cuda_cudnn(q, k, v, None, True, 0.0, True, scale=D ** -0.5)
        assert len(real) == len(mine) == 9 and real[4:6] == mine[4:6] == (L, L)
        assert (real[0].shape, real[0].dtype, real[0].stride()) == (mine[0].shape, mine[0].dtype, mine[0].stride())
        assert (real[1].shape, real[1].dtype, real[1].is_contiguous()) == (mine[1].shape, torch.float32, True)


@cuda_only
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=str)
def test_the_cudnn_kernel_on_the_blocks_the_ring_gives_flash(dtype, D):
    """cuDNN's kernel on the blocks ring.py still gives PyTorch's flash kernel, called as its cuDNN pair calls it:
    blocks that see every key, square (100 by 100), half a block's queries against it (zigzag: 50 by 100) and a
    block's queries against half its keys (100 by 50). Inputs as the ring passes them, 4 query heads on 2 kv heads,
    forward and backward against float64 math; the stand-in refuses them. Where this passes, cuDNN may take them too:
    in ring._cuda_forward and ring._cuda_backward, `cudnn and k.shape[2] > 1` for `cudnn and causal` (a block that sees
    every key may have one), and in `cudnn_takes`, `query.shape[2] == key.shape[2]` only where is_causal."""
    skip_unless_cudnn(dtype, D)
    g, scale, aten = torch.Generator().manual_seed(D), D ** -0.5, torch.ops.aten
    no_rng = torch.zeros((), dtype=torch.int64, device="cuda")
    for Lq, Lk in ((100, 100), (50, 100), (100, 50)):
        q, k, v, dout = (as_the_ring_passes(torch.randn(2, L + 5, h, D, generator=g).to(dtype).cuda(), 3, L)
                         for L, h in ((Lq, 4), (Lk, 2), (Lk, 2), (Lq, 4)))
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, scale=scale)[:2]
        ring_lse = lse.new_full((2, 4, Lq + 4), float("nan"))
        ring_lse[:, :, 2:2 + Lq] = lse[..., 0]
        ring_out = as_the_ring_passes(torch.zeros(2, Lq + 5, 4, D, dtype=dtype, device="cuda"), 3, Lq).copy_(out)
        grads = aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, ring_out, ring_lse[:, :, 2:2 + Lq].unsqueeze(-1).contiguous(), no_rng, no_rng, None, None,
            None, Lq, Lk, 0.0, False, scale=scale)
        want = block_reference(q, k, v, dout, False, scale)
        assert relative(out, want[0]) < tolerance(dtype) and (lse[..., 0].double() - want[1]).abs().max() < 1e-4
        errors = [relative(got, w) for got, w in zip(grads, want[2:])]  # dq, dk, dv
        assert max(errors) < tolerance(dtype), (Lq, Lk, errors)
        assert refused(lambda: cuda_cudnn(q.cpu(), k.cpu(), v.cpu(), None, True, 0.0, False, scale=scale))


@cuda_only
def test_ring_attention_compiles_on_the_gpu():
    """ring_attention(group=None) under torch.compile with fullgraph on the GPU, bf16, head size 64: the ring's
    operators choose their block kernel inside, where the graph does not look, and the compiled call, forward and
    backward, matches the eager one."""
    q, k, v, grad_out = (t.cuda() for t in case_inputs(torch.bfloat16, 64, S=256))

    def run(attend):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attend(*inputs)
        out.backward(grad_out)
        return [out, *(t.grad for t in inputs)]

    compiled = torch.compile(ring.ring_attention, backend="aot_eager", fullgraph=True)
    assert_all_close(run(compiled), run(ring.ring_attention), tolerance(torch.bfloat16), tolerance(torch.bfloat16))
