"""
Tests of data.py against the obvious computation: a copy-task sample depends on (seed, index) alone; text is read
as its bytes, split into paragraphs at blank lines in any line ending, and packed into consecutive windows of
the stream of documents; bad files are refused with their line.
"""

import re

import pytest
import torch

import data
from conftest import PARAGRAPHS


def test_copy_task_samples_depend_only_on_seed_and_index():
    """The same (seed, index) gives the same sample, whoever draws it; the copy is labelled, the random half not;
    the micro-batches of every (micro-step, DP rank) of one step tile the step's samples without overlap."""
    tokens, labels, position_ids = data.make_sample(5, 33, seed=1)
    again = data.make_sample(5, 33, seed=1)
    assert all(torch.equal(a, b) for a, b in zip((tokens, labels, position_ids), again))
    assert not torch.equal(tokens, data.make_sample(6, 33, seed=1)[0])
    n = (33 + 2) // 2  # the random block; the copy starts right after it
    assert torch.equal(tokens[n:], tokens[:33 - n]) and torch.equal(position_ids, torch.arange(33))
    copy_labels = [tokens[(i + 1) % n].item() for i in range(n - 1, 33)]  # the next token, the 34th drawn too
    assert torch.equal(labels, torch.tensor([-100] * (n - 1) + copy_labels))  # only the copy is scored
    drawn = [i for micro in range(2) for dp_rank in range(3)
             for i in data.micro_batch_indices(4, micro, grad_accum=2, dp_rank=dp_rank, dp=3, batch_size=5)]
    assert sorted(drawn) == list(range(4 * 30, 5 * 30))


@pytest.mark.parametrize("seq_len", [64, 13], ids=["64", "13"])
def test_packed_copy_samples_are_whole_copy_documents(seq_len):
    """--pack on the copy task: documents of n + 1 to 4n tokens (n = seq_len // 8, at least 1) back to back, cut at
    the sequence length; each repeats its first n tokens, scored from the first copied token to its last but one;
    positions count from 0 at each document's start, and only there. A sample depends on (seed, index) alone."""
    n = max(1, seq_len // 8)
    for index in range(5):
        tokens, labels, position_ids = data.make_sample(index, seq_len, pack=True, seed=2)
        assert all(torch.equal(a, b) for a, b in zip((tokens, labels, position_ids),
                                                     data.make_sample(index, seq_len, pack=True, seed=2)))
        assert not torch.equal(tokens, data.make_sample(index, seq_len, pack=True, seed=3)[0])
        starts = (position_ids == 0).nonzero().flatten().tolist() + [seq_len]
        assert starts[0] == 0 and len(starts) > 2  # more than one document in every sample
        for first, end in zip(starts, starts[1:]):
            doc, doc_labels = tokens[first:end].tolist(), labels[first:end].tolist()
            assert position_ids[first:end].tolist() == list(range(end - first))
            assert doc == [doc[i % n] for i in range(len(doc))]  # its first n tokens, repeated
            expected = [-100] * (n - 1) + doc[n:] + [-100]  # the next token, within the document
            if end < seq_len:
                assert n + 1 <= len(doc) <= 4 * n and doc_labels == expected
            else:  # the last document may go on past the cut: its last label is a token this sample lacks
                assert doc_labels[:-1] == expected[:len(doc) - 1]


def test_text_samples_are_windows_or_paragraphs(tmp_path):
    """--data: a window of the bytes with the next byte as label; or (--pack) paragraphs back to back, positions
    restarting at each, and no label across a document's end."""
    text = tmp_path / "text.txt"
    text.write_text(PARAGRAPHS)
    raw = PARAGRAPHS.encode()
    tokens, labels, position_ids = data.make_sample(3, 64, data.read_documents(text, pack=False, seq_len=64))
    start = raw.find(bytes(tokens.tolist()))
    assert start >= 0 and bytes(labels.tolist()) == raw[start + 1:start + 65]  # shifted by one, never past
    short = tmp_path / "short.txt"  # 80 bytes: a window of 64 starts at one of 0 to 15, its labels end by byte 80
    short.write_bytes(raw[:80])
    documents, starts = data.read_documents(short, pack=False, seq_len=64), set()
    for index in range(200):
        tokens, labels, _ = data.make_sample(index, 64, documents)
        start = raw.find(bytes(tokens.tolist()))
        assert len(labels) == 64 and bytes(labels.tolist()) == raw[start + 1:start + 65], index
        starts.add(start)
    assert starts == set(range(16)), sorted(starts)  # anywhere, to the last window whose labels the text holds
    documents = data.read_documents(text, pack=True, seq_len=64)
    assert len(documents) == 40 and bytes(documents[0].tolist()).startswith(b"paragraph 0: ")
    tokens, labels, position_ids = data.make_sample(0, 64, documents, pack=True)
    starts = (position_ids == 0).nonzero().flatten().tolist()
    assert starts[0] == 0 and len(starts) > 1
    for start in starts[1:]:  # a document's last token predicts nothing; the next starts at position 0
        assert labels[start - 1] == -100 and position_ids[start - 1] > 0


def _read_text(tmp_path, raw, pack=True, seq_len=8):
    path = tmp_path / "text.txt"
    path.write_bytes(raw)
    return data.read_documents(path, pack, seq_len)


@pytest.mark.parametrize("raw, expected", [
    (b"one a\r\none b\r\n\r\ntwo\r\n\r\n\r\nthree\r\n", [b"one a\r\none b\r\n", b"two\r\n", b"three\r\n"]),
    (b"one\r\rtwo a\rtwo b\r\r\rthree", [b"one\r", b"two a\rtwo b\r", b"three"]),
    (b"one\n \t \ntwo\n  indented\n\t\nthree", [b"one\n", b"two\n  indented\n", b"three"]),
    (b"\r\n\r\none\r\ntwo\n\nthree\r\rfour\r\n  \r\n", [b"one\r\ntwo\n", b"three\r", b"four\r\n"]),
], ids=["crlf", "cr", "whitespace-line", "mixed"])
def test_paragraphs_split_at_blank_lines_in_any_line_ending(tmp_path, raw, expected):
    """A paragraph is its lines, bytes as in the file; only blank lines (empty or spaces and tabs) separate, and
    the \\r\\n that ends a line is never read as \\r and then an empty line."""
    documents = _read_text(tmp_path, raw)
    assert [bytes(d.tolist()) for d in documents] == expected


@pytest.mark.parametrize("raw", [b"line one\r\nline two\r\n", b"one paragraph", b"\n\n  \none paragraph\n\n"])
def test_pack_refuses_a_file_without_paragraph_breaks(tmp_path, raw):
    message = ("has no blank line between paragraphs, so --pack would make one document of it; separate documents "
               "with blank lines, or drop --pack")
    with pytest.raises(ValueError, match=re.escape(message)):
        _read_text(tmp_path, raw)
    assert bytes(_read_text(tmp_path, raw, pack=False, seq_len=4)[0].tolist()) == raw  # unpacked, the file is the text


def test_read_documents_keeps_its_errors(tmp_path):
    with pytest.raises(ValueError, match="^no such file or directory$"):
        data.read_documents(tmp_path / "missing.txt", True, 8)
    for pack in (True, False):
        with pytest.raises(ValueError, match="^holds no text$"):
            _read_text(tmp_path, b"" if not pack else b"\r\n \r\n\t\n", pack)
    with pytest.raises(ValueError, match=re.escape("has 8 bytes; sequences of 8 tokens need 9 (or packing)")):
        _read_text(tmp_path, b"12345678", pack=False)


STREAM_PARAGRAPHS = [b"a first paragraph, longer than one sequence of 16 tokens\r\n",
              b"short\r\n",
              b"a paragraph of three lines\nline two\nline three\n",
              b"x"]  # one byte, the file's last, with no line break: it starts and ends at once


def _expected_stream(documents):
    """The obvious computation: for every byte of the stream, the byte, its label and its position."""
    tokens, labels, positions = [], [], []
    for d in documents:
        tokens += list(d)
        labels += list(d[1:]) + [-100]
        positions += range(len(d))
    return tokens, labels, positions


@pytest.mark.parametrize("seq_len", [16, 23, 300], ids=["16", "23", "longer-than-the-stream"])
def test_packed_samples_are_consecutive_windows_of_the_stream(tmp_path, seq_len):
    """Samples 0, 1, 2, ... tile the documents in file order, repeated: a paragraph longer than a sequence goes on
    in the next sample with its positions counting on, positions are 0 exactly where a document starts, labels
    -100 exactly at a document's last token; one pass reads every byte of the file but the blank lines."""
    first, second, third, fourth = STREAM_PARAGRAPHS
    raw = first + b"\r\n" + second + b" \t\n" + third + b"\r\r\n" + fourth
    documents = _read_text(tmp_path, raw, seq_len=seq_len)
    assert [bytes(d.tolist()) for d in documents] == STREAM_PARAGRAPHS
    tokens, labels, positions = _expected_stream(STREAM_PARAGRAPHS)
    n = len(tokens)
    k = 3 * -(-n // seq_len)  # three passes and more
    samples = [data.make_sample(i, seq_len, documents, pack=True, seed=i) for i in range(k)]
    got = [torch.cat([s[j] for s in samples]).tolist() for j in range(3)]
    cycled = [(column * (k * seq_len // n + 1))[:k * seq_len] for column in (tokens, labels, positions)]
    assert got == cycled
    assert bytes(got[0][:n]) == b"".join(STREAM_PARAGRAPHS)  # one pass: every byte of the file but the blank lines
    starts = {sum(map(len, STREAM_PARAGRAPHS[:d])) for d in range(len(STREAM_PARAGRAPHS))}
    assert [i for i, p in enumerate(got[2]) if p == 0] == [i for i in range(k * seq_len) if i % n in starts]
    assert [i for i, l in enumerate(got[1]) if l == -100] == [i for i in range(k * seq_len) if (i + 1) % n in starts]
    if seq_len == 16:  # sample 1 starts inside the first paragraph, at its byte 16
        assert samples[1][2][:3].tolist() == [16, 17, 18] and samples[0][1][-1].item() == STREAM_PARAGRAPHS[0][16]


def test_packed_sample_depends_on_index_alone(tmp_path):
    documents = _read_text(tmp_path, b"\n".join(STREAM_PARAGRAPHS))
    for i in (5, 0, 1_000_003):
        a, b = data.make_sample(i, 16, documents, pack=True, seed=0), data.make_sample(i, 16, documents, True, 7)
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(data.make_sample(1, 16, documents, True)[0], data.make_sample(2, 16, documents, True)[0])


def test_the_banner_describes_the_text(tmp_path):
    """37 paragraphs of 13,824 bytes read 346 times 128 tokens, packed; the same bytes as one document."""
    paragraphs = [b"a" * 373 + b"\n"] * 36 + [b"b" * 359 + b"\n"]
    packed = _read_text(tmp_path, b"\n".join(paragraphs), pack=True)
    assert data.describe(packed, True, 128, 346) == (
        "37 documents, 13,824 bytes; a pass is 108 sequences of 128 tokens, this run reads 3.2 passes")
    plain = _read_text(tmp_path, b"".join(paragraphs), pack=False)
    assert data.describe(plain, False, 128, 443) == (
        "1 document, 13,824 bytes; windows start anywhere, so every byte can be trained on; this run reads 4.1x its "
        "bytes")
    assert data.describe(packed, True, 100, 1) == (
        "37 documents, 13,824 bytes; a pass is 139 sequences of 100 tokens, this run reads 0.007 passes")
