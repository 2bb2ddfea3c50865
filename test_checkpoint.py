"""
Tests of checkpoints against the run that never stopped: a checkpoint resumes on any layout with the same steps
and weights; a damaged one falls back to the one before; checkpoints that cannot be used are refused with their
line; metrics lines cut short are dropped; a full disk, a slow save, a rank that hangs while saving and a rank
that is killed each end as they should.
"""

import argparse
import json
import os
import re
import shutil
import signal

import pytest
import torch
import torch.distributed as dist

import checkpoint
import train
from conftest import (SHORT_RUN, assert_all_close, assert_same_training, run_ranks, start_long_run,
                      torchrun_patched)


RESUME_ARGS = ["--steps", "40", "--save-every", "20", "--n-layer", "2", "--n-embd", "32", "--seq-len", "32"]
DP2XSP2 = ["--sp", "2", "--batch-size", "4"]  # the layout that writes the checkpoint; global batch 8


def _resume_rank(rank, world_size, runs):
    """Each run: (argv, out_dir, checkpoint to start from or None). Returns each run's metrics."""
    results = []
    for argv, out_dir, start in runs:
        if start and rank == 0:
            shutil.copytree(start, os.path.join(out_dir, os.path.basename(start)))
        if dist.is_initialized():
            dist.barrier()
        results.append(train.main(argv + RESUME_ARGS + ["--out-dir", out_dir] + (["--resume"] if start else [])))
    return results


def test_resume_on_any_layout(tmp_path, capsys):
    """40 steps on dp 2 x sp 2; its step-20 checkpoint resumed on the same layout (bit for bit), on sp 4, with
    --zero 0 and --zero fsdp2, and in one process: steps 21-40 equal the straight run, and so do the final
    weights. FSDP2 writes checkpoints too, and resumes from its own."""
    written = str(tmp_path / "dp2xsp2" / "step_000020")
    four = [(DP2XSP2, str(tmp_path / "dp2xsp2"), None),
            (DP2XSP2, str(tmp_path / "same"), written),
            (["--sp", "4", "--batch-size", "8"], str(tmp_path / "sp4"), written),
            (DP2XSP2 + ["--zero", "0"], str(tmp_path / "zero0"), written),
            (DP2XSP2 + ["--zero", "fsdp2"], str(tmp_path / "fsdp2"), written),
            (DP2XSP2 + ["--zero", "fsdp2"], str(tmp_path / "fsdp2_again"), str(tmp_path / "fsdp2" / "step_000020"))]
    straight, same, *others = run_ranks(4, _resume_rank, four)[0]
    one_process = _resume_rank(0, 1, [(["--batch-size", "8"], str(tmp_path / "one"), written)])[0]
    assert "model and AdamW state carried over" in capsys.readouterr().out
    model = lambda name: checkpoint.weights(tmp_path / name / "step_000040")
    assert [r["loss"] for r in same] == [r["loss"] for r in straight[20:]]  # the same layout: bit for bit
    assert_all_close(model("same"), model("dp2xsp2"), rtol=0, atol=0)
    for name, history in zip(["sp4", "zero0", "fsdp2", "fsdp2_again", "one"], others + [one_process]):
        assert [r["step"] for r in history] == list(range(21, 41))
        assert_same_training(history, straight[20:], name)
        assert_all_close(model(name), model("dp2xsp2"), rtol=0, atol=1e-5, where=name)


def _flip(data, n=64):
    """data with n bytes in its middle inverted."""
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + n]) + data[middle + n:]


@pytest.mark.parametrize("name, damage, problem", [
    ("trainer.pt", lambda data: b"", r"trainer.pt has 0 bytes, not [\d,]+"),
    ("shard_00000-of-00001.pt", lambda data: data[:len(data) // 2],
     r"shard_00000-of-00001.pt has [\d,]+ bytes, not [\d,]+"),
    ("shard_00000-of-00001.pt", _flip, r"shard_00000-of-00001.pt does not match its SHA-256 \(changed on the disk\)"),
], ids=["empty", "truncated", "flipped"])
def test_a_damaged_checkpoint_falls_back_to_the_one_before(tmp_path, monkeypatch, capsys, name, damage, problem):
    """A checkpoint file emptied, cut short, or with 64 bytes flipped fails verification against the manifest: one
    line says so, the run resumes from the checkpoint before it, and its steps equal the run that never stopped."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    out_dir = tmp_path / "run"
    straight = train.main(SHORT_RUN + ["--out-dir", str(out_dir)])
    part = out_dir / "step_000006" / name
    part.write_bytes(damage(part.read_bytes()))
    capsys.readouterr()
    resumed = train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    printed = capsys.readouterr().out
    assert re.search(rf"^note: checkpoint \S+step_000006 fails verification \({problem}\); trying the one before "
                     rf"it$", printed, re.M), printed
    assert f"resuming from {out_dir / 'step_000003'} after step 3" in printed
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    assert checkpoint.verify(out_dir / "step_000006", 0, 1) is None  # written anew over the damaged one


def test_checkpoints_that_cannot_be_used_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    out_dir = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"--resume: no complete checkpoint in --out-dir"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    train.main(SHORT_RUN + ["--out-dir", str(out_dir)])
    with pytest.raises(SystemExit, match=r"already holds checkpoints; add --resume to continue from step_000006"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir)])  # never overwritten by accident
    with pytest.raises(SystemExit, match=r"holds a model with .*'n_embd': 32.*the flags ask for .*'n_embd': 64"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--n-embd", "64"])
    # a longer run would move the learning rate of step 7 (the cosine restretched): refused unless asked for
    with pytest.raises(SystemExit, match=r"--steps 6 -> 12 against checkpoint \S+step_000006 would move the learning "
                                         r"rate of step 7 from 0.0001 to 0.000[\d]+; resume with the checkpoint's "
                                         r"values, or add --new-schedule to accept it$"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--steps", "12"])
    assert [r["step"] for r in train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--steps", "7",
                                                       "--new-schedule"])] == [7]
    with checkpoint.lock_out_dir(str(out_dir)):  # another live run
        with pytest.raises(SystemExit, match=r"--out-dir \S+ is in use by another run \(pid \d+ on \S+\); wait for it "
                                             r"to end, or choose another directory"):
            train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    with pytest.raises(SystemExit, match=r"checkpoint \S+step_000007 is past --steps 6: it has done 7 steps$"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--new-schedule"])
    # torchrun restarting a run (--max-restarts) resumes by itself, but only from its own checkpoints
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-run")
    with pytest.raises(SystemExit, match=r"already holds checkpoints of another run; add --resume to continue from "
                                         r"step_000007"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--steps", "7"])
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    (out_dir / "step_000009").mkdir()  # a copy cut short, or a checkpoint of an older train.py
    with pytest.raises(SystemExit, match=r"holds step_000009 without a manifest.json \(from an older train.py, or a "
                                         r"copy cut short\); move it out of the directory$"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    (out_dir / "step_000009").rmdir()
    for path in checkpoint.checkpoints(out_dir):
        (out_dir / path / "trainer.pt").write_bytes(b"")
    with pytest.raises(SystemExit, match=r"no checkpoint in --out-dir \S+ passes verification"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    kept = tmp_path / "kept"  # --keep 2: the newest two of the six
    train.main(SHORT_RUN[:2] + ["--save-every", "1", "--keep", "2"] + SHORT_RUN[4:] + ["--out-dir", str(kept)])
    assert sorted(os.listdir(kept)) == [".lock", "step_000005", "step_000006"]


def test_metrics_lines_cut_short_are_dropped_on_resume(tmp_path, monkeypatch, capsys):
    """A blank line and a line cut short (a full disk, two runs on one file) in --metrics: a resume drops them,
    says how many, and writes every step's line again."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    out_dir, metrics = tmp_path / "run", tmp_path / "logs" / "metrics.jsonl"  # its folder made by the run
    argv = SHORT_RUN + ["--out-dir", str(out_dir), "--metrics", str(metrics)]
    train.main(argv)
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:2] + ["", lines[2][:20]] + lines[3:]) + "\n")
    shutil.rmtree(out_dir / "step_000006")
    capsys.readouterr()
    train.main(argv + ["--resume"])
    assert f"note: --metrics {metrics}: dropped 2 line(s) that were not whole records" in capsys.readouterr().out
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 4, 5, 6]


@pytest.mark.parametrize("path, reason", [("/dev/full", "No space left on device"),
                                          ("/proc/version", "Input/output error")], ids=["full", "read-only"])
def test_a_metrics_file_that_takes_no_writes_is_one_line(path, reason):
    """--metrics on a full disk, or on a file that takes no writes: one line naming the file and the reason."""
    with pytest.raises(SystemExit, match=rf"^train.py: error: rank 0: --metrics {path}: cannot write it "
                                         rf"\({reason}\)$"):
        train.main(SHORT_RUN[:2] + SHORT_RUN[4:] + ["--metrics", path])
    assert not dist.is_initialized()


def test_a_signal_leaves_no_checkpoint_that_looks_complete(tmp_path):
    """SIGTERM to one rank while the run saves every 10 steps: that rank says so in one line, the run fails, and
    every checkpoint left without .tmp is complete and verifies."""
    launcher, out_dir, workers = start_long_run(tmp_path, [])
    os.kill(workers[1], signal.SIGTERM)
    output, _ = launcher.communicate(timeout=60)
    assert launcher.returncode != 0 and output.count("train.py: error: rank 1: stopped by SIGTERM") == 1, output[-3000:]
    assert 'train.py", line' not in output  # no traceback of ours
    assert checkpoint.checkpoints(out_dir, complete=False) == []
    assert all(checkpoint.verify(path, 0, 1) is None for path in checkpoint.checkpoints(out_dir))


def test_a_full_disk_says_so(tmp_path, monkeypatch):
    """torch.save on a full disk fails in its zip writer ("unexpected pos ..."); the line says the disk is full."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    def full_disk(*args):
        raise RuntimeError("unexpected pos 797312 vs 797204")
    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: argparse.Namespace(free=0))
    with pytest.raises(SystemExit, match=r"train.py: error: no space left on the device of \S+step_000003.tmp "
                                         r"\(0.0 MiB free\) for shard_00000-of-00001.pt; free some, or keep fewer "
                                         r"checkpoints \(--keep\)$"):
        train.main(SHORT_RUN + ["--out-dir", str(tmp_path / "run")])
    assert checkpoint.checkpoints(tmp_path / "run") == []


def test_a_save_slower_than_the_timeout_completes(tmp_path):
    """A rank that takes 9 s to write its checkpoint files, with --timeout 4: the others wait for it, as no
    collective deadline applies to the writing, and the run completes."""
    status, output, _ = torchrun_patched(tmp_path, "write_files = checkpoint.write_files\n"
                                          "checkpoint.write_files = lambda path, files: time.sleep(9 * any(name.startswith("
                                          "'shard') for name in files)) or write_files(path, files)",
                                          ["--steps", "2", "--n-embd", "32", "--seq-len", "32", "--timeout", "4",
                                           "--out-dir", str(tmp_path / "run")])
    assert status == 0, output[-3000:]
    assert [os.path.basename(p) for p in checkpoint.checkpoints(tmp_path / "run")] == ["step_000002"]


def test_a_rank_that_hangs_while_saving_ends_the_run(tmp_path):
    """A rank stuck in its writing, its heartbeat stopped too: the rank waiting for it names it after --timeout
    seconds and the run fails, rather than waiting for ever."""
    status, output, seconds = torchrun_patched(tmp_path, "import contextlib\n"
                                                "checkpoint.heartbeat = lambda path, every: contextlib.nullcontext()\n"
                                                "checkpoint.write_files = lambda path, files: time.sleep(1000)",
                                                ["--steps", "2", "--n-embd", "32", "--seq-len", "32", "--timeout", "4",
                                                 "--out-dir", str(tmp_path / "run")])
    assert status != 0 and seconds < 60, output[-3000:]
    assert output.count("train.py: error: rank 0: checkpoint ") == 1, output[-3000:]
    assert re.search(r"step_000002.tmp: ranks \[1\] gave no sign of life for --timeout 4 s", output)


def test_killed_rank_restarts_from_the_last_checkpoint(tmp_path):
    """torchrun --max-restarts=1: kill one rank mid-run; the group restarts, resumes and finishes."""
    launcher, out_dir, workers = start_long_run(tmp_path, ["--max-restarts=1"])
    os.kill(workers[1], signal.SIGKILL)
    output, _ = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, output[-3000:]
    assert "resuming from" in output and (out_dir / "step_000300").exists()
