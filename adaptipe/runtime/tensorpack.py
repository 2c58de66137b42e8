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
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["pack"]

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


def pack(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> bytearray:
    """``tensors`` (any device, any layout) and ``metadata`` as safetensors bytes."""
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
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
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    start = 8 + len(head)
    out = bytearray(start + offset)
    struct.pack_into("<Q", out, 0, len(head))
    out[8:start] = head
    for name in order:
        begin, end = header[name]["data_offsets"]  # type: ignore[index]
        if end > begin:
            dst = torch.frombuffer(out, dtype=torch.uint8, count=end - begin, offset=start + begin)
            dst.copy_(tensors[name].detach().contiguous().reshape(-1).view(torch.uint8))
    return out
