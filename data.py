"""
What train.py learns from: full sequences with their labels and position ids, made so that every layout trains
on the same global batch. Sample i is a function of (seed, i) and the data alone, and the global batch of step t
is samples [t*G, (t+1)*G) (G sequences per step), for any dp, sp and grad_accum that keep G.

Two sources, each unpacked (a sequence from one document) or packed (several documents per sequence; position ids count
within each document and are 0 where one starts, and only there):
  - the copy task (default): random tokens, then the same tokens again, and only the copy is scored. Under SP the
    copy lives on other ranks than the original, so it cannot be learned unless attention crosses the shards.
    Packed: documents of random lengths back to back, cut at the sequence length;
  - a text file as bytes (vocab 256). Unpacked: the whole file is one document, and a sample is a window of it
    that starts anywhere. Packed: a document is a paragraph (the lines between blank lines, whatever the line
    endings), and all of them in file order, repeated without end, form one stream; sample i is its window i. So
    consecutive samples continue each other, a paragraph longer than a sequence goes on in the next sample, and
    about len(stream) / seq_len samples read every byte once.

Labels are shifted here, before any sharding: labels[i] is token i+1 of the same document, or -100 where that is
not known (a document's last token; the first n-1 tokens of a copy document of n random ones, whose next is random).
"""

import hashlib
import itertools

import torch


def copy_document(n, length, g):
    """`length` tokens: n random ones, repeated. Labels are the next token inside the document, -100 for the first
    n-1 (their next tokens are random: nothing to predict) and at the last token."""
    block = torch.randint(0, 256, (n,), generator=g)
    tokens = block.repeat(-(-length // n))[:length]
    labels = torch.cat([tokens[1:], torch.tensor([-100])])
    labels[: n - 1] = -100
    return tokens, labels


class Documents(list):
    """Byte strings as token tensors, one per document, that are views of one tensor holding them all back to back
    (`stream`); `bounds` [documents + 1] holds where each starts in it and, last, its length. A packed sample
    finds its documents there by binary search, without a pass over all of them. sha256: of the bytes they were
    read from (the ranks compare it, and a checkpoint keeps it)."""

    def __init__(self, parts, sha256):
        self.sha256 = sha256
        lengths = [len(p) for p in parts]
        self.stream = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()
        super().__init__(self.stream.split(lengths))
        self.bounds = torch.tensor([0] + lengths).cumsum(0)


def read_documents(path, pack, seq_len):
    """A text file as byte tokens (Documents): [the whole file], or with pack one document per paragraph, its
    bytes as in the file, line endings included; the blank lines between paragraphs (empty or only spaces and
    tabs, after \\n, \\r\\n or \\r) are left out. ValueError (naming what is wrong) if the file cannot be read, no
    text, packed only one paragraph, or, unpacked, fewer than seq_len + 1 bytes."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(e.strerror.lower()) from None
    if pack:  # bytes.splitlines ends a line at \n, \r\n or \r, and nowhere else
        runs = itertools.groupby(raw.splitlines(keepends=True), key=lambda line: not line.strip(b" \t\r\n"))
        parts = [b"".join(lines) for blank, lines in runs if not blank]
    else:
        parts = [raw] if raw else []
    if not parts:
        raise ValueError("holds no text")
    if pack and len(parts) == 1:
        raise ValueError("has no blank line between paragraphs, so --pack would make one document of it; separate "
                         "documents with blank lines, or drop --pack")
    if not pack and len(raw) < seq_len + 1:
        raise ValueError(f"has {len(raw)} bytes; sequences of {seq_len} tokens need {seq_len + 1} (or packing)")
    return Documents(parts, hashlib.sha256(raw).hexdigest())


def make_sample(index, seq_len, documents=None, pack=False, seed=0):
    """Sample `index`: (input ids, labels, position ids), each [seq_len]. documents: read_documents' Documents, or
    None for the copy task. Unpacked: one document (a copy whose second half starts near the middle, or a
    window of the text). Packed copy task: whole documents back to back, cut at seq_len. Packed text: window
    `index` of the stream of all documents in file order, repeated without end, i.e. its tokens
    [index*seq_len, (index+1)*seq_len) modulo its length, whatever the seed; a sample that starts inside a
    document counts its positions on from where the previous sample stopped."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    S = seq_len
    if not pack:
        if documents is None:
            tokens, labels = copy_document((S + 2) // 2, S + 1, g)  # the copy starts near the middle
        else:
            text = documents[0]
            start = torch.randint(0, len(text) - S, (1,), generator=g).item()
            tokens, labels = text[start: start + S], text[start + 1: start + S + 1]
        return tokens[:S], labels[:S], torch.arange(S)
    if documents is not None:
        stream, bounds = documents.stream, documents.bounds
        at = (index * S % len(stream) + torch.arange(S)) % len(stream)  # (S,) each token's place in the stream
        document = torch.searchsorted(bounds, at, right=True) - 1  # (S,) the document that holds it
        last = at == bounds[document + 1] - 1  # a document's last token: the next one is another's
        return stream[at], torch.where(last, -100, stream[(at + 1) % len(stream)]), at - bounds[document]
    pieces = []
    while sum(len(t) for t, _ in pieces) < S:
        n = max(1, S // 8)  # documents of random length, each repeating its own first n tokens
        pieces.append(copy_document(n, torch.randint(n + 1, 4 * n + 1, (1,), generator=g).item(), g))
    tokens, labels = (torch.cat(column) for column in zip(*pieces))
    position_ids = torch.cat([torch.arange(len(t)) for t, _ in pieces])  # 0 at each document start, only there
    return tokens[:S], labels[:S], position_ids[:S]


def describe(documents, pack, seq_len, samples):
    """One line on what a run of `samples` sequences (steps x the global batch) reads of read_documents' text:
    with pack, passes over the stream; without, the bytes read over the bytes there are."""
    size = sum(len(d) for d in documents)
    times = samples * seq_len / size
    read = f"{times:.1f}" if times >= 0.1 else f"{times:.1g}"  # a short run on a large file reads more than 0.0
    if pack:
        return (f"{len(documents):,} documents, {size:,} bytes; a pass is {-(-size // seq_len):,} sequences of "
                f"{seq_len} tokens, this run reads {read} passes")
    return (f"1 document, {size:,} bytes; windows start anywhere, so every byte can be trained on; this run reads "
            f"{read}x its bytes")


def micro_batch_indices(step, micro, grad_accum, dp_rank, dp, batch_size):
    """The sample indices DP rank dp_rank draws for micro-step `micro` of optimizer step `step`. Over every
    (micro, dp_rank) they cover step*G .. (step+1)*G - 1, G = grad_accum * dp * batch_size."""
    start = ((step * grad_accum + micro) * dp + dp_rank) * batch_size
    return range(start, start + batch_size)
