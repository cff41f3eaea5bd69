"""How host_pieces cuts tensors into views and packs staged ones into buffers (no tensors)."""

from __future__ import annotations

from elasticrun.checkpoint.staging import piece_units


def test_unstaged_tensors_are_cut_into_views_of_at_most_piece_bytes() -> None:
    assert piece_units([250, 0, 100], [False, False, False], piece=100, step=100) == [
        (0, 0, 100, None), (0, 100, 100, None), (0, 200, 50, None), (2, 0, 100, None)]


def test_staged_tensors_pack_into_full_buffers_and_span_them() -> None:
    units = piece_units([30, 50, 45], [True, True, True], piece=1000, step=40)
    assert units == [
        (-1, 0, 40, [(0, 0, 30, 0), (1, 0, 10, 30)]),
        (-1, 0, 40, [(1, 10, 40, 0)]),
        (-1, 0, 40, [(2, 0, 40, 0)]),
        (-1, 0, 5, [(2, 40, 5, 0)]),
    ]


def test_an_unstaged_tensor_closes_the_open_buffer() -> None:
    units = piece_units([10, 20, 5], [True, False, True], piece=64, step=64)
    assert units == [(-1, 0, 10, [(0, 0, 10, 0)]), (1, 0, 20, None), (-1, 0, 5, [(2, 0, 5, 0)])]
