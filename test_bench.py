"""
Tests of the benchmarks' baselines against one device: what `python -m harness.bench attention` times against
ulysses_attention computes the same attention and sends the bytes of its formula; the copies it counts. What
`python -m harness.bench balance` reports: per-document balance of a packed mix against zigzag's. The arguments
each benchmark refuses, in one line.
"""

import argparse
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import documents
from conftest import assert_all_close, attention_and_grads, qkv, run_ranks, sp_slice, whole_sequence
from harness import bench
from harness.bench import CopiedBytes


BASELINE = dict(S=24, Hq=8, Hkv=4, D=8)  # (c) needs P to divide both head counts; P = 4: one kv head a rank


def _baselines_rank(rank, world_size):
    results = []
    for B in (1, 2):  # B = 1: (c) copies once per all-to-all; B = 2: twice
        for baseline in (bench.three_all_to_alls, bench.gathered_kv):
            q, k, v, grad_out = (sp_slice(t, rank, world_size) for t in qkv(B, *BASELINE.values()))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            bench.sent_stats["bytes"] = 0
            with CopiedBytes() as copied:  # as the bench takes gradients: .backward() copies strided ones into .grad
                out = baseline(q, k, v, dist.group.WORLD)
                grads = torch.autograd.grad(out, (q, k, v), grad_out)
            sent = bench.sent_stats["bytes"]
            results.append(((out.detach(), *grads), sent, copied.bytes))
    return results


@pytest.mark.parametrize("world_size", [2, 4])
def test_benchmark_baselines_match_one_device(world_size):
    """What python -m harness.bench attention times against ulysses_attention computes the same attention: (c) q, k
    and v in three all-to-alls with DeepSpeed's copies and (d) all-gathered k and v, output and dq, dk, dv against
    one device, B = 1 and 2, each sending the bytes of its formula and copying the bytes DeepSpeed copies, at P = 4
    with one kv head a rank too."""
    per_rank = run_ranks(world_size, _baselines_rank)
    P, (S, Hq, Hkv, D) = world_size, BASELINE.values()
    for i, (B, name) in enumerate((B, name) for B in (1, 2) for name in ("(c)", "(d)")):
        got = [whole_sequence(parts) for parts in zip(*(r[i][0] for r in per_rank))]
        assert_all_close(got, attention_and_grads(*qkv(B, S, Hq, Hkv, D)), where=f"{name} B={B}")
        head = B * S // P * D * 4  # bytes of one head of a rank's tokens, float32
        formula = {"(c)": 2 * (Hq + 2 * Hkv + Hq) * head * (P - 1) // P,  # (P-1)/P of q, k, v and out, both ways
                   "(d)": 4 * Hkv * head * (P - 1)}[name]  # k and v to every other rank, their gradients back
        assert [r[i][1] for r in per_rank] == [formula] * P, f"{name} B={B}"
        # (c), as DeepSpeed: each of q, k, v and out, and of their gradients, copied into the send buffer, and the
        # pieces received joined by one more copy, even of one head; at B = 1 one of the two is free, the pieces of
        # the sequence lying in order already. (d): with B = 1 the gathered tokens land in order
        # (gloo's own copies are not counted); with B = 2 each row's tokens are put in order, of k, v and their
        # gradients
        copies = {"(c)": (1 + (B > 1)) * 2 * (2 * Hq + 2 * Hkv) * head, "(d)": (B - 1) * 4 * Hkv * head * P}[name]
        assert [r[i][2] for r in per_rank] == [copies] * P, f"{name} B={B}"


def _versus_rank(rank, world_size, path):
    args = argparse.Namespace(kernel="sdpa", versus=path, batch_size=1, heads=4, kv_heads=4, head_dim=8,
                              dtype="float32")
    variants, tensors = bench._variants(dist.group.WORLD, args), bench._attention_inputs(rank, world_size, 64, args)
    return [(bench._forward_backward(variants[name], tensors), bench._moved(variants[name], tensors))
            for name in ("(b) ulysses_attention", bench.VERSUS)]


def test_versus_times_another_copy_of_ulysses_beside_this_one(tmp_path):
    """python -m harness.bench attention --versus FILE loads another copy of ulysses.py beside this one in each rank,
    its operators renamed (torch would let the copy's replace this one's). Given this file with its byte count
    doubled, its variant computes the same output and gradients, bit for bit, copies the same bytes, and counts
    twice the bytes sent; this one's count stays its own."""
    path, count = tmp_path / "ulysses.py", 'bytes=counts["bytes"] + sent_bytes)'
    source = open(bench.ulysses.__file__).read()
    assert source.count(count) == 1
    path.write_text(source.replace(count, 'bytes=counts["bytes"] + 2 * sent_bytes)'))
    for (this, these_bytes), (other, other_bytes) in run_ranks(2, _versus_rank, str(path)):
        assert all(torch.equal(a, b) for a, b in zip(this, other))
        P, S, H, D = 2, 64, 4, 8  # q, k, v and out: (P-1)/P of a rank's S/P tokens each way, float32
        assert these_bytes[:2] == (4 * S // P * H * D * 4 * (P - 1) // P,) * 2, these_bytes
        assert other_bytes == (2 * these_bytes[0], 2 * these_bytes[1], *these_bytes[2:]), (these_bytes, other_bytes)


def test_copied_bytes_counts_copies_and_nothing_else():
    """bench.CopiedBytes, behind BENCHMARKS' copies per variant: a view, arithmetic and a matmul into a slice of a
    buffer copy nothing; contiguous() of a transposed tensor, a cast, a join, the backward of a slice, a copy into a
    buffer, a gather by index, a stack and a pad each copy the bytes they write."""
    x = torch.randn(8, 4, requires_grad=True)  # 128 bytes
    buffer = torch.empty(8, 12)
    with CopiedBytes() as nothing:
        y = x.view(2, 16).t() * 2 + 1  # views, then arithmetic
        torch.mm(x.detach(), x.detach().t()[:, :4], out=buffer[:, 4:8])  # a matmul into a slice
    with CopiedBytes() as copies:
        x.t().contiguous()  # 128
        x.double()  # 256
        torch.cat([x, x])  # 256
        torch.autograd.grad(x[:2].sum(), x)  # the slice's backward writes all of x: 128
        buffer[:, :4].copy_(x)  # 128
        x[torch.tensor([1, 3, 5])]  # 48
        torch.stack([x, x])  # 256
        F.pad(x, (0, 1))  # 8 x 5: 160
    assert (nothing.bytes, y.shape) == (0, (16, 2))
    assert copies.bytes == 128 + 256 + 256 + 128 + 128 + 48 + 256 + 160


def test_document_layout_balances_a_long_document():
    """python -m harness.bench balance's row: one document holds 60% of the 4,096 tokens and the rest are short. The
    per-document layout gives each ring rank S/R tokens, rising, every token once, and causal work (query-key pairs)
    within 1.05x of the mean at R = 2 and 4, where zigzag's busiest rank does 1.68x (it holds the long document's
    middle); a row that does not split over R is refused. A layout that cut the row zigzag's way, blind to where
    documents start, fails here."""
    positions = bench.long_document_mix(4096)  # (1, S)
    for R in (2, 4):
        layouts = bench.balance_layouts(positions, R)  # (1, R, S/R) each
        balanced, zigzag = (documents.document_work(positions, layouts[name]) for name in ("documents", "zigzag"))
        assert layouts["documents"].shape == (1, R, 4096 // R) and (layouts["documents"].diff(dim=-1) > 0).all()
        assert sorted(layouts["documents"].flatten().tolist()) == list(range(4096))
        assert sum(balanced) == sum(zigzag)
        assert max(balanced) / (sum(balanced) / R) <= 1.05, (R, balanced)
        assert max(zigzag) / (sum(zigzag) / R) > 1.6, (R, zigzag)
    with pytest.raises(ValueError, match=r"^document_layout: 4095 tokens per row do not split over a ring of 2; pad "):
        documents.document_layout(positions[:, 1:], 2)  # no room for the last token: it looped forever


def test_document_layout_balances_short_documents():
    """A row of short documents only (20 to 119 tokens, none long enough to be cut): dealt whole, each to the ring
    rank with the least work so far, they even out within 1.01x of the mean at R = 2 and 4."""
    g, lengths = torch.Generator().manual_seed(0), []
    while sum(lengths) < 4096:
        lengths.append(int(torch.randint(20, 120, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - 4096
    positions = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, 4096)
    for R in (2, 4):
        work = documents.document_work(positions, documents.document_layout(positions, R))
        assert max(work) / (sum(work) / R) <= 1.01, (R, work)


BAD_ARGUMENTS = {  # python -m harness.bench ARGV: the one line of its refusal
    "ring --ranks 0": "argument --ranks: 0: must be at least 1",
    "balance --reps -1": "argument --reps: -1: must be at least 1",
    "balance --share 1.0": "--share 1.0: must be above 0 and below 1 (short documents fill the rest)",
    "compile --steps 1": "argument --steps: 1: must be at least 2",
    "attention --heads 0": "argument --heads: 0: must be at least 1",
    "attention --seq-len 4098": "--seq-len 4098: must be a multiple of every P in --sp, 4 too (a rank holds S/P "
                                "tokens)",
    "attention --heads 6 --sp 2": "--heads 6 and --kv-heads 6: the weak-scaling rows run on 2 and 4 ranks, so 4 "
                                  "must divide both; or --weak-seq-len 0 for none",
    "deltanet --seq-lens 1026": "--seq-lens 1026: each must be a multiple of 4 (the layer runs on P = 2 and 4)",
    "deltanet --heads 3": "--heads 3: choose an even count of 4 or more (H/2 key heads, each for 2 value heads, over "
                          "up to 4 ranks)",
    "plans --figure /no/such/plans.png": "--figure /no/such/plans.png: there is no folder /no/such to write it into",
    "balance --picture /no/such/work.png": "--picture /no/such/work.png: there is no folder /no/such to write it into",
    **{f"attention --check-cost {flag}": "--check-cost measures the input check alone: it draws no --plot and times "
                                         "no --versus" for flag in ("--plot cost.png", "--versus ulysses.py")},
    "attention --versus /no/such.py": "--versus /no/such.py: No such file or directory",
    "attention --versus /dev/null": "--versus /dev/null: defines no ulysses_attention; give another copy of ulysses.py",
    f"attention --versus {sys.executable}": f"--versus {sys.executable}: defines no ulysses_attention; give another "
                                            f"copy of ulysses.py"}


@pytest.fixture
def measured(monkeypatch):
    """The args each benchmark of bench.main is handed, instead of its measurement."""
    handed = []
    for name in ("attention", "tiled", "deltanet", "memory_", "plans", "compile_", "ring_", "balance", "gpu"):
        monkeypatch.setattr(bench, name, handed.append)
    return handed


@pytest.mark.parametrize("argv, error", BAD_ARGUMENTS.items(), ids=list(BAD_ARGUMENTS))
def test_bad_arguments_are_refused_in_one_line(capsys, measured, argv, error):
    """A count below its least, a sequence that does not split over the ranks, heads a layer cannot take: refused
    before anything runs, exit 2, one line naming the value (not a traceback, nor a table of zeros)."""
    with pytest.raises(SystemExit, match="^2$"):
        bench.main(argv.split())
    assert capsys.readouterr().err.splitlines()[-1].split(" error: ", 1)[1] == error
    assert not measured


def test_compile_runs_its_own_steps_whatever_the_flags(monkeypatch, capsys):
    """compile's --steps comes after the train.py flags it passes on, so a --steps among them cannot cut the runs to
    one step (whose later steps, none, have no median)."""
    runs = []
    monkeypatch.setattr(bench, "train_run", lambda P, argv: runs.append(argv) or [{"seconds": 1.0}] * 3)
    bench.main("compile --sp 1 --steps 3 --runs 1 --flags --n-embd 16 --steps 1".split())
    assert [[argv[i + 1] for i, flag in enumerate(argv) if flag == "--steps"][-1] for argv in runs] == ["3", "3"]


def test_memory_measures_what_measuring_costs_only_at_the_depths_given(monkeypatch, capsys):
    """memory's second table, what measuring costs, has a row per --depths value; --depths with none prints none of
    it (neither its heading nor an empty table)."""
    monkeypatch.setattr(bench, "train_run", lambda P, argv: [{"peak_bytes": 2**20, "seconds": 1.0}] * 6)
    for depths, lines in (("--depths 2 3", 6 + 5), ("--depths", 6)):  # 5: a blank line, 2 headings, 2 rows
        bench.main(f"memory --sp 1 --seq-lens 64 {depths}".split())
        printed = capsys.readouterr().out
        assert len(printed.splitlines()) == lines and ("what measuring costs" in printed) == (lines > 6), printed


def test_the_weak_scaling_sizes_bind_only_with_weak_scaling(measured):
    """attention's weak-scaling rows run on 2 and 4 ranks; without them (--weak-seq-len 0) 6 heads on --sp 2 run."""
    bench.main("attention --heads 6 --sp 2 --weak-seq-len 0".split())
    assert [(args.heads, args.kv_heads, args.sp) for args in measured] == [(6, 6, [2])]


def test_the_deltanet_layer_takes_the_heads_its_check_accepts():
    """python -m harness.bench deltanet --heads 6, which its check accepts: the layer under SP (3 key heads, 6 value
    heads) runs both ways on 4 ranks, each sending bytes; attention's head settings, unused by it, stand aside."""
    args = argparse.Namespace(heads=6, head_dim=4, seq_lens=[16], reps=1)
    for results in run_ranks(4, bench._deltanet_ways_rank, args):
        assert sorted(results) == [("context", 16), ("ulysses", 16)]
        assert all(sent > 0 for _, sent, _ in results.values()), results
