"""
Tests of checkpoints against the run that never stopped: a checkpoint resumes on any layout with the same steps
and weights; a damaged one is set aside and the one before it taken; a save cut short is no checkpoint; checkpoints
that cannot be used are refused with their line; metrics lines cut short are dropped; a full disk, a signal, a slow
save, a rank that hangs while saving and a rank that is killed each end as they should.
"""

import argparse
import errno
import json
import os
import re
import shutil

import pytest
import torch
import torch.distributed as dist

import train
from conftest import (PARAGRAPHS, SHORT_RUN, assert_all_close, assert_same_training, exit_statuses, run_ranks,
                      torchrun_patched, train_rank)
from data import describe, read_documents
from harness import checkpoint, launch


RESUME_ARGS = ["--steps", "8", "--save-every", "4", "--n-layer", "2", "--n-embd", "32", "--seq-len", "32"]
DP2XSP2 = ["--sp", "2", "--batch-size", "4"]  # the layout that writes the checkpoint; global batch 8


def _resumed(layout, out_dir, start=None):
    """A run of RESUME_ARGS for train_rank: from the start, or resumed from the checkpoint `start`."""
    argv = layout + RESUME_ARGS + ["--out-dir", str(out_dir)]
    return (argv + ["--resume"], str(start)) if start else argv


def test_resume_on_any_layout(tmp_path):
    """8 steps on dp 2 x sp 2; its step-4 checkpoint resumed on the same layout (bit for bit), on sp 4, with
    --zero 0 and --zero fsdp2, and in one process: steps 5-8 equal the straight run, and so do the final
    weights. FSDP2 writes checkpoints too, and resumes from its own."""
    written = tmp_path / "dp2xsp2" / "step_000004"
    four = [_resumed(DP2XSP2, tmp_path / "dp2xsp2"),
            _resumed(DP2XSP2, tmp_path / "same", written),
            _resumed(["--sp", "4", "--batch-size", "8"], tmp_path / "sp4", written),
            _resumed(DP2XSP2 + ["--zero", "0"], tmp_path / "zero0", written),
            _resumed(DP2XSP2 + ["--zero", "fsdp2"], tmp_path / "fsdp2", written),
            _resumed(DP2XSP2 + ["--zero", "fsdp2"], tmp_path / "fsdp2_again", tmp_path / "fsdp2" / "step_000004")]
    (straight, _), (same, _), *others = run_ranks(4, train_rank, four)[0]
    [(one_process, printed)] = train_rank(0, 1, [_resumed(["--batch-size", "8"], tmp_path / "one", written)])
    assert f"resuming from {tmp_path / 'one' / 'step_000004'} after step 4 (written by 4 ranks with --zero 3): " \
           f"model and AdamW state carried over" in printed
    model = lambda name: checkpoint.weights(tmp_path / name / "step_000008")
    assert [r["loss"] for r in same] == [r["loss"] for r in straight[4:]]  # the same layout: bit for bit
    assert_all_close(model("same"), model("dp2xsp2"), rtol=0, atol=0)
    for name, history in zip(["sp4", "zero0", "fsdp2", "fsdp2_again", "one"],
                             [history for history, _ in others] + [one_process]):
        assert [r["step"] for r in history] == list(range(5, 9))
        assert_same_training(history, straight[4:], name)
        assert_all_close(model(name), model("dp2xsp2"), rtol=0, atol=1e-5, where=name)


def test_a_gpu_runs_checkpoint_resumes_without_its_gpu(tmp_path, one_rank, monkeypatch):
    """A GPU run's shards name the device each tensor was on (here every storage is written as on cuda:0, as a GPU
    run's are). Resuming on a machine without that GPU gives the steps of the run that never stopped."""
    out_dir = tmp_path / "run"
    with monkeypatch.context() as written_on_a_gpu:
        written_on_a_gpu.setattr(torch.serialization, "location_tag", lambda storage: "cuda:0")
        straight = train.main(SHORT_RUN + ["--out-dir", str(out_dir)])  # saves after steps 3 and 6
    final = checkpoint.weights(out_dir / "step_000006")
    shutil.rmtree(out_dir / "step_000006")
    resumed = train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])  # from step 3
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    assert_all_close(checkpoint.weights(out_dir / "step_000006"), final, rtol=0, atol=0)


def _flip(data, n=64):
    """data with n bytes in its middle inverted."""
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle:middle + n]) + data[middle + n:]


def _manifest(change):
    """A damage of manifest.json that is valid JSON: change(manifest) edits the parsed manifest in place."""
    def damage(data):
        manifest = json.loads(data)
        change(manifest)
        return json.dumps(manifest).encode()
    return damage


@pytest.mark.parametrize("name, damage, problem", [
    ("trainer.pt", lambda data: b"", r"trainer.pt has 0 bytes, not [\d,]+"),
    ("shard_00000-of-00001.pt", lambda data: data[:len(data) // 2],
     r"shard_00000-of-00001.pt has [\d,]+ bytes, not [\d,]+"),
    ("shard_00000-of-00001.pt", _flip, r"shard_00000-of-00001.pt does not match its SHA-256 \(changed on the disk\)"),
    ("manifest.json", lambda data: data.replace(b'"bytes"', b'"size"'), r"manifest.json is unreadable"),
    ("manifest.json", lambda data: re.sub(rb'"bytes": \d+', b'"bytes": Infinity', data),
     r"manifest.json is unreadable"),
    *[("manifest.json", _manifest(lambda m, file=file: m["files"].pop(file)), r"manifest.json does not list a whole "
       r"checkpoint: trainer.pt, and shard_R-of-N.pt for each R < N") for file in ("trainer.pt",
                                                                                    "shard_00000-of-00001.pt")],
    ("manifest.json", _manifest(lambda m: m.update(step=9)), r"manifest.json is of step 9, another than its folder's "
     r"name says"),
], ids=["empty", "truncated", "flipped", "manifest edited", "manifest infinite", "manifest without trainer.pt",
        "manifest without a shard", "manifest of another step"])
def test_a_damaged_checkpoint_falls_back_to_the_one_before(tmp_path, one_rank, capsys, name, damage, problem):
    """A checkpoint file emptied, cut short, or with 64 bytes flipped, or a manifest edited into valid JSON without
    the sizes, without a file of the checkpoint, or of another step than its folder's name (a folder renamed: the
    newest by its name would not be), fails verification: one line says so, the checkpoint is moved aside as it is
    (step_000006.damaged), the run resumes from the checkpoint before it, and its steps equal the run that never
    stopped."""
    out_dir = tmp_path / "run"
    straight = train.main(SHORT_RUN + ["--out-dir", str(out_dir)])
    part = out_dir / "step_000006" / name
    damaged = damage(part.read_bytes())
    part.write_bytes(damaged)
    capsys.readouterr()
    resumed = train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    printed = capsys.readouterr().out
    assert re.search(rf"^note: checkpoint \S+step_000006 fails verification \({problem}\); trying the one before "
                     rf"it$", printed, re.M), printed
    assert f"resuming from {out_dir / 'step_000003'} after step 3" in printed
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    assert (out_dir / "step_000006.damaged" / name).read_bytes() == damaged  # set aside, not deleted
    assert checkpoint.verify(out_dir / "step_000006", 0, 1) is None  # written anew in its place


def test_a_checkpoint_the_disk_cannot_read_falls_back_to_the_one_before(tmp_path, one_rank, capsys, monkeypatch):
    """A read error while verifying (here EIO, hashing step 6's shard) fails verification as damage does: one line,
    and the run resumes from the checkpoint before it."""
    out_dir = tmp_path / "run"
    straight = train.main(SHORT_RUN + ["--out-dir", str(out_dir)])
    hashed = checkpoint.sha256

    def disk_error(file):
        if os.path.dirname(file) == str(out_dir / "step_000006"):
            raise OSError(errno.EIO, "Input/output error", file)
        return hashed(file)
    monkeypatch.setattr(checkpoint, "sha256", disk_error)
    capsys.readouterr()
    resumed = train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    assert re.search(r"^note: checkpoint \S+step_000006 fails verification \(shard_00000-of-00001.pt is unreadable "
                     r"\(Input/output error\)\); trying the one before it$", capsys.readouterr().out, re.M)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]


def test_checkpoints_that_cannot_be_used_are_refused(tmp_path, one_rank, monkeypatch):
    out_dir = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"--resume: no complete checkpoint in --out-dir \S+ \(no such folder\)$"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--metrics", str(out_dir / "m.jsonl")])
    assert not out_dir.exists()  # not made for nothing, nor for --metrics inside it
    out_dir.mkdir()
    with pytest.raises(SystemExit, match=r"--resume: no complete checkpoint in --out-dir \S+$"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    train.main(SHORT_RUN + ["--out-dir", str(out_dir)])
    with pytest.raises(SystemExit, match=r"already holds checkpoints; add --resume to continue from step_000006"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir)])  # never overwritten by accident
    with pytest.raises(SystemExit, match=r"checkpoint \S+step_000006 holds another model \(--n-embd: 32 there, 64 "
                                         r"here; --intermediate-size: 128 there, 256 here\); resume with its flags, "
                                         r"or choose another --out-dir$"):  # no Gated DeltaNet flag: no d layer
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--n-embd", "64"])
    assert [r["step"] for r in train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--steps", "7",
                                                       "--new-schedule"])] == [7]
    with checkpoint.lock_out_dir(str(out_dir)):  # another live run
        with pytest.raises(SystemExit, match=r"--out-dir \S+ is in use by another run \(pid \d+ on \S+, lock \w+\); "
                                             r"wait for it to end, or choose another directory"):
            train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    with pytest.raises(SystemExit, match=r"checkpoint \S+step_000007 is past --steps 6: it has done 7 steps$"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--new-schedule"])
    # torchrun restarting a run (--max-restarts) resumes by itself, but only from its own checkpoints
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "another-run")
    with pytest.raises(SystemExit, match=r"holds checkpoints of another run \(None; this run is another-run\), which a "
                                         r"restarted run does not take; start again with --resume to continue from "
                                         r"step_000007"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--steps", "7"])
    # under a static rendezvous (torchrun --master-addr, no --rdzv-id) every run's id is "none", and a restart could
    # not tell its own checkpoints from another run's: refused before it starts
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    with pytest.raises(SystemExit, match=r"--out-dir with torchrun --max-restarts needs torchrun's --rdzv-id=NAME"):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--steps", "7"])
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS")
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


def test_a_stale_view_of_the_out_dir_is_refused(tmp_path, one_rank):
    """One --out-dir, but rank 1's view of it lags (a network file system's cached listing, say: the newest
    checkpoint not there yet): with --resume, the ranks would load other steps. One line, every rank stops."""
    model, out_dir = ["--n-embd", "32", "--seq-len", "32"], str(tmp_path / "run")
    train.main(model + ["--steps", "2", "--save-every", "1", "--out-dir", out_dir])
    stale = "listed = checkpoint.checkpoints\ncheckpoint.checkpoints = lambda *args, **kw: listed(*args, **kw)[1:]"
    status, output, _ = torchrun_patched(tmp_path, stale, model + ["--steps", "3", "--resume", "--out-dir", out_dir])
    assert status != 0 and output.count(f"train.py: error: the ranks see other checkpoints in --out-dir "
                                        f"{tmp_path / 'run'}: ['step_000002', 'step_000001'] on rank 0, "
                                        f"['step_000001'] on rank 1; start again once every node's view of it is up "
                                        f"to date") == 1, output[-3000:]


@pytest.mark.parametrize("changed, change, new_rate", [
    (["--steps", "12"], "--steps 6 -> 12", "0.000929"),  # the cosine stretched: progress 2/11
    (["--lr", "2e-3"], "--lr 0.001 -> 0.002", "0.00138"),
    (["--warmup", "2"], "--warmup 1 -> 2", "0.000868"),  # a step of warmup more: progress 1/4
], ids=["steps", "lr", "warmup"])
def test_a_changed_schedule_is_refused_on_resume(tmp_path, one_rank, changed, change, new_rate):
    """Resuming at step 3 of 6 (peak learning rate 1e-3, one step of warmup, then a cosine to a tenth of the peak)
    with another --steps, --lr or --warmup would move the learning rate of step 4, by hand 1e-3 * (0.1 + 0.45 *
    (1 + cos(pi * 2/5))) = 0.000689 in the checkpoint's schedule: refused in one line that says what it would
    become, unless --new-schedule accepts it."""
    out_dir = tmp_path / "run"
    train.main(SHORT_RUN + ["--out-dir", str(out_dir)])
    shutil.rmtree(out_dir / "step_000006")
    resume = SHORT_RUN + ["--out-dir", str(out_dir), "--resume"] + changed
    with pytest.raises(SystemExit, match=rf"^train.py: error: {re.escape(change)} against checkpoint \S+step_000003 "
                                         rf"would move the learning rate of step 4 from 0.000689 to {new_rate}; resume "
                                         rf"with the checkpoint's values, or add --new-schedule to accept it$"):
        train.main(resume)
    assert train.main(resume + ["--new-schedule"])[0]["step"] == 4


def test_a_resume_notes_another_weight_decay_clipping_or_dtype(tmp_path, one_rank, capsys):
    """--weight-decay, --grad-clip and --dtype shape every update after the checkpoint's: a resume with other values
    says so. A checkpoint that records less (an older train.py's) is held to what it records."""
    out_dir = tmp_path / "run"
    train.main(SHORT_RUN + ["--out-dir", str(out_dir)])
    was = {"weight_decay": 0.0, "grad_clip": 1.0, "dtype": "float32"}
    for changed in (["--weight-decay", "0.5"], ["--grad-clip", "0"], ["--dtype", "bfloat16"]):
        shutil.rmtree(out_dir / "step_000006")
        capsys.readouterr()
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"] + changed)
        run = was | {changed[0][2:].replace("-", "_"): changed[1] if changed[0] == "--dtype" else float(changed[1])}
        assert (f"note: the checkpoint was trained with {was}; this run has {run}, so its steps will not repeat the "
                f"original run's") in capsys.readouterr().out, changed
    shutil.rmtree(out_dir / "step_000006")
    step_3 = out_dir / "step_000003"
    trainer = torch.load(step_3 / "trainer.pt", weights_only=True)
    trainer["update"] = {"weight_decay": 0.0, "grad_clip": 1.0}  # as written before the dtype was recorded
    manifest = json.loads((step_3 / "manifest.json").read_text())
    manifest["files"].update(checkpoint.write_files(str(step_3), {"trainer.pt": trainer}))
    (step_3 / "manifest.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume", "--dtype", "bfloat16"])
    assert "note:" not in capsys.readouterr().out


def test_a_resume_notes_data_of_other_bytes(tmp_path, one_rank, capsys, text_file):
    """A checkpoint knows its --data by its bytes (SHA-256), not by its path: resuming on a copy of the file under
    another name says nothing, and resuming on the same path after its bytes changed notes that the steps will not
    repeat the original run's. A resumed run's opening counts what its own steps read (3 of 6)."""
    out_dir, copy = tmp_path / "run", tmp_path / "copy.txt"
    train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--data", str(text_file)])
    shutil.copy(text_file, copy)
    notes = []
    for data, text in ((copy, None), (text_file, PARAGRAPHS.replace("ab", "ba"))):
        if text:
            text_file.write_text(text)
        shutil.rmtree(out_dir / "step_000006")
        capsys.readouterr()
        train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--data", str(data), "--resume"])
        printed = capsys.readouterr().out
        notes.append(re.findall(r"^note: the checkpoint was trained with .*$", printed, re.M))
        steps_3_to_6 = 3 * launch.parse_args([]).batch_size  # sequences
        assert f"\ndata {data}: {describe(read_documents(data, False, 32), False, 32, steps_3_to_6)}\n" in printed
    assert notes[0] == [], notes
    assert len(notes[1]) == 1 and re.fullmatch(r"note: the checkpoint was trained with \{.*'data': 'SHA-256 "
                                               r"[0-9a-f]{16}'.*\}; this run has \{.*'data': 'SHA-256 [0-9a-f]{16}'"
                                               r".*\}, so its steps will not repeat the original run's", notes[1][0])


def test_packed_text_resumes_under_another_seed_without_a_note(tmp_path, one_rank, capsys, text_file):
    """Packed text is read in order whatever --seed (data.make_sample): a resume that changes only --seed says
    nothing, and its steps are the original run's. The copy task's samples are drawn by the seed: a note."""
    out_dir = tmp_path / "run"
    packed = SHORT_RUN + ["--out-dir", str(out_dir), "--data", str(text_file), "--pack"]
    straight = train.main(packed)
    shutil.rmtree(out_dir / "step_000006")
    capsys.readouterr()
    resumed = train.main(packed + ["--resume", "--seed", "5"])
    assert "note:" not in capsys.readouterr().out
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]
    copy_task = SHORT_RUN + ["--out-dir", str(tmp_path / "copy")]  # its samples are drawn by the seed: a note
    train.main(copy_task)
    shutil.rmtree(tmp_path / "copy" / "step_000006")
    capsys.readouterr()
    train.main(copy_task + ["--resume", "--seed", "5"])
    assert re.search(r"^note: the checkpoint was trained with \{'seed': 0, .*\}; this run has \{'seed': 5, ",
                     capsys.readouterr().out, re.M)


def test_metrics_lines_cut_short_are_dropped_on_resume(tmp_path, one_rank, capsys):
    """A blank line and a line cut short (a full disk, two runs on one file) in --metrics: a resume drops them,
    says how many, and writes every step's line again."""
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


class Stopped(BaseException):
    """The process ending where this is raised, as far as its files on the disk can tell."""


@pytest.mark.parametrize("stop_at", [1, 2, 3], ids=["files", "marker", "manifest"])
def test_a_save_cut_short_is_no_checkpoint(tmp_path, one_rank, monkeypatch, stop_at):
    """A run that stops while it saves its step-6 checkpoint, before it writes the checkpoint's files, its marker,
    or its manifest: no step_000006 appears, complete or not (the writing goes to step_000006.tmp, renamed when
    whole), so a resume takes step_000003, and its steps equal the run that never stopped."""
    straight = train.main(SHORT_RUN + ["--out-dir", str(tmp_path / "straight")])
    out_dir, written, write_files = tmp_path / "run", [], checkpoint.write_files

    def stopping(directory, files):
        if "step_000006" in str(directory):
            written.append(files)
            if len(written) == stop_at:
                raise Stopped
        return write_files(directory, files)
    monkeypatch.setattr(checkpoint, "write_files", stopping)
    with pytest.raises(Stopped):
        train.main(SHORT_RUN + ["--out-dir", str(out_dir)])
    monkeypatch.setattr(checkpoint, "write_files", write_files)
    assert [os.path.basename(p) for p in checkpoint.checkpoints(out_dir)] == ["step_000003"]
    assert checkpoint.checkpoints(out_dir, complete=False) == []
    resumed = train.main(SHORT_RUN + ["--out-dir", str(out_dir), "--resume"])
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight[3:]]


def test_a_signal_while_saving_leaves_the_checkpoint_before_it(tmp_path):
    """SIGTERM reaches rank 1 while it saves the step-4 checkpoint (its files written, its marker not): it ends at
    once with one line and exit status 143 (128 + SIGTERM), no traceback of ours, and torchrun stops rank 0 the
    same way. No step_000004 appears, complete or not; step_000002 is whole."""
    out_dir = tmp_path / "run"
    status, output, _ = torchrun_patched(tmp_path, "write_files = checkpoint.write_files\n"
                                                   "def write_and_be_stopped(path, files):\n"
                                                   "    written = write_files(path, files)\n"
                                                   "    if 'step_000004' in path:\n"
                                                   "        os.kill(os.getpid(), signal.SIGTERM)\n"
                                                   "    return written\n"
                                                   "checkpoint.write_files = write_and_be_stopped",
                                         ["--steps", "4", "--save-every", "2", "--n-embd", "32", "--seq-len", "32",
                                          "--out-dir", str(out_dir)])
    assert status != 0 and output.count("train.py: error: rank 1: stopped by SIGTERM") == 1, output[-3000:]
    assert exit_statuses(output) == {0: 143, 1: 143}, output[-3000:]
    assert 'train.py", line' not in output  # no traceback of ours
    assert [os.path.basename(p) for p in checkpoint.checkpoints(out_dir)] == ["step_000002"]
    assert checkpoint.checkpoints(out_dir, complete=False) == []
    assert (out_dir / "step_000004.tmp" / "shard_00001-of-00002.pt").exists()  # where the save was cut short
    assert all(checkpoint.verify(out_dir / "step_000002", rank, 2) is None for rank in range(2))


def test_a_full_disk_says_so(tmp_path, one_rank, monkeypatch):
    """torch.save on a full disk fails in its zip writer ("unexpected pos ..."); the line says the disk is full, and
    no checkpoint is left, complete or not."""
    def full_disk(*args):
        raise RuntimeError("unexpected pos 797312 vs 797204")
    monkeypatch.setattr(torch, "save", full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: argparse.Namespace(free=0))
    with pytest.raises(SystemExit, match=r"train.py: error: no space left on the device of \S+step_000003.tmp "
                                         r"\(0.0 MiB free\) for shard_00000-of-00001.pt; free some, or keep fewer "
                                         r"checkpoints \(--keep\)$"):
        train.main(SHORT_RUN + ["--out-dir", str(tmp_path / "run")])
    assert checkpoint.checkpoints(tmp_path / "run") == []
    assert checkpoint.checkpoints(tmp_path / "run", complete=False) == []


def test_a_checkpoint_folder_that_cannot_be_made_says_why(tmp_path, one_rank):
    """A save whose folder cannot be made (here a file holds its name; elsewhere a folder made read-only) says why in
    one line, not that the disk is full."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "step_000003.tmp").write_text("")
    with pytest.raises(SystemExit, match=r"^train.py: error: rank 0: cannot make the checkpoint's folder "
                                         r"\S+step_000003.tmp: File exists$"):
        train.main(SHORT_RUN + ["--out-dir", str(tmp_path / "run")])


def test_checkpoints_are_listed_by_the_names_found(tmp_path):
    """A checkpoint's folder renamed by hand (step_3) is listed by its own name, newest first by its step."""
    for name in ("step_02", "step_000010", "step_3"):
        (tmp_path / name).mkdir()
        (tmp_path / name / checkpoint.MANIFEST).write_text("{}")
    assert checkpoint.checkpoints(tmp_path) == [os.path.join(tmp_path, name) for name in ("step_000010", "step_3",
                                                                                          "step_02")]


@pytest.mark.limit(20)
def test_a_save_whose_folders_are_gone_ends_at_the_timeout(tmp_path):
    """A rank waiting for a checkpoint whose .tmp folder is gone and whose final folder never comes (taken away by
    hand) gives up after --timeout, as it does when a peer falls silent, rather than wait forever."""
    with pytest.raises(launch.Mistake, match=r"step_000003.tmp: ranks \[0, 1\] gave no sign of life for --timeout "
                                             r"0.5 s"):
        checkpoint.wait_for_markers(str(tmp_path / "step_000003.tmp"), str(tmp_path / "step_000003"), 2, 1, 0.5)


def test_a_save_slower_than_the_timeout_completes(tmp_path):
    """A rank that takes 6 s to write its checkpoint files, with --timeout 4: the others wait for it, as no
    collective deadline applies to the writing (its heartbeat shows it alive), and the run completes."""
    status, output, _ = torchrun_patched(tmp_path, "write_files = checkpoint.write_files\n"
                                                   "checkpoint.write_files = lambda path, files: time.sleep(6 * any("
                                                   "name.startswith('shard') for name in files)) or write_files(path, "
                                                   "files)",
                                         ["--steps", "2", "--n-embd", "32", "--seq-len", "32", "--timeout", "4",
                                          "--out-dir", str(tmp_path / "run")])
    assert status == 0, output[-3000:]
    assert [os.path.basename(p) for p in checkpoint.checkpoints(tmp_path / "run")] == ["step_000002"]


def test_a_rank_that_hangs_while_saving_ends_the_run(tmp_path):
    """A rank stuck in its writing, its heartbeat stopped too: the rank waiting for it names it after --timeout
    seconds and exits 1, rather than waiting for ever; torchrun then stops the stuck one (128 + SIGTERM)."""
    status, output, seconds = torchrun_patched(tmp_path, "import contextlib\n"
                                                "checkpoint.heartbeat = lambda path, every: contextlib.nullcontext()\n"
                                                "checkpoint.write_files = lambda path, files: time.sleep(1000)",
                                                ["--steps", "2", "--n-embd", "32", "--seq-len", "32", "--timeout", "4",
                                                 "--out-dir", str(tmp_path / "run")])
    assert status != 0 and seconds < 60, output[-3000:]
    assert output.count("train.py: error: rank 0: checkpoint ") == 1, output[-3000:]
    assert re.search(r"step_000002.tmp: ranks \[1\] gave no sign of life for --timeout 4 s", output)
    assert exit_statuses(output) == {0: 1, 1: 143}, output[-3000:]


def test_a_killed_rank_restarts_from_the_newest_checkpoint(tmp_path):
    """torchrun --max-restarts=1, rank 1 killed (SIGKILL) in step 25 of 30, after the checkpoints of steps 10 and
    20: the group restarts, resumes from step_000020 by itself, and finishes. Its metrics, steps 1-30 once each,
    equal those of a run that was never killed."""
    argv = ["--steps", "30", "--seq-len", "32", "--n-embd", "32", "--save-every", "10"]
    status, output, _ = torchrun_patched(tmp_path, "train_step = train.train_step\n"
                                                   "def killed_in_step_25(step, *args):\n"
                                                   "    if step == 24 and os.environ['TORCHELASTIC_RESTART_COUNT'] == "
                                                   "'0':\n"
                                                   "        os.kill(os.getpid(), signal.SIGKILL)\n"
                                                   "    return train_step(step, *args)\n"
                                                   "train.train_step = killed_in_step_25",
                                         argv + ["--out-dir", str(tmp_path / "run"), "--metrics", str(tmp_path / "m")],
                                         launcher=["--max-restarts=1"])
    assert status == 0, output[-3000:]
    assert f"resuming from {tmp_path / 'run' / 'step_000020'} after step 20" in output, output[-3000:]
    killed = [json.loads(line) for line in (tmp_path / "m").read_text().splitlines()]
    [(unbroken, _)] = run_ranks(2, train_rank, [argv + ["--out-dir", str(tmp_path / "unbroken")]])[0]
    assert [r["step"] for r in killed] == list(range(1, 31))
    assert_same_training(killed, unbroken, "killed and restarted")
