"""Safetensors bytes written with one copy of each tensor (a streamed move's hot path).

`safetensors.torch.save` copies every tensor to host bytes and then again into the
file image; a streamed migration's gradient log had copied the gradients off the
parameters before that (three copies of every logged step, the last two on a thread
that holds the GIL). `pack` writes the same format (an 8-byte little-endian header
length, the JSON header padded with spaces to 8 bytes, then the tensors' bytes in
header order, widest dtypes first) straight from the tensors, wherever they live,
into one buffer that the state channel sends without another copy; the receiver reads
it with `safetensors.torch.load`, as any safetensors payload (tests/test_tensorpack.py
holds the two writers to the same tensors).

On a GPU stage a copy to pageable host memory makes the stage's thread wait for the
GPU and then for the copy. `pack_staged` queues the copies into pinned host memory
instead and returns a `Staged` payload that the sending thread waits for.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["Staged", "pack", "pack_staged"]

_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _layout(
    tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None
) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The header's bytes (its length first) and each tensor's byte span after it."""
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    spans: list[tuple[str, int, int]] = []
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} has no safetensors name")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        spans.append((name, offset, offset + size))
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head, spans


def _bytes_of(t: Tensor) -> Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def pack(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> bytearray:
    """``tensors`` (any device, any layout) and ``metadata`` as safetensors bytes."""
    head, spans = _layout(tensors, metadata)
    start = len(head)
    out = bytearray(start + (spans[-1][2] if spans else 0))
    out[:start] = head
    for name, begin, end in spans:
        if end > begin:
            dst = torch.frombuffer(out, dtype=torch.uint8, count=end - begin, offset=start + begin)
            dst.copy_(_bytes_of(tensors[name]))
    return out


class Staged:
    """Safetensors bytes still being copied off a GPU into pinned host memory: the
    stage's thread only queues the copies (on its current stream, so they read the
    tensors before any later kernel changes them) and the thread that sends waits for
    them with `ready`."""

    def __init__(self, buffer: Tensor, done: Any) -> None:
        self._buffer, self._done = buffer, done

    def __len__(self) -> int:
        return self._buffer.numel()

    def ready(self) -> memoryview:
        """The bytes, once every copy has landed."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._buffer.numpy().data


def pack_staged(
    tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None
) -> bytearray | Staged:
    """`pack`, where some of ``tensors`` live on a GPU without making the calling thread
    wait for them: their bytes go to pinned host memory by asynchronous copies (a `Staged`
    for the sending thread). Host-only tensors are packed at once, as by `pack`."""
    if not any(t.is_cuda for t in tensors.values()):
        return pack(tensors, metadata)
    head, spans = _layout(tensors, metadata)
    start = len(head)
    out = torch.empty(start + (spans[-1][2] if spans else 0), dtype=torch.uint8, pin_memory=True)
    out[:start].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
    for name, begin, end in spans:
        if end > begin:
            out[start + begin : start + end].copy_(_bytes_of(tensors[name]), non_blocking=True)
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()
    return Staged(out, done)
