"""
The harness: what runs the lesson, not the lesson. Learn from the files at the top level; this folder can be
ignored while you do. train.py reaches each service here by one named call.

    launch.py       the flags and their checks, the process groups, errors every rank agrees on, failure handling
    checkpoint.py   sharded checkpoints that resume on any layout; the out-dir; the --metrics file
    memory.py       memory: measured (the last step's peak), traced on fake tensors (--plan; a GPU run's fit check)
    fakes.py        the world a traced step runs in: fake tensors, the peers' token data, what a GPU decides
    report.py       what a run prints: its opening line, each step's progress, the summary
    bench.py        every measurement of BENCHMARKS.md: python -m harness.bench --help

Concept files (ulysses, ring, gpt, tiled, zero3, deltanet, data, documents) never import from here.
"""
