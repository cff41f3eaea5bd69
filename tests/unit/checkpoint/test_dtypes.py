"""The dtype table against safetensors itself: every dtype this torch has that safetensors stores is
one we save and load, under the same code, with the same size (files read back by safe_open too)."""

from __future__ import annotations

import json
import struct
import warnings
from typing import Dict, Tuple

import pytest
import safetensors.torch
import torch
from safetensors import safe_open

from elasticrun.checkpoint import shardfile
from elasticrun.checkpoint.format import DTYPES
from elasticrun.checkpoint.reader import load
from elasticrun.checkpoint.shardfile import dtype_code, torch_dtype
from elasticrun.checkpoint.writer import save
from elasticrun.errors import CheckpointError


def _safetensors_codes() -> Dict[torch.dtype, Tuple[str, int]]:
    """Each torch dtype safetensors stores one element per element of the shape: (its code, bytes each)."""
    found = {}
    for name in dir(torch):
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype) or dtype in found:
            continue
        t = torch.zeros(3, dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
                raw = safetensors.torch.save({"x": t if t is not None else torch.zeros(3).to(dtype)})
        except Exception:  # noqa: BLE001 - a dtype safetensors does not store
            continue
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])["x"]
        begin, end = header["data_offsets"]
        if header["shape"] == [3]:  # packed dtypes (float4_e2m1fn_x2) have another element count
            found[dtype] = (header["dtype"], (end - begin) // 3)
    return found


SAFETENSORS = _safetensors_codes()


def test_safetensors_stores_the_float8_kinds():
    assert {code for code, _ in SAFETENSORS.values()} >= {"F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ",
                                                         "F8_E8M0", "BF16", "F32"}


@pytest.mark.parametrize("dtype", sorted(SAFETENSORS, key=str), ids=str)
def test_our_code_and_size_are_safetensors(dtype):
    code, size = SAFETENSORS[dtype]
    assert dtype_code(dtype, "x") == code
    assert DTYPES[code] == (str(dtype).removeprefix("torch."), size)
    assert torch_dtype(code) == dtype


def test_every_dtype_round_trips_through_a_checkpoint(tmp_path):
    state = {code: torch.arange(6, dtype=torch.uint8).view(dtype) if size == 1 else torch.arange(6).to(dtype)
             for dtype, (code, size) in SAFETENSORS.items()}
    save(state, str(tmp_path), "step-1")
    loaded = load(str(tmp_path), "step-1").state_dict
    for code, t in state.items():
        assert loaded[code].dtype == t.dtype, code
        assert torch.equal(loaded[code].view(torch.uint8), t.view(torch.uint8)), code
    (shard,) = tmp_path.glob("step-1/*.safetensors")
    with safe_open(str(shard), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == set(state)


def test_a_dtype_this_torch_lacks_is_one_clear_line(monkeypatch):
    monkeypatch.delitem(shardfile._TORCH_DTYPES, "F8_E8M0")  # as under a torch older than 2.7
    with pytest.raises(CheckpointError, match=r"^dtype F8_E8M0 needs torch.float8_e8m0fnu, which torch .* does not "
                                              r"have: load the checkpoint with a newer torch$"):
        torch_dtype("F8_E8M0")


@pytest.mark.parametrize("dtype", [torch.complex32, getattr(torch, "float4_e2m1fn_x2", torch.complex32)], ids=str)
def test_a_dtype_without_a_code_is_refused_in_one_line(dtype):
    with pytest.raises(CheckpointError, match=rf"^tensor 'm.w' has dtype {dtype}, which elasticrun checkpoints "
                                              r"cannot store \(see Limits in docs/checkpoints.md\)$"):
        dtype_code(dtype, "m.w")
