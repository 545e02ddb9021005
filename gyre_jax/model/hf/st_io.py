"""Safetensors files read and written one tensor at a time (no mmap, no whole-file copy).

Format (https://github.com/huggingface/safetensors): an 8-byte little-endian header
length, a JSON header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, 
"__metadata__": {...}}``, then the raw little-endian tensor bytes. Reading a tensor
is one seek and one ``readinto`` into a fresh numpy buffer, so the host holds only
the tensor being moved to devices. ``safetensors.numpy`` reads what this writes and
vice versa (tests check both directions).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Iterable, Iterator

import ml_dtypes
import numpy as np

DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
          "F64": np.dtype(np.float64), "I32": np.dtype(np.int32), "I64": np.dtype(np.int64)}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsReader:
    """Header of one file plus ``read(name)``; use as a context manager."""

    def __init__(self, path: str):
        self.path = path
        self._f = open(path, "rb")
        try:
            (n,) = struct.unpack("<Q", self._f.read(8))
            if n > 100_000_000:
                raise ValueError(f"{path}: header length {n} is not plausible (not a safetensors file?)")
            header = json.loads(self._f.read(n))
        except (struct.error, ValueError) as e:
            self._f.close()
            raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.tensors: dict[str, dict] = header
        self._base = 8 + n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self._f.close()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def read(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {info['dtype']}; supported: {sorted(DTYPES)}")
        dt = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end - begin != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
            raise ValueError(f"{self.path}: tensor {name!r} has {end - begin} bytes for shape {shape} {info['dtype']}")
        out = np.empty(shape, dt)
        self._f.seek(self._base + begin)
        if self._f.readinto(out.reshape(-1).view(np.uint8).data) != end - begin:
            raise ValueError(f"{self.path}: tensor {name!r} is truncated")
        return out


def write_safetensors(path: str, specs: Iterable[tuple[str, tuple[int, ...], np.dtype]],
                      arrays: Iterator[np.ndarray], metadata: dict[str, str] | None = None) -> int:
    """Write tensors ``specs`` (name, shape, dtype) whose data ``arrays`` yields in the same order.

    The header is written first from the specs alone, so each array can be produced
    (fetched from devices) just before its bytes are written. Returns the data bytes.
    """
    specs = list(specs)
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    off = 0
    for name, shape, dt in specs:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
        header[name] = {"dtype": DTYPE_NAMES[np.dtype(dt)], "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the reference writer does
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, shape, dt), a in zip(specs, arrays, strict=True):
            a = np.ascontiguousarray(a)
            if a.shape != tuple(shape) or a.dtype != np.dtype(dt):
                raise ValueError(f"{path}: tensor {name!r} is {a.shape} {a.dtype}, its header says {shape} {dt}")
            f.write(a.reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)
    return off
