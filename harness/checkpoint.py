"""
A sharded checkpoint that every rank writes in parallel, that is verified before it is trusted, and that resumes
on any layout: another world size, sp, ring or sharding.

The idea: whatever the sharding, what a rank holds of a parameter is one run of its flattened elements. ZeRO-3's
flat shard cuts each parameter it overlaps into one run, FSDP2's rows are one run, an unsharded rank holds all
of it. So a checkpoint is a set of pieces, (parameter name, first element, values), and loading is copying the
overlap of every stored piece with every piece this rank holds:

    written by 2 ranks     w: [0 1 2 3 4 5 | 6 7 8 9 10 11]      rank 0 wrote 0..5, rank 1 wrote 6..11
    read by 3 ranks        w: [0 1 2 3 | 4 5 6 7 | 8 9 10 11]    rank 1 copies 4..5 from shard 0, 6..7 from shard 1

DIR/step_000020/ holds
    shard_00001-of-00004.pt   what rank 1 of 4 held: by parameter name, a run of its float32 values and of its
                              AdamW moments (`held`)
    trainer.pt                the step (which fixes the learning rate and the data position), the flags, the RNG
    manifest.json             every file's size and SHA-256, written last

Saving (`save`): every rank writes its files at once into step_000020.tmp, each flushed to the disk (fsync),
then a small marker naming them. The ranks wait for the markers on the file system, not in a collective, so the
writing has no --timeout deadline; a heartbeat file shows a rank alive however slow its disk. Rank 0 then writes
the manifest and renames the directory: a directory without .tmp is whole.

Resuming (`find`, `restore`): the ranks share the checking of every file against the manifest, which must list a
whole checkpoint of the step its folder names. A checkpoint that fails it is named in one line and moved aside
(.damaged), and the one before it is tried. An flock on the out-dir keeps a second live run out (`out_dir`,
`lock_out_dir`).
"""

import argparse
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import socket
import time
from contextlib import contextmanager, suppress
from functools import partial

import torch
from tqdm import tqdm

from harness.launch import Mistake, agreed, fail, gathered, model_flags, repeating, stop_on

MANIFEST = "manifest.json"


# ----------------------------------------------------------------------------------------------------------------
# the pieces: what a rank holds, and how any layout reads them back


def held(model, optimizer, zero=None):
    """This rank's part of every parameter and of its optimizer state: {name: (shape, start, {"param": values,
    and each optimizer state tensor of the parameter's shape (AdamW's moments): values})}, each a 1-D float32 view
    of this rank's own storage holding the parameter's flattened elements [start, start + len). Copying into the
    views loads them. Parameters this rank holds none of are left out. zero: a zero3.ZeRO3 (FSDP2 and unsharded
    models need none)."""
    pieces = {}
    if zero:
        for unit in zero.units:
            lo = unit.rank * unit.shard.numel()  # this rank's shard is elements [lo, lo + shard size) of the unit
            state = optimizer.state[unit.shard]
            tensors = {"param": unit.shard.detach(),
                       **{key: t for key, t in state.items() if t.shape == unit.shard.shape}}
            offset = 0  # where the parameter starts in the unit's flat vector
            for slot, n in zip(unit.slots, unit.sizes):
                first, last = max(lo, offset), min(lo + unit.shard.numel(), offset + n)
                if first < last:
                    pieces[slot.name] = (slot.shape, first - offset, {key: t[first - lo:last - lo]
                                                                     for key, t in tensors.items()})
                offset += n
        return pieces
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # FSDP2: DTensors sharded by rows (dim 0)
    for name, p in model.named_parameters():
        rows = p.shape[0] if p.dim() else 1
        start = 0
        if hasattr(p, "to_local"):  # FSDP2 cuts the rows as torch.chunk does: ceil(rows / N) a rank
            N, rank = p.device_mesh.size(), p.device_mesh.get_local_rank()
            start = min(rank * -(-rows // N), rows) * (p.numel() // max(rows, 1))
        values = {"param": local(p).detach().view(-1),
                  **{key: local(t).view(-1) for key, t in optimizer.state[p].items() if t.shape == p.shape}}
        if values["param"].numel():
            pieces[name] = (p.shape, start, values)
    return pieces


@torch.no_grad()
def load_pieces(mine, stored):
    """Copy into `mine` (held() of this run) every overlap with `stored`, an iterable of {name: (shape, start,
    values)} dicts as held() made them on the ranks of any layout. Raises ValueError if a parameter's shape
    differs, or if some element of `mine` is in none of them."""
    filled = dict.fromkeys(mine, 0)
    for pieces in stored:
        for name, (shape, start, values) in pieces.items():
            if name not in mine:
                continue
            my_shape, my_start, my_values = mine[name]
            if tuple(shape) != tuple(my_shape):
                raise ValueError(f"{name} has shape {tuple(shape)}, the model {tuple(my_shape)}")
            my_len = my_values["param"].numel()
            first, last = max(start, my_start), min(start + values["param"].numel(), my_start + my_len)
            if first < last:
                for key, t in my_values.items():
                    t[first - my_start:last - my_start].copy_(values[key][first - start:last - start])
                filled[name] += last - first
    missing = [name for name, n in filled.items() if n != mine[name][2]["param"].numel()]
    if missing:
        raise ValueError(f"no stored values for part of {', '.join(missing[:3])}{' ...' * (len(missing) > 3)}")


def whole(stored, key="param"):
    """{name: whole float32 tensor} of one entry of the pieces ("param", or an optimizer state such as "exp_avg")
    that every rank's held() gave, whatever layout wrote them: a checkpoint's weights in one process."""
    stored = [{name: (shape, start, {"param": values[key]}) for name, (shape, start, values) in pieces.items()}
              for pieces in stored]
    out = {name: torch.empty(shape) for pieces in stored for name, (shape, _, _) in pieces.items()}
    load_pieces({name: (t.shape, 0, {"param": t.view(-1)}) for name, t in out.items()}, stored)
    return out


def optimizer_scalars(optimizer):
    """The optimizer's state of other shapes than the parameters' (AdamW's step count), which is the same for
    every parameter: {key: number}."""
    scalars = {}
    for state in optimizer.state.values():
        for key, t in state.items():
            if t.dim() == 0 and scalars.setdefault(key, t.item()) != t.item():
                raise ValueError(f"optimizer state {key!r} differs between parameters")
    return scalars


def prepare_optimizer(optimizer, keys, scalars):
    """Give every parameter of `optimizer` its state before a load writes into it: zeros shaped like the
    parameter for each of `keys`, and `scalars` ({key: number}, from optimizer_scalars) as 0-dim tensors."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {**{key: torch.tensor(float(v)) for key, v in scalars.items()},
                                  **{key: torch.zeros_like(p) for key in keys}}


# ----------------------------------------------------------------------------------------------------------------
# what lies in DIR


def folder_name(step):  # the checkpoint of optimizer step `step`
    return f"step_{step:06d}"


def shard_name(rank, world_size):  # what rank `rank` of world_size wrote
    return f"shard_{rank:05d}-of-{world_size:05d}.pt"


def checkpoints(out_dir, complete=True):
    """The checkpoints in out_dir, newest first: those with a manifest (complete), or those without one."""
    names = [name for name in os.listdir(out_dir) if name.startswith("step_") and name[5:].isdecimal()
             and os.path.exists(os.path.join(out_dir, name, MANIFEST)) == complete]
    return [os.path.join(out_dir, name) for name in sorted(names, key=lambda name: int(name[5:]), reverse=True)]


def newest(out_dir):
    return next(iter(checkpoints(out_dir)), None)


def shards(path):
    """The pieces every rank of the layout that wrote the checkpoint held, read lazily (mmap) into host memory: a GPU
    run's checkpoint loads on a machine without that GPU, and no rank copies every shard onto the GPU that wrote it."""
    with open(os.path.join(path, MANIFEST)) as f:
        names = [name for name in json.load(f)["files"] if name.startswith("shard_")]
    return [torch.load(os.path.join(path, name), map_location="cpu", mmap=True, weights_only=True) for name in names]


def weights(path):
    """A checkpoint's model weights, whole and by parameter name, in one process, whatever layout wrote it."""
    return whole(shards(path))


def run_flags(args, world_size, data_sha256):
    """What a checkpoint records of the run's flags, and what a resumed run is checked against: the model's
    shape, what fixes the sequence of batches (the data by its bytes, data_sha256 of --data's, not by its path),
    what fixes the learning rate of every step, and what else shapes an update."""
    global_batch = world_size // args.sp * args.batch_size * args.grad_accum
    return {"model": model_flags(args),
            "data": {"seed": args.seed, "seq_len": args.seq_len, "global_batch": global_batch,
                     "data": data_sha256 and f"SHA-256 {data_sha256[:16]}", "pack": args.pack},
            "schedule": {"steps": args.steps, "lr": args.lr, "warmup": args.warmup},
            "update": {"weight_decay": args.weight_decay, "grad_clip": args.grad_clip, "dtype": args.dtype}}


# ----------------------------------------------------------------------------------------------------------------
# saving


def save(args, step, model, zero, optimizer, world_size, rank, data_sha256):
    """Every rank writes its files, then a small marker naming them (or its problem), and waits on the file
    system, not in a collective, so the writing has no deadline: only a rank whose heartbeat stops for --timeout
    seconds ends the run (wait_for_markers). Once every marker is there, rank 0 writes the manifest, removes what
    --keep leaves out and renames the directory; the others go on when the manifest is in place."""
    t0 = time.perf_counter()
    final = os.path.join(args.out_dir, folder_name(step))
    tmp, every = final + ".tmp", min(1.0, args.timeout / 4)
    pieces = held(model, optimizer, zero)
    if args.zero == "0":  # every rank holds everything: each writes its 1/N run of every parameter
        cut = lambda n: slice(n * rank // world_size, n * (rank + 1) // world_size)
        pieces = {name: (shape, start + cut(len(v["param"])).start,
                         {k: t[cut(len(t))].clone() for k, t in v.items()})  # torch.save writes a view's storage
                  for name, (shape, start, v) in pieces.items()}
    files = {shard_name(rank, world_size): pieces}
    if rank == 0:  # every rank drew the same random numbers so far
        files["trainer.pt"] = {"step": step, "world_size": world_size, "zero": args.zero,
                               **run_flags(args, world_size, data_sha256),
                               "optimizer": optimizer_scalars(optimizer), "rng": torch.get_rng_state(),
                               "run": os.environ.get("TORCHELASTIC_RUN_ID")}
    try:
        os.makedirs(tmp, exist_ok=True)
    except OSError as e:  # no folder to report into either
        fail(f"cannot make the checkpoint's folder {tmp}: {e.strerror}", alike=False)
    try:
        with heartbeat(os.path.join(tmp, f"rank_{rank:05d}.alive"), every):
            marker = {"files": write_files(tmp, files), "problem": None}
    except (Mistake, OSError) as e:
        marker = {"files": {}, "problem": str(e)}
    write_files(tmp, {f"rank_{rank:05d}.part.json": marker})
    os.replace(os.path.join(tmp, f"rank_{rank:05d}.part.json"), os.path.join(tmp, f"rank_{rank:05d}.json"))
    markers = wait_for_markers(tmp, final, world_size, rank, args.timeout)
    stop_on([markers[r]["problem"] if r in markers else None for r in range(world_size)], rank)
    if rank != 0:
        return
    manifest = {"step": step, "files": {name: f for m in markers.values() for name, f in m["files"].items()}}
    with heartbeat(os.path.join(tmp, "rank_00000.alive"), every):  # the others wait for the manifest
        write_files(tmp, {MANIFEST: manifest})  # last: a checkpoint with a manifest is complete
    for r in range(world_size):
        for name in (f"rank_{r:05d}.json", f"rank_{r:05d}.alive"):
            with suppress(FileNotFoundError):
                os.remove(os.path.join(tmp, name))
    os.replace(tmp, final)
    directory = os.open(args.out_dir, os.O_RDONLY)  # the rename itself reaches the disk
    os.fsync(directory)
    os.close(directory)
    for old in checkpoints(args.out_dir)[args.keep:] if args.keep else []:  # --keep N: the newest N, once the new
        os.replace(old, old + ".deleting")  # one is in place; no longer a checkpoint, before it is taken apart
        shutil.rmtree(old + ".deleting")
    size = sum(f["bytes"] for f in manifest["files"].values())
    tqdm.write(f"saved {final}: {len(manifest['files'])} files, {size / 2**20:,.2f} MiB, in "
               f"{time.perf_counter() - t0:.2f} s")


class _Hashing:
    """A file that hashes what is written to it (torch.save writes its zip archive in order)."""

    def __init__(self, f):
        self.f, self.digest = f, hashlib.sha256()

    def write(self, data):
        self.digest.update(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


def write_files(directory, files):
    """Write {name: object} into directory (torch.save, or JSON for *.json), each flushed to the disk (fsync),
    and return {name: {"bytes", "sha256"}}. A failure is a Mistake naming it, a full disk as such."""
    written = {}
    for name, obj in files.items():
        path = os.path.join(directory, name)
        try:
            os.makedirs(directory, exist_ok=True)
            with open(path, "wb") as f:
                out = _Hashing(f)
                if name.endswith(".json"):
                    out.write(json.dumps(obj).encode())
                else:
                    torch.save(obj, out)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError of its zip writer
            with suppress(OSError):
                os.remove(path)
            free = shutil.disk_usage(directory).free if os.path.isdir(directory) else float("inf")  # not the disk
            if getattr(e, "errno", None) == errno.ENOSPC or free < 2**20:
                fail(f"no space left on the device of {directory} ({free / 2**20:,.1f} MiB free) for {name}; "
                     f"free some, or keep fewer checkpoints (--keep)", alike=False)
            fail(f"cannot write {path}: {getattr(e, 'strerror', None) or str(e).splitlines()[0]}", alike=False)
        written[name] = {"bytes": os.path.getsize(path), "sha256": out.digest.hexdigest()}
    return written


def heartbeat(path, every):
    """Touch `path` every `every` seconds while the block runs, so that other processes see this one live however
    long its writing takes (a flush to slow storage, say); one that hangs or was stopped falls silent."""
    def beat():
        with suppress(OSError), open(path, "a"):
            os.utime(path)
    return repeating(beat, every)


def wait_for_markers(directory, final, world_size, rank, timeout):
    """The markers in directory, {rank: marker}, once one reports a problem; else rank 0 waits for all of them,
    the other ranks until `final` is complete (rank 0 has renamed the directory). Waits while anything in
    directory changes (files growing, heartbeats); a Mistake once nothing has for `timeout` seconds (a rank that
    died or hangs)."""
    markers, seen, since = {}, None, time.monotonic()
    while True:
        for r in set(range(world_size)) - set(markers):
            with suppress(FileNotFoundError), open(os.path.join(directory, f"rank_{r:05d}.json")) as f:
                markers[r] = json.load(f)
        if any(m["problem"] for m in markers.values()) or (len(markers) == world_size if rank == 0 else
                                                           os.path.exists(os.path.join(final, MANIFEST))):
            return markers
        now = None  # the directory itself goes when rank 0 renames it (and if final went too, nothing comes)
        with suppress(FileNotFoundError):
            now = sorted((entry.name, entry.stat().st_size, entry.stat().st_mtime_ns)
                         for entry in os.scandir(directory))
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since > timeout:
            missing = sorted(set(range(world_size)) - set(markers)) or [0]
            fail(f"checkpoint {directory}: ranks {missing} gave no sign of life for --timeout {timeout:g} s (a "
                 f"peer process died, or hangs)", alike=False)
        time.sleep(0.05)


# ----------------------------------------------------------------------------------------------------------------
# resuming


def to_resume_from(args):
    """The complete checkpoints in --out-dir, newest first, once this rank's view of it allows the run's flags (a
    Mistake otherwise)."""
    paths = checkpoints(args.out_dir) if args.out_dir else []
    for incomplete in checkpoints(args.out_dir, complete=False) if args.out_dir else []:
        fail(f"--out-dir {args.out_dir} holds {os.path.basename(incomplete)} without a {MANIFEST} (from an older "
             f"train.py, or a copy cut short); move it out of the directory")
    if args.resume and not paths:
        fail(f"--resume: no complete checkpoint in --out-dir {args.out_dir}")
    if paths and not (args.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0):
        fail(f"--out-dir {args.out_dir} already holds checkpoints; add --resume to continue from "
             f"{os.path.basename(paths[0])}, or choose another directory")
    return paths


def find(args, world_size, control, lr_at, data_sha256):
    """The checkpoint this run continues from: (its path, its trainer state, the seconds verifying took), or None
    to start afresh. --resume asks for one; a group that torchrun restarted (--max-restarts) takes the newest one
    of its own run by itself. A checkpoint that fails verification is reported in one line and moved aside
    (step_000020.damaged), and the next older one is tried. lr_at(step, args): the run's learning rate, to say
    what a changed schedule would do. data_sha256: of --data's bytes, None for the copy task."""
    paths = agreed(control, partial(to_resume_from, args))  # each rank reads the directory: a mistake stops all
    every = gathered(control, [os.path.basename(path) for path in paths])
    other = next((r for r, theirs in enumerate(every) if theirs != every[0]), None)
    if other is not None:  # one directory (out_dir checked it), but a node's view of it is stale
        fail(f"the ranks see other checkpoints in --out-dir {args.out_dir}: {every[0]} on rank 0, {every[other]} on "
             f"rank {other}; start again once every node's view of it is up to date")
    if not paths:
        return None
    rank, t0 = int(os.environ.get("RANK", 0)), time.perf_counter()
    for path in paths:
        problems = [p for p in gathered(control, verify(path, rank, world_size)) if p]
        if not problems:
            break
        if rank == 0:
            print(f"note: checkpoint {path} fails verification ({problems[0]}); trying the one before it")
    else:
        fail(f"no checkpoint in --out-dir {args.out_dir} passes verification; start afresh in another directory")
    for damaged in paths[:paths.index(path)] if rank == 0 else []:  # out of the way of the steps that redo them
        shutil.rmtree(damaged + ".damaged", ignore_errors=True)
        os.replace(damaged, damaged + ".damaged")
    trainer = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=True)
    run = run_flags(args, world_size, data_sha256)
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")  # torchrun's --rdzv-id (launch.check_args refuses "none" here)
    if not args.resume and trainer["run"] != run_id:  # a restarted group takes its own run's checkpoints alone
        fail(f"--out-dir {args.out_dir} holds checkpoints of another run ({trainer['run']}; this run is {run_id}), "
             f"which a restarted run does not take; start again with --resume to continue from "
             f"{os.path.basename(path)}, or choose another directory")
    if trainer["step"] > args.steps:
        fail(f"checkpoint {path} is past --steps {args.steps}: it has done {trainer['step']} steps")
    if {**run["model"], **trainer["model"]} != run["model"]:  # a field the checkpoint lacks: as resolved
        deltanet = "d" in run["model"]["layer_pattern"] + trainer["model"].get("layer_pattern", "")  # else no gdn flag
        differ = "; ".join(f"--{name.replace('_', '-')}: {value} there, {run['model'].get(name)} here"
                           for name, value in trainer["model"].items()
                           if run["model"].get(name) != value and (deltanet or not name.startswith("gdn_")))
        fail(f"checkpoint {path} holds another model ({differ}); resume with its flags, or choose another --out-dir")
    if trainer["schedule"] != run["schedule"] and not args.new_schedule:
        was = argparse.Namespace(**{**vars(args), **trainer["schedule"]})
        changed = ", ".join(f"--{k} {trainer['schedule'][k]:g} -> {v:g}" for k, v in run["schedule"].items()
                            if trainer["schedule"][k] != v)
        fail(f"{changed} against checkpoint {path} would move the learning rate of step {trainer['step'] + 1} from "
             f"{lr_at(trainer['step'], was):.3g} to {lr_at(trainer['step'], args):.3g}; resume with the checkpoint's "
             f"values, or add --new-schedule to accept it")
    unused = {"seed"} if args.data and args.pack else set()  # packed text is read in order, whatever the seed
    for what in ("data", "update"):  # may change, with a note; of what the checkpoint records (older: less)
        recorded = {name: value for name, value in trainer.get(what, {}).items() if name not in unused}
        if rank == 0 and recorded != {name: run[what].get(name) for name in recorded}:
            print(f"note: the checkpoint was trained with {recorded}; this run has {run[what]}, so its steps "
                  f"will not repeat the original run's")
    return path, trainer, time.perf_counter() - t0


def verify(path, rank, world_size):
    """The first problem with the checkpoint's manifest (it lists trainer.pt and one shard for each rank that wrote,
    of the step in the checkpoint's name) or with this rank's share of its files (every world_size-th, from the
    rank-th), or None: each must have the size and the SHA-256 that the manifest gives."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        step = int(manifest["step"])
        files = sorted((name, int(e["bytes"]), str(e["sha256"])) for name, e in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError, OverflowError):  # Infinity: valid JSON
        return f"{MANIFEST} is unreadable"
    if folder_name(step) != os.path.basename(os.path.normpath(path)):  # renamed: the newest by name is not
        return f"{MANIFEST} is of step {step}, another than its folder's name says"
    n = max(1, sum(name.startswith("shard_") for name, _, _ in files))  # the ranks that wrote it
    if {name for name, _, _ in files} != {"trainer.pt", *(shard_name(r, n) for r in range(n))}:
        return f"{MANIFEST} does not list a whole checkpoint: trainer.pt, and shard_R-of-N.pt for each R < N"
    for name, size, digest in files[rank::world_size]:
        file = os.path.join(path, name)
        try:
            if os.path.getsize(file) != size:
                return f"{name} has {os.path.getsize(file):,} bytes, not {size:,}"
            if sha256(file) != digest:
                return f"{name} does not match its SHA-256 (changed on the disk)"
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as e:  # a disk error reads as damage: the next older checkpoint is tried
            return f"{name} is unreadable ({e.strerror or e})"
    return None


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**24):
            digest.update(block)
    return digest.hexdigest()


def restore(checkpoint, model, zero, optimizer):
    """Load a checkpoint written on any layout into this run. Returns the number of steps already done."""
    path, trainer, seconds = checkpoint
    t0 = time.perf_counter()
    stored = shards(path)
    keys = {key for pieces in stored for _, _, values in pieces.values() for key in values} - {"param"}
    prepare_optimizer(optimizer, keys, trainer["optimizer"])
    load_pieces(held(model, optimizer, zero), stored)  # each rank copies what it holds out of every shard
    torch.set_rng_state(trainer["rng"])
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"resuming from {path} after step {trainer['step']} (written by {trainer['world_size']} ranks with "
              f"--zero {trainer['zero']}): model and AdamW state carried over; verified in {seconds:.2f} s, loaded "
              f"in {time.perf_counter() - t0:.2f} s")
    return trainer["step"]


class Metrics:
    """The --metrics file, which rank 0 writes: one JSON line per optimizer step. A resumed run keeps the lines up
    to its checkpoint and writes the rest anew; lines that are not whole records (a blank line, one cut short by a
    full disk) are dropped, and counted. A write that fails (a full disk, a file that takes no writes) is one line
    naming the file and the reason."""

    def __init__(self, path, start_step):
        self.path, kept, dropped = path, [], 0
        if start_step and os.path.exists(path):
            with open(path) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                        kept += [line] if record["step"] <= start_step else []
                    except (ValueError, TypeError, KeyError):
                        dropped += 1
        if dropped:
            print(f"note: --metrics {path}: dropped {dropped} line(s) that were not whole records")
        try:
            self.file = open(path, "w")
            self.file.writelines(kept)
            self.file.flush()
        except OSError as e:
            self.failed(e)

    def write(self, record):
        try:
            print(json.dumps(record), file=self.file, flush=True)
        except OSError as e:
            self.failed(e)

    def failed(self, error):
        fail(f"--metrics {self.path}: cannot write it ({error.strerror})", alike=False)

    def close(self):
        with suppress(OSError):  # what could not be written was said when it failed
            self.file.close()


# ----------------------------------------------------------------------------------------------------------------
# the out-dir: one live run at a time


@contextmanager
def out_dir(args, run, lr_at):
    """--out-dir held by this run alone while the block runs (rank 0 locks it: `lock_out_dir`; every rank must see
    that lock, in one directory), and the checkpoint the run continues from (`find`), or None to start afresh.
    run: launch.started's."""
    lock = agreed(run.control, lambda: lock_out_dir(args.out_dir) if run.rank == 0 and args.out_dir else None)
    try:
        seen = gathered(run.control, args.out_dir and read_lock(args.out_dir))  # each rank reads rank 0's lock
        other = next((r for r, line in enumerate(seen) if line != seen[0]), None)
        if other is not None:
            fail(f"--out-dir {args.out_dir} is not one directory that every rank sees: rank {other} does not find "
                 f"rank 0's lock file in it; choose a directory on a file system the nodes share")
        yield find(args, run.world_size, run.control, lr_at, run.data_sha256)
    finally:
        if lock:
            lock.close()  # releases the out-dir for the next run


def lock_out_dir(out_dir):
    """An exclusive lock on out_dir for this run (flock: the system lifts it when the process ends, however it
    ends); refused if another live run holds it. Removes what an ended run left half-written or half-deleted."""
    try:
        lock = open(os.path.join(out_dir, ".lock"), "a+")
    except OSError as e:
        fail(f"--out-dir {out_dir}: cannot open its lock file ({e.strerror})")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if not isinstance(e, BlockingIOError):  # a file system without locks
            lock.close()
            fail(f"--out-dir {out_dir}: cannot lock it ({e.strerror}); choose a directory on a file system that "
                 f"has flock")
        lock.seek(0)
        holder = lock.read().strip() or "running"
        lock.close()
        fail(f"--out-dir {out_dir} is in use by another run ({holder}); wait for it to end, or choose another "
             f"directory")
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {socket.gethostname()}, lock {secrets.token_hex(8)}\n")  # unique: read_lock
    lock.flush()
    os.fsync(lock.fileno())  # on the disk, for the other nodes to read (read_lock)
    for name in os.listdir(out_dir):
        if name.startswith("step_") and name.endswith((".tmp", ".deleting")):
            shutil.rmtree(os.path.join(out_dir, name), ignore_errors=True)
    return lock


def read_lock(out_dir):
    """What out_dir's lock file says (who holds it), or None without one."""
    try:
        with open(os.path.join(out_dir, ".lock")) as f:
            return f.read()
    except OSError:
        return None
