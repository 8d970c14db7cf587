"""Pipe framing shared by ``gtpo.reward.pool`` and its worker: 8-byte big-endian length, then a pickle."""

from __future__ import annotations

import os
import pickle
import struct

HEADER = struct.Struct(">Q")


def encode(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def read_exact(fd: int, n: int) -> bytes | None:
    """Blocking read of exactly n bytes; None on EOF."""
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
