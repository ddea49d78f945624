"""The safetensors file format, read and written with numpy (no torch).

A file is an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the raw buffer. ``read_safetensors``
memory-maps every tensor of a folder (single file, ``*.safetensors`` shards, or an
index), so bfloat16 checkpoints load without copies; ``write_safetensors`` writes
one file. Every malformed input raises ``CheckpointError`` /
``CheckpointNotFoundError`` naming the file. Used by checkpoint loading
(``jaxkv.models.loading``) and by small artefacts such as the IntentKV head.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxkv.errors import CheckpointError, CheckpointNotFoundError

_ST_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
}


def _read_header(path: Path) -> tuple[dict, int]:
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path} is truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", raw)
            size = path.stat().st_size
            if n > size - 8:
                raise CheckpointError(f"{path} is corrupt: header length {n} exceeds file size {size}")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is corrupt: unreadable safetensors header ({err})") from err
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"weights file {path} is missing") from err
    header.pop("__metadata__", None)
    return header, 8 + n


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is corrupt: {err}") from err
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointNotFoundError(f"shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"{folder} has no *.safetensors weights")
    return files


def read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    """All tensors of a folder as read-only numpy memory maps (no copy)."""
    tensors: dict[str, np.ndarray] = {}
    for path in _safetensors_files(folder):
        header, start = _read_header(path)
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        for name, meta in header.items():
            try:
                dtype = np.dtype(_ST_DTYPES[meta["dtype"]])
                begin, end = meta["data_offsets"]
                shape = tuple(meta["shape"])
            except (KeyError, TypeError, ValueError) as err:
                raise CheckpointError(f"{path} is corrupt: bad header entry for {name!r}") from err
            count = int(np.prod(shape, dtype=np.int64))
            if end - begin != count * dtype.itemsize or start + end > buf.size:
                raise CheckpointError(f"{path} is corrupt: tensor {name!r} has a bad byte range")
            tensors[name] = buf[start + begin : start + end].view(dtype).reshape(shape)
    return tensors


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write a single safetensors file (dtypes in ``_ST_DTYPES``)."""
    names = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        arr = np.asarray(tensors[name], order="C")  # ascontiguousarray would make a scalar 1-d
        blob = arr.tobytes()
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
