"""``wordsum``, the memory tier's checksum: its definition, its additivity (parts in any order,
of any size, at any alignment add up to the file's digest) and what it is guaranteed to catch —
every change within 8 consecutive bytes (every flipped byte), a page moved. Property tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.checkpoint import CheckpointError, save
from elasticrun.checkpoint.checksum import Checksum, Digest, parse_checksum
from elasticrun.checkpoint.wordsum import PAGE, WordSum, wordsum_part

from helpers.ckpt import reference_wordsum

blobs = st.binary(min_size=0, max_size=3 * PAGE + 100)


def _digest(data: bytes) -> str:
    d = Digest(Checksum.WORDSUM)
    d.update(data)
    return d.hexdigest()


@settings(max_examples=150, deadline=None)
@given(data=blobs, cuts=st.lists(st.integers(min_value=0, max_value=3 * PAGE + 100), max_size=8),
       order=st.randoms(use_true_random=False))
def test_parts_in_any_order_add_up_to_the_definition(data, cuts, order):
    points = sorted({0, len(data), *(c for c in cuts if c <= len(data))})
    parts = list(zip(points, points[1:]))
    order.shuffle(parts)
    total = WordSum()
    for a, b in parts:
        total.add(a, memoryview(data)[a:b])
    assert total.hexdigest() == reference_wordsum(data)
    stream = Digest(Checksum.WORDSUM)  # in order, as the writer hashes
    for a, b in sorted(parts):
        stream.update(data[a:b])
    assert stream.hexdigest() == reference_wordsum(data) and Checksum.WORDSUM.is_digest(stream.hexdigest())


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=1, max_size=2 * PAGE + 50), where=st.integers(min_value=0), flip=st.integers(1, 255))
def test_every_changed_byte_is_caught(data, where, flip):
    i = where % len(data)
    changed = bytearray(data)
    changed[i] ^= flip
    assert _digest(bytes(changed)) != _digest(data)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=8, max_size=2 * PAGE + 50), where=st.integers(min_value=0),
       new=st.binary(min_size=1, max_size=8))
def test_every_change_within_8_consecutive_bytes_is_caught(data, where, new):
    i = where % (len(data) - len(new) + 1)
    changed = data[:i] + new + data[i + len(new):]
    assert (_digest(changed) == _digest(data)) == (changed == data)


def test_a_page_moved_elsewhere_is_caught_though_every_word_is_still_there():
    pages = [bytes([k]) * PAGE for k in (1, 2, 3)]
    data, swapped = b"".join(pages), b"".join([pages[1], pages[0], pages[2]])
    assert sorted(data) == sorted(swapped)  # the plain sum cannot tell them apart ...
    assert _digest(swapped) != _digest(data)  # ... the page-weighted one can


def test_unaligned_buffers_and_odd_offsets_agree_with_aligned_ones():
    data = bytes(range(256)) * 40
    backing = bytearray(len(data) + 3)
    backing[3:] = data  # a view whose first byte is not 8-byte aligned in memory
    whole = memoryview(backing)[3:]
    assert wordsum_part(0, whole) == wordsum_part(0, data)
    a1, b1 = wordsum_part(0, whole[:4099])
    a2, b2 = wordsum_part(4099, whole[4099:])
    total = WordSum()
    total.add_share(a1, b1)
    total.add_share(a2, b2)
    assert total.hexdigest() == reference_wordsum(data)


def test_wordsum_is_for_memory_snapshots_only(tmp_path):
    import torch

    with pytest.raises(CheckpointError, match="'wordsum' is for memory snapshots only: use one of crc32, sha256"):
        parse_checksum("wordsum")
    with pytest.raises(CheckpointError, match="memory snapshots only"):
        save({"w": torch.ones(3)}, tmp_path, "c", checksum=Checksum.WORDSUM)
    assert not (tmp_path / "c").exists()
