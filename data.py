"""
What train.py learns from: full sequences with their labels and position ids, made so that every layout trains
on the same global batch. Sample i is a function of (seed, i) alone, and the global batch of step t is samples
[t*G, (t+1)*G) (G sequences a step), whatever dp, sp and grad_accum are.

Two sources, each unpacked (one document a sequence) or packed (whole documents back to back, cut at the
sequence length; position ids restart at 0 where a document starts, and only there):
  - the copy task (default): random tokens, then the same tokens again, and only the copy is scored. Under SP the
    copy lives on other ranks than the original, so it cannot be learned unless attention crosses the shards;
  - a text file as bytes (vocab 256): the whole file, or, packed, one document per blank-line-separated paragraph.

Labels are shifted here, before any sharding: labels[i] is token i+1 of the same document, or -100 where that is
not known (a document's last token; the random half of a copy document).
"""

import torch


def copy_document(n, length, g):
    """`length` tokens: n random ones, repeated. Labels are the next token inside the document, -100 in the random
    first n (nothing there can be predicted) and at the last token."""
    block = torch.randint(0, 256, (n,), generator=g)
    tokens = block.repeat(-(-length // n))[:length]
    labels = torch.cat([tokens[1:], torch.tensor([-100])])
    labels[: n - 1] = -100
    return tokens, labels


def read_documents(path, pack, seq_len):
    """A text file as byte tokens: [the whole file], or with pack one tensor per paragraph. ValueError (naming
    what is wrong) if there is no such file, no text, or, unpacked, fewer than seq_len + 1 bytes."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(e.strerror.lower()) from None
    parts = [d for d in raw.split(b"\n\n") if d.strip()] if pack else [raw] if raw else []
    if not parts:
        raise ValueError("holds no text")
    if not pack and len(raw) < seq_len + 1:
        raise ValueError(f"has {len(raw)} bytes; sequences of {seq_len} tokens need {seq_len + 1} (or packing)")
    return [torch.frombuffer(bytearray(d), dtype=torch.uint8).long() for d in parts]


def make_sample(index, seq_len, documents=None, pack=False, seed=0):
    """Sample `index`: (input ids, labels, position ids), each [seq_len]. documents: read_documents' list, or
    None for the copy task. Unpacked: one document (a copy whose second half starts near the middle, or a
    window of the text). Packed: whole documents back to back."""
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
    pieces = []
    while sum(len(t) for t, _ in pieces) < S:
        if documents is None:
            n = max(1, S // 8)  # documents of random length, each repeating its own first n tokens
            pieces.append(copy_document(n, torch.randint(n + 1, 4 * n + 1, (1,), generator=g).item(), g))
        else:
            doc = documents[torch.randint(0, len(documents), (1,), generator=g).item()]
            pieces.append((doc, torch.cat([doc[1:], torch.tensor([-100])])))
    tokens, labels = (torch.cat(column) for column in zip(*pieces))
    position_ids = torch.cat([torch.arange(len(t)) for t, _ in pieces])  # 0 at each document start, only there
    return tokens[:S], labels[:S], position_ids[:S]


def micro_batch_indices(step, micro, grad_accum, dp_rank, dp, batch_size):
    """The sample indices DP rank dp_rank draws for micro-step `micro` of optimizer step `step`. Over every
    (micro, dp_rank) they cover step*G .. (step+1)*G - 1, G = grad_accum * dp * batch_size."""
    start = ((step * grad_accum + micro) * dp + dp_rank) * batch_size
    return range(start, start + batch_size)
