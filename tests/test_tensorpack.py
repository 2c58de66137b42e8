"""`adaptipe.runtime.tensorpack`: one-copy safetensors bytes that safetensors reads back
as it reads its own."""

from __future__ import annotations

import pytest
import safetensors.torch
import torch

from adaptipe.runtime.tensorpack import Staged, pack, pack_staged


def test_packed_bytes_load_as_the_same_tensors_with_their_metadata() -> None:
    torch.manual_seed(0)
    tensors = {
        "w": torch.randn(3, 4),
        "step": torch.tensor(7, dtype=torch.int64),
        "lr": torch.tensor(0.5, dtype=torch.float64),
        "empty": torch.zeros(0, 5),
        "half": torch.randn(5, dtype=torch.bfloat16),
        "mask": torch.tensor([True, False, True]),
        "small": torch.arange(6, dtype=torch.int8).reshape(2, 3),
        "transposed": torch.randn(4, 3).t(),  # not contiguous
    }
    body = pack(tensors, {"adaptipe": "meta"})
    got = safetensors.torch.load(bytes(body))
    assert got.keys() == tensors.keys()
    for name, want in tensors.items():
        assert got[name].dtype == want.dtype and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), name
    plain = {name: t.contiguous() for name, t in tensors.items()}  # what save accepts
    theirs = safetensors.torch.save(plain, metadata={"adaptipe": "meta"})
    assert _metadata(bytes(body)) == _metadata(theirs) == {"adaptipe": "meta"}
    assert len(body) == len(theirs)  # the same header fields and bytes, in one copy
    assert int.from_bytes(body[:8], "little") % 8 == 0  # the header padded to 8 bytes


def test_a_packed_copy_does_not_follow_the_tensor_after() -> None:
    live = torch.ones(4)
    body = pack({"g": live})
    live.add_(1.0)  # an optimizer step after the log was packed
    assert torch.equal(safetensors.torch.load(bytes(body))["g"], torch.ones(4))


def test_nothing_to_pack_is_an_empty_payload_and_an_unknown_dtype_is_refused() -> None:
    assert safetensors.torch.load(bytes(pack({}))) == {}
    with pytest.raises(TypeError, match=r"c: dtype torch\.complex64"):
        pack({"c": torch.zeros(2, dtype=torch.complex64)})


def test_host_tensors_are_packed_at_once_by_the_staged_writer() -> None:
    tensors = {"w": torch.randn(3, 4), "step": torch.tensor(3)}
    body = pack_staged(tensors, {"k": "v"})
    assert not isinstance(body, Staged)  # nothing to wait for: the bytes of `pack`
    assert body == pack(tensors, {"k": "v"})


def _metadata(body: bytes) -> dict[str, str] | None:
    import json

    size = int.from_bytes(body[:8], "little")
    meta: dict[str, str] | None = json.loads(body[8 : 8 + size]).get("__metadata__")
    return meta
