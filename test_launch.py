"""
Tests of what a run does before and around its training: bad flags are refused with one line and no collective;
under torchrun the line is printed once; an error on one rank stops every rank; a hung rank ends the run within
--timeout; a non-finite loss stops before the update; --help shows the defaults; a long step says where it is.
Then two torchrun "nodes" on this machine: a run that fails on one fails on both, non-zero, with its line.
"""

import fcntl
import hashlib
import io
import os
import re
import shutil
import signal
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from tqdm import tqdm

import train
from conftest import (HERE, PARAGRAPHS, SHORT_RUN, children, exit_statuses, free_port, run, start, start_long_run,
                      torchrun, torchrun_patched)
from gpt import GPT, GPTConfig
from harness import bench, launch


@pytest.mark.parametrize("world_size, argv, message", [
    (4, ["--sp", "3"], r"--sp 3 does not divide the world size 4; choose --sp in \{1, 2, 4\}"),
    (4, ["--n-head", "2", "--n-embd", "32"], r"--sp 4 with --ring 1 puts 4 ranks in each Ulysses group, more than "
                                             r"--n-head 2: a rank would hold no head; choose --sp in \{1, 2\}, or "
                                             r"--ring in \{2, 4\}"),
    (4, ["--n-head", "2", "--n-embd", "32", "--layer-pattern", "da"],  # a ring cannot carry Gated DeltaNet
     r"a rank would hold no head; choose --sp in \{1, 2\}$"),
    (4, ["--n-head", "2", "--n-embd", "32", "--layer-pattern", "da", "--gdn-k-heads", "1", "--gdn-v-heads", "1"],
     r"a rank would hold no head; choose --sp in \{1\}$"),  # and none of the 1 value heads of a d layer
    (4, ["--ring", "3"], r"--ring 3 does not divide --sp 4; choose --ring in \{1, 2, 4\}"),
    (1, ["--layer-pattern", "da", "--gdn-k-heads", "4", "--gdn-v-heads", "6"],
     r"gdn_v_heads=6 is not a multiple of gdn_k_heads=4; choose gdn_v_heads in \{4, 8, 12, 16, \.\.\.\}"),
    (4, ["--layer-pattern", "d", "--gdn-k-heads", "3", "--gdn-v-heads", "3"],
     r"--sp 4 is larger than the 3 value heads of a Gated DeltaNet layer: a rank would hold none; choose --sp in "
     r"\{1, 2\}, or more --gdn-v-heads"),
    (1, ["--layer-pattern", "d", "--window", "8"], r"--window shapes softmax attention, and --layer-pattern d has no a "
                                                   r"layer; drop --window, or put an a in --layer-pattern"),
    (1, ["--layer-pattern", "dd", "--sinks"], r"--sinks shapes softmax attention, and --layer-pattern dd has no a "),
    (1, ["--layer-pattern", "d", "--n-kv-head", "3"], r"--n-kv-head shapes softmax attention, and --layer-pattern d "),
    (1, ["--layer-pattern", "d", "--rope-base", "5e5"], r"--rope-base shapes softmax attention, and --layer-pattern "),
    (1, ["--gdn-k-heads", "4", "--gdn-v-heads", "6"], r"--gdn-k-heads shapes Gated DeltaNet layers, and "
                                                      r"--layer-pattern a has no d layer; drop it, or put a d in"),
    (1, ["--layer-pattern", "aa", "--gdn-parallel", "context"], r"--gdn-parallel shapes Gated DeltaNet layers, and "),
    (2, ["--plan", "2x80"], r"--plan traces every GPU it names in one process: run python train.py --plan 2x80, not "
                            r"torchrun"),
    (1, ["--plan", "2x80", "--metrics", "{tmp}"], r"--metrics \S+ is a directory; give a file name"),
    (1, ["--plan", "2x80", "--data", "{one_paragraph}"], r"--data \S+one.txt: .*sequences of 128 tokens need 129"),
    (4, ["--ring", "2", "--layer-pattern", "da"], r"--ring 2 cannot be used with --gdn-parallel ulysses: its Gated "
                                                  r"DeltaNet layers need whole heads of the whole sequence "
                                                  r"\(--gdn-parallel context runs beside a ring\); use --ring 1"),
    (4, ["--n-head", "8", "--n-kv-head", "6"], r"n_head=8 is not a multiple of n_kv_head=6"),
    (1, ["--metrics", "{empty}/metrics.jsonl"],
     r"--metrics: cannot make the folder .*empty.txt \(File exists\)"),
    (4, ["--seq-len", "3"], r"--seq-len 3 is smaller than --sp 4"),
    (1, ["--data", "/no/such/file.txt"], r"--data /no/such/file.txt: no such file"),
    (1, ["--batch-size", "0"], r"--batch-size 0 must be at least 1"),
    (1, ["--tiles", "0"], r"--tiles 0 must be at least 1"),
    (4, ["--ring", "2", "--balance", "documents"], r"--balance documents shares each packed document's work over a "
                                                   r"ring's ranks: it needs --pack"),
    (1, ["--balance", "zigzag"], r"--balance zigzag chooses how a ring's ranks share the tokens; add --ring 2 or more, "
                                 r"or drop it$"),
    (1, ["--data", "{empty}"], r"--data .*empty.txt: holds no text"),
    (1, ["--data", "{empty}", "--pack"], r"--data .*empty.txt: holds no text"),
    (1, ["--save-every", "5"], r"--resume, --save-every and --keep need --out-dir"),
    (1, ["--new-schedule"], r"--new-schedule accepts another schedule than the checkpoint's on --resume; add "
                            r"--resume, or drop it"),
    (1, ["--offload"], r"--offload keeps the block inputs that --recompute saves in CPU memory; add --recompute"),
    (1, ["--layer-pattern", "adx"], r"layer_pattern='adx': use the letters a \(softmax attention\) and d"),
    (4, ["--layer-pattern", "ad", "--n-layer", "1", "--ring", "2"], r"layer_pattern='ad' has more letters than "
                                                                    r"n_layer=1; choose n_layer >= 2, or a pattern "
                                                                    r"no longer than 1"),
    (1, ["--n-embd", "33", "--n-head", "3"], r"n_embd=33 must split into n_head=3 heads of even size; no n_head does "
                                             r"for an odd n_embd$"),
    (1, ["--n-embd", "96", "--n-head", "5"], r"n_embd=96 must split into n_head=5 heads of even size; choose n_head "
                                             r"in \{1, 2, 3, 4, 6, 8, 12, 16, 24, 48\}$"),
    (1, ["--lr", "nan"], r"--lr nan must be a finite number above 0"),
    (1, ["--lr=-1e-3"], r"--lr -0.001 must be a finite number above 0"),
    (1, ["--weight-decay", "inf"], r"--weight-decay inf must be a finite number of 0 or more"),
    (1, ["--grad-clip", "-1"], r"--grad-clip -1 must be a finite number of 0 or more"),
    (1, ["--timeout", "0"], r"--timeout 0 must be a finite number above 0"),
    (1, ["--warmup", "-2"], r"--warmup -2 must be at least 0"),
    (1, ["--keep", "-1"], r"--keep -1 must be at least 0"),
    (1, ["--timeout", "1e20"], r"--timeout 1e\+20 must be at most 604800 seconds \(a week\)"),
    (1, ["--timeout", "1e-7"], r"--timeout 1e-07 must be at least 1 second"),
    (1, ["--seed", str(10**16)], r"--seed 10000000000000000 must be in \[0, 2\*\*32\)"),
    (1, ["--metrics", "{tmp}"], r"--metrics \S+ is a directory; give a file name, e.g. \S+metrics.jsonl"),
    (1, ["--data", "{one_paragraph}", "--pack"], r"has no blank line between paragraphs, so --pack would make one "
                                                 r"document of it; separate documents with blank lines, or drop "
                                                 r"--pack"),
])
def test_bad_input_is_refused(monkeypatch, tmp_path, world_size, argv, message):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "one.txt").write_text("one paragraph\r\nof two lines\r\n")
    argv = [a.format(empty=tmp_path / "empty.txt", tmp=tmp_path, one_paragraph=tmp_path / "one.txt") for a in argv]
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    with pytest.raises(SystemExit, match=message):
        train.main(argv)
    assert not dist.is_initialized()


@pytest.mark.parametrize("world_size, argv", [(1, []), (4, ["--ring", "2", "--pack"]), (2, ["--layer-pattern", "da"])])
def test_the_flag_checks_take_their_own_defaults(world_size, argv):
    """A CUDA run checks its flags twice (to trace its step, then to start): the defaults the first check fills in
    pass the second, which changes nothing."""
    args = launch.parse_args(argv)
    launch.check_args(args, world_size)
    checked = dict(vars(args))
    launch.check_args(args, world_size)
    assert vars(args) == checked


@pytest.mark.parametrize("script, argv", [("train.py", []), ("bench", []), ("bench", ["attention"]),
                                          ("bench", ["ring"])], ids=["train", "bench", "bench attention", "bench ring"])
def test_help_shows_the_defaults(capsys, script, argv):
    """`python train.py --help` and `python -m harness.bench [CMD] --help` answer at once, exit 0, with every
    default that a flag has."""
    with pytest.raises(SystemExit, match="^0$"):
        {"train.py": train.main, "bench": bench.main}[script](argv + ["--help"])
    printed = capsys.readouterr().out
    if script == "train.py":
        for flag, default in (("--seq-len", "128"), ("--steps", "600"), ("--batch-size", "8"), ("--n-embd", "128"),
                              ("--timeout", "300"), ("--seed", "0"), ("--keep", "0"),
                              ("--device", "cuda" if torch.cuda.is_available() else "cpu")):
            text = re.search(rf"\n  {flag} (.*?)(?=\n  -|\Z)", printed, re.S).group(1)  # the flag's help
            assert f"(default: {default})" in " ".join(text.split()), flag
    else:  # bench lists its benchmarks; each of them, its flags
        assert "(default: " in printed if argv else "attention,tiled" in printed


def test_the_collectives_backend():
    """gloo on CPU whatever --backend says; on CUDA, NCCL by default, or gloo for CUDA tensors too (several ranks on
    one GPU)."""
    assert [launch.collectives_backend(device, choice) for device in ("cpu", "cuda") for choice in ("nccl", "gloo")] \
        == ["gloo", "gloo", "nccl", "cpu:gloo,cuda:gloo"]
    assert launch.parse_args([]).backend == "nccl"


def test_the_benchmarks_start_from_the_repository_root():
    """`python -m harness.bench CMD`, as every usage line gives it, run from the repository's root: the harness and
    the concept files it measures import by their names, and its help answers, exit 0."""
    status, output, _ = run([sys.executable, "-m", "harness.bench", "attention", "--help"])
    assert status == 0 and "--kernel {sdpa,copy}" in output, output[-3000:]


def failed_alike(output, status):
    """From torchrun's report: both ranks exited `status`, or one did and torchrun stopped the other by SIGTERM
    (-15) before that one's own exit: while it was still importing torch, before train.py could take the signal,
    or, on a busy machine, as it was leaving with the same mistake. Either way every rank ends non-zero."""
    statuses = exit_statuses(output)
    return sorted(statuses) == [0, 1] and status in statuses.values() and set(statuses.values()) <= {status, -15}


@pytest.mark.limit(30)
def test_data_is_read_once_and_hashed_as_read(tmp_path, one_rank):
    """--data from a named pipe, whose bytes can be read once: the run reads them once, and the SHA-256 that the
    ranks compare (and a checkpoint keeps) is of the bytes it trains on."""
    pipe = tmp_path / "text.fifo"
    os.mkfifo(pipe)
    writer = threading.Thread(target=pipe.write_text, args=(PARAGRAPHS,))
    writer.start()
    documents, digest = launch.this_machine(launch.parse_args(["--data", str(pipe), "--pack"]))
    writer.join()
    assert len(documents) > 1 and digest == hashlib.sha256(PARAGRAPHS.encode()).hexdigest()


def test_torchrun_shows_the_error_line_once():
    """Under torchrun every rank finds the mistake; its line is printed once, before torchrun's own report, and
    every rank exits 1 (`failed_alike`)."""
    status, output, _ = run(torchrun(2) + ["--lr", "nan"])
    assert status != 0 and failed_alike(output, 1), output[-3000:]
    assert output.count("train.py: error: --lr nan must be a finite number above 0") == 1
    assert output.count("train.py: error:") == 1  # the other ranks leave without a line, torchrun's SIGTERM too
    assert output.index("train.py: error:") < output.index("FAILED")


def test_an_error_on_one_rank_stops_every_rank_with_its_line(tmp_path, text_file):
    """The data file missing on one machine: that rank's line, printed once, and every rank stops at once with exit
    status 1, not after --timeout."""
    missing = "def read_documents(*args):\n    raise ValueError('no such file or directory')\n" \
              "data.read_documents = read_documents"
    status, output, seconds = torchrun_patched(tmp_path, missing, ["--data", str(text_file)])
    assert status != 0 and seconds < 30, output[-3000:]
    assert output.count(f"train.py: error: rank 1: --data {text_file}: no such file or directory") == 1, output[-3000:]
    assert exit_statuses(output) == {0: 1, 1: 1}, output[-3000:]


def test_a_bug_in_a_one_process_run_keeps_its_traceback(one_rank, monkeypatch):
    """A collective that fails with no peer to lose is a bug, not a lost rank: its error, with its traceback, rather
    than the one line that names a lost peer."""
    def bad_collective(*args):
        dist.all_to_all_single(torch.empty(2), torch.empty(3))  # sizes that cannot be exchanged
    monkeypatch.setattr(train, "train_step", bad_collective)
    with pytest.raises(RuntimeError):
        train.main(["--steps", "1", "--n-embd", "32", "--seq-len", "32"])


def test_running_out_of_memory_is_one_line(one_rank, monkeypatch):
    """Memory the allocator cannot give (here 4 EiB of CPU memory, asked for as a step would; on a GPU,
    torch.OutOfMemoryError) ends the run with one line, exit status 1, what it asked for and what would fit; any
    other RuntimeError keeps its traceback."""
    monkeypatch.setattr(train, "train_step", lambda *args: torch.empty(2**62, dtype=torch.uint8))
    with pytest.raises(SystemExit, match=r"^train.py: error: rank 0: out of memory, tried to allocate "
                                         r"4611686018427387904 bytes; choose a shorter --seq-len, .* finds the "
                                         r"longest sequence that fits\)$"):
        train.main(["--steps", "1", "--n-embd", "32", "--seq-len", "32"])
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity ...")
    for error, line in ((gpu, "tried to allocate 20.00 GiB; choose"), (RuntimeError("mat1 and mat2 shapes"), None)):
        with pytest.raises(SystemExit if line else RuntimeError, match=line or "mat1"), launch.one_line_errors():
            raise error


def _rank_1_stopped(tmp_path, timeout, signal_rank_0=None):
    """A long run under torchrun whose rank 1 stops answering (SIGSTOP) and, a second later, rank 0 gets
    `signal_rank_0` if given: (the first error line, seconds from the stop or the signal to it, torchrun's status)."""
    launcher, _, workers = start_long_run(tmp_path, [], timeout=timeout)
    os.kill(workers[1], signal.SIGSTOP)
    if signal_rank_0:
        time.sleep(1)  # rank 0 is in the next collective by now, waiting for rank 1
        os.kill(workers[0], signal_rank_0)
    begun = time.time()
    for line in launcher.stdout:
        if "train.py: error:" in line:
            break
    waited = time.time() - begun
    os.kill(workers[1], signal.SIGKILL)  # torchrun would wait 30 s for a stopped process to take its SIGTERM
    launcher.communicate(timeout=60)
    return line, waited, launcher.returncode


def test_hung_rank_ends_the_run_within_the_timeout(tmp_path):
    """A peer that stops answering: the others give up after --timeout seconds, naming the collective."""
    line, waited, status = _rank_1_stopped(tmp_path, 4)  # the two ranks meet within 4 s of each other
    assert status != 0
    named = r"(\w+|the collective waited on at [\w.]+:\d+)"  # a call, or the line that waited on an async one
    assert re.search(rf"rank \d+, step \d+: {named} failed \(a peer process died, or waited longer than "
                     r"--timeout 4 s\)", line)
    assert waited < 4 + 10


def test_a_signal_stops_a_rank_that_waits_on_a_stopped_peer(tmp_path):
    """Ctrl-C (SIGINT) to a rank that waits in a collective for a peer that stopped answering: the rank ends with
    its line at once, not when --timeout ends the wait (Python runs a signal handler only between its own steps)."""
    line, waited, status = _rank_1_stopped(tmp_path, 60, signal.SIGINT)
    assert status != 0 and "train.py: error: rank 0: stopped by SIGINT" in line and waited < 10, (line, waited)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    out_dir = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"step 2: loss nan, gradient norm nan; stopped before the update"):
        train.main(["--lr", "1e30", "--warmup", "1", "--save-every", "1", "--out-dir", str(out_dir)] + SHORT_RUN[4:])
    assert sorted(os.listdir(out_dir)) == [".lock", "step_000001"]


SLOW_STDERR = """import os, sys, time
sys.path.insert(0, {here!r})
from harness.launch import one_line_errors

class Slow:  # a stderr whose writes take half a second, in Python: a signal's handler may run inside one
    def write(self, text):
        begun = time.time()
        while time.time() - begun < 0.5:
            pass
        os.write(2, text.encode())

    def flush(self):
        pass

sys.stderr = Slow()
with one_line_errors():
    os.write(1, b"ready\\n")
    while True:
        pass
"""


def test_a_second_signal_while_the_line_is_printed_ends_the_rank(tmp_path):
    """Ctrl-C under torchrun: the terminal's SIGINT, then torchrun's SIGTERM while the first line is still being
    written. The rank exits 130 with the one line, never hangs waiting on itself."""
    (tmp_path / "slow.py").write_text(SLOW_STDERR.format(here=HERE))
    process = start([sys.executable, str(tmp_path / "slow.py")])
    process.stdout.readline()  # inside one_line_errors
    process.send_signal(signal.SIGINT)
    time.sleep(0.1)
    process.send_signal(signal.SIGTERM)
    output, _ = process.communicate(timeout=30)
    assert process.returncode == 130 and output == "train.py: error: rank 0: stopped by SIGINT\n", output


def test_the_pulse_stops_when_its_store_is_gone(monkeypatch):
    """A rank beats in the store every `every` seconds while it runs, and stops at the first beat that fails (the
    store went with its host): each failed call would print torch's warning, many lines, twice a second."""
    class Store:
        beats, failed, down = 0, 0, False

        def add(self, key, amount):
            if Store.down:
                Store.failed += 1
                raise RuntimeError("recvValue failed: Connection reset by peer")
            Store.beats += 1
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", Store)
    with launch.pulse(0, every=0.01):
        time.sleep(0.1)
        Store.down = True
        time.sleep(0.1)
    assert Store.beats > 3 and Store.failed == 1, (Store.beats, Store.failed)


def test_a_long_step_says_where_it_is(monkeypatch):
    """StepProgress: a step that runs for longer than its interval shows the step, its time and the layer on the
    progress bar, forward and backward, and nothing once the step has ended."""
    model = GPT(GPTConfig(n_layer=2, n_embd=32))
    bar = tqdm(total=1, file=io.StringIO(), mininterval=0)
    progress = launch.StepProgress(model, bar, every=0.05)
    for block in model.blocks:  # slow layers: 0.3 s each, forward and backward
        block.register_forward_pre_hook(lambda *args: time.sleep(0.3))
        next(block.parameters()).register_hook(lambda grad: time.sleep(0.3))
    progress.begin(4)
    idx = torch.zeros(1, 8, dtype=torch.long)
    model(idx, torch.arange(8)[None], idx)[0].backward()
    progress.end()
    time.sleep(0.2)
    progress.close()
    shown = bar.fp.getvalue()
    for where in ("layer 1/2 forward", "layer 2/2 forward", "layer 2/2 backward", "layer 1/2 backward"):
        assert re.search(rf"step 5: \d+ s in, {where}", shown), (where, shown)
    assert shown.rstrip().endswith("layer 1/2 backward]")  # the step ended: nothing more


# ================================================================================================================
# two nodes: one torchrun each, as on a cluster; each judges its node by its own workers' exit statuses alone


def _two_nodes(tmp_path, argv, after_start=None, timeout=90, node_argv=((), ()), nproc=1):
    """train.py as two torchrun nodes of `nproc` ranks each on this machine, each started in its own folder (node0,
    node1), so that a relative path can name a file one node has and the other lacks; node_argv: flags of each node
    alone. after_start(launchers) runs once both are started. Returns [(exit status, output)] by node, and the
    seconds until both had ended."""
    port, launchers = free_port(), []
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir(exist_ok=True)
        launchers.append(start(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc_per_node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
             os.path.join(HERE, "train.py"), "--n-embd", "32", "--seq-len", "32", *argv, *node_argv[node]],
            cwd=tmp_path / f"node{node}"))
    begun = time.time()
    if after_start:
        after_start(launchers)
    outputs = [launcher.communicate(timeout=timeout)[0] for launcher in launchers]
    return [(launcher.returncode, output) for launcher, output in zip(launchers, outputs)], time.time() - begun


def test_a_file_missing_on_one_node_fails_both_nodes(tmp_path):
    """The data file on node 0 alone: rank 1 says so, rank 0 repeats it in node 0's log, both nodes fail."""
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "text.txt").write_text(PARAGRAPHS)
    nodes, seconds = _two_nodes(tmp_path, ["--data", "text.txt", "--steps", "2"])
    line = "train.py: error: rank 1: --data text.txt: no such file or directory"
    for status, output in nodes:
        assert status != 0 and output.count(line) == 1, output[-3000:]
    assert seconds < 30


def test_an_out_dir_in_use_on_one_node_fails_both_nodes(tmp_path):
    """Another run holds node 0's out-dir: rank 0 says so, and node 1's rank, which found nothing, repeats it in node
    1's log; both nodes fail."""
    (tmp_path / "node0" / "run").mkdir(parents=True)
    with open(tmp_path / "node0" / "run" / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        nodes, seconds = _two_nodes(tmp_path, ["--out-dir", "run", "--steps", "2"])
    for status, output in nodes:
        assert status != 0 and output.count("train.py: error: rank 0: --out-dir run is in use by another run") == 1, \
            output[-3000:]
    assert seconds < 30


@pytest.mark.parametrize("node1", ["fresh", "older"])
def test_an_out_dir_the_nodes_do_not_share_fails_both_nodes(tmp_path, one_rank, node1):
    """--out-dir a directory of each node's own: a fresh run fails before its first step (not at its first save),
    and a resume from checkpoints of steps 1 and 2 in node 0's, only the older one in node 1's, fails alike. One
    line on both nodes, never a traceback from a rank left in a collective by the other's refusal."""
    argv = ["--out-dir", "run", "--steps", "3"]
    if node1 == "older":
        train.main(["--n-embd", "32", "--seq-len", "32", "--steps", "2", "--save-every", "1", "--out-dir",
                    str(tmp_path / "node0" / "run")])
        shutil.copytree(tmp_path / "node0" / "run" / "step_000001", tmp_path / "node1" / "run" / "step_000001")
        argv.append("--resume")
    nodes, seconds = _two_nodes(tmp_path, argv)
    line = ("train.py: error: --out-dir run is not one directory that every rank sees: rank 1 does not find rank 0's "
            "lock file in it; choose a directory on a file system the nodes share")
    ours = re.compile(rf'File "{re.escape(HERE)}/(harness/)?\w+\.py"')  # a traceback through this project's files
    for status, output in nodes:
        assert status != 0 and output.count(line) == 1 and not ours.search(output), output[-3000:]
    assert seconds < 30


def test_a_flag_mistake_fails_both_nodes(tmp_path):
    """A flag mistake on node 1 alone: each of its 2 ranks finds it before joining, and node 1 prints it once; node
    0's 2 ranks wait for them until --timeout and say so (the first to give up, or both). Both nodes fail."""
    nodes, seconds = _two_nodes(tmp_path, ["--timeout", "1"], node_argv=((), ("--lr", "nan")), nproc=2)
    (status0, output0), (status1, output1) = nodes
    assert status0 != 0 and status1 != 0 and seconds < 30
    said = re.findall(r"^train.py: error: rank [01]: the 4 ranks did not all join within --timeout 1 s; look for the "
                      r"line of a rank that stopped \(.*\)$", output0, re.M)
    assert 1 <= len(said) <= 2, output0[-3000:]
    assert output1.count("train.py: error: --lr nan must be a finite number above 0") == 1, output1[-3000:]


@pytest.mark.parametrize("when", ["training", "starting"])
def test_a_node_killed_is_named_by_the_other(tmp_path, when):
    """Node 1's process is killed while the run trains, or while it starts (it reads its --data, a named pipe nobody
    writes: a stalled disk, as node 0's waits to compare what each found): node 0's rank names rank 1 (node 1) as
    lost in one line, and fails within --timeout."""
    for node in (0, 1):
        (tmp_path / f"node{node}").mkdir()
    if when == "training":  # rank 0 opens its --metrics file when training starts
        argv, sign, where = ["--steps", "100000", "--metrics", "m.jsonl"], "m.jsonl", r", step \d+"
    else:  # rank 0 makes its --out-dir after reading --data, then waits for rank 1
        (tmp_path / "node0" / "text.txt").write_text(PARAGRAPHS)
        os.mkfifo(tmp_path / "node1" / "text.txt")
        argv, sign, where = ["--data", "text.txt", "--out-dir", "run"], "run", ""

    def kill_node_1(launchers):
        deadline = time.time() + 60
        while not (tmp_path / "node0" / sign).exists() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1)
        os.kill(children(launchers[1].pid)[0], signal.SIGKILL)

    nodes, seconds = _two_nodes(tmp_path, argv + ["--timeout", "20"], kill_node_1)
    (status0, output0), (status1, _) = nodes
    assert status0 != 0 and status1 != 0, output0[-3000:]
    assert re.search(rf"train.py: error: rank 0{where}: .+ failed \(a peer process died, or waited longer than "
                     r"--timeout 20 s\); lost: rank 1 \(node 1\)", output0), output0[-3000:]
    assert not re.search(rf'File "{re.escape(HERE)}/(harness/)?\w+\.py"', output0), output0[-3000:]
    assert seconds < 20 + 30


@pytest.mark.parametrize("node_argv, what", [((["--seq-len", "32"], ["--seq-len", "64"]), r"--seq-len: rank 0 has 32, "
                                              r"rank 1 has 64"),
                                             ((["--data", "text.txt"],) * 2, r"the bytes of --data \(SHA-256\)"),
                                             (([], ["--metrics", "m.jsonl"]), r"whether --metrics is given: rank 0 has "
                                              r"False, rank 1 has True")],
                         ids=["flags", "stale-data", "metrics-on-one-node"])
def test_nodes_that_disagree_are_refused(tmp_path, node_argv, what):
    """Two nodes started with different flags, or whose data files hold different bytes (a stale copy on one), or
    --metrics on the node that rank 0 is not on (nothing would be written): every rank stops before training, with
    one line naming what differs."""
    for node, text in enumerate((PARAGRAPHS, PARAGRAPHS.replace("paragraph 3", "paragraph three"))):
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "text.txt").write_text(text)
    nodes, seconds = _two_nodes(tmp_path, ["--steps", "2"], node_argv=node_argv)
    (status0, output0), (status1, _) = nodes
    assert status0 != 0 and status1 != 0 and seconds < 30, output0[-3000:]
    assert len(re.findall(rf"train.py: error: the ranks disagree on {what}", output0)) == 1, output0[-3000:]


def test_ctrl_c_ends_every_rank_with_one_line(tmp_path):
    """Ctrl-C at a terminal sends SIGINT to torchrun and its workers: each rank ends at once with one line, and no
    traceback of ours."""
    launcher = start(torchrun(2) + ["--steps", "100000", "--n-embd", "32", "--seq-len", "32", "--metrics",
                                    str(tmp_path / "m.jsonl")], start_new_session=True)  # a group, as a terminal's
    deadline = time.time() + 60
    while not (tmp_path / "m.jsonl").exists() and time.time() < deadline:
        time.sleep(0.1)  # training has started
    os.killpg(launcher.pid, signal.SIGINT)
    output, _ = launcher.communicate(timeout=30)
    assert launcher.returncode != 0, output[-3000:]
    for rank in (0, 1):
        assert output.count(f"train.py: error: rank {rank}: stopped by SIGINT") == 1, output[-3000:]
    assert 'train.py", line' not in output and "KeyboardInterrupt" not in output


def test_torchrun_shows_a_flag_it_does_not_know_once():
    """argparse's mistakes under torchrun: printed once (by rank 0), and every rank exits 2, as argparse does
    (`failed_alike`)."""
    status, output, _ = run(torchrun(2) + ["--no-such-flag"])
    assert status != 0 and failed_alike(output, 2), output[-3000:]
    assert output.count("unrecognized arguments: --no-such-flag") == 1


@pytest.mark.parametrize("argv, message", [
    (["--dry-run"], r"--dry-run traces the run that --plan NxG describes: add --plan, e.g. --plan 8x80$"),
    (["--offload-optimizer", "--zero", "0"], r"--offload-optimizer moves ZeRO-3's shards and AdamW to CPU memory; "
                                             r"use --zero 3, not --zero 0$"),
    (["--vocab-size", "100"], r"--vocab-size 100 must be at least 256: the data's tokens are bytes, 0 to 255$"),
    (["--rope-base", "0"], r"--rope-base 0 must be a finite number above 0$"),
    (["--intermediate-size", "-1"], r"--intermediate-size -1 must be at least 0$"),
    (["--loss-tiles", "-1"], r"--loss-tiles -1 must be at least 0$"),
])
def test_the_flags_of_plans_and_real_shapes_refuse_bad_values(monkeypatch, argv, message):
    """--dry-run without --plan, --offload-optimizer and the flags of a real model's shape: a value a run cannot use
    is one line, and nothing starts."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match=message):
        train.main(argv)
    assert not dist.is_initialized()
