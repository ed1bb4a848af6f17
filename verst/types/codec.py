"""Compact binary form of a list of Samples, for moving them between processes.

Layout: magic `VSMP`, a format byte, a little-endian u32 header length, a JSON header with every
scalar field and the shapes of the per-token arrays, then the arrays back to back (int32 tokens,
uint8 loss mask, float32 logprobs, int32 routed experts, float32 teacher logprobs). Logprobs round-trip
through float32.
"""

from __future__ import annotations

import json
import struct

import numpy as np

from verst.types.sample import Sample, SampleError, Status

MAGIC = b"VSMP"
FORMAT_VERSION = 1
_ARRAYS = (("tokens", np.int32), ("loss_mask", np.uint8), ("rollout_logprobs", np.float32))


def encode_samples(samples: list[Sample]) -> bytes:
    headers, chunks = [], []
    for s in samples:
        h = s.to_dict()
        for name, dtype in _ARRAYS:
            arr = np.asarray(h.pop(name), dtype=dtype)
            h[f"_{name}_len"] = int(arr.size)
            chunks.append(arr.tobytes())
        experts = h.pop("routed_experts")
        if experts is not None:
            arr = np.asarray(experts, dtype=np.int32)
            if arr.ndim != 3 and arr.size:
                raise SampleError(f"sample {s.index}: routed_experts must be 3-D, got shape {arr.shape}")
            h["_routed_experts_shape"] = list(arr.shape) if arr.size else [0, 0, 0]
            chunks.append(arr.tobytes())
        teacher = h.pop("teacher_logprobs")
        if teacher is not None:
            arr = np.asarray(teacher, dtype=np.float32)
            h["_teacher_logprobs_len"] = int(arr.size)
            chunks.append(arr.tobytes())
        headers.append(h)
    header = json.dumps(headers, separators=(",", ":")).encode()
    return b"".join([MAGIC, struct.pack("<BI", FORMAT_VERSION, len(header)), header, *chunks])


def decode_samples(data: bytes) -> list[Sample]:
    if data[:4] != MAGIC:
        raise SampleError(f"decode_samples: bad magic {data[:4]!r}, expected {MAGIC!r}")
    version, header_len = struct.unpack_from("<BI", data, 4)
    if version != FORMAT_VERSION:
        raise SampleError(f"decode_samples: format version {version} unsupported (expected {FORMAT_VERSION})")
    offset = 9
    headers = json.loads(data[offset : offset + header_len])
    offset += header_len
    view = memoryview(data)
    samples = []
    for h in headers:
        for name, dtype in _ARRAYS:
            n = h.pop(f"_{name}_len")
            nbytes = n * np.dtype(dtype).itemsize
            h[name] = np.frombuffer(view[offset : offset + nbytes], dtype=dtype).tolist()
            offset += nbytes
        shape = h.pop("_routed_experts_shape", None)
        if shape is not None:
            nbytes = int(np.prod(shape)) * 4
            h["routed_experts"] = np.frombuffer(view[offset : offset + nbytes], dtype=np.int32).reshape(shape).tolist()
            offset += nbytes
        n_teacher = h.pop("_teacher_logprobs_len", None)
        if n_teacher is not None:
            nbytes = n_teacher * 4
            h["teacher_logprobs"] = np.frombuffer(view[offset : offset + nbytes], dtype=np.float32).tolist()
            offset += nbytes
        h["status"] = Status(h["status"])
        samples.append(Sample(**h))
    if offset != len(data):
        raise SampleError(f"decode_samples: {len(data) - offset} trailing bytes")
    return samples
