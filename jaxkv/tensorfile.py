"""Safetensors checkpoints, read and written with the ``safetensors`` package (no torch).

``read_safetensors(folder_or_file)`` opens every weights file of a folder (one
``model.safetensors``, ``*.safetensors`` shards, or the shards an
``model.safetensors.index.json`` names) or one file, and returns a
``SafetensorsTensors`` mapping: name -> ``LazyTensor``. Opening parses and checks
each file's header (``safetensors.safe_open``, which memory-maps the file) but
reads no tensor data; a ``LazyTensor`` knows its ``shape`` and ``dtype`` from the
header and reads its bytes only when converted (``np.asarray(t)``), so a loader
holds one tensor at a time in host memory. bfloat16 tensors come back as
``ml_dtypes.bfloat16`` arrays (the package's numpy backend uses ml_dtypes).

``write_safetensors(path, tensors)`` writes one file with
``safetensors.numpy.save_file``, through a temporary file renamed into place, so a
failed write never leaves a partial file under ``path``.

Errors (each names the file): a missing file or shard -> ``CheckpointNotFoundError``;
a truncated file, an unreadable header, an index that is not JSON or names a tensor
its shard lacks, a tensor held by two shards -> ``CheckpointError``. All of them
are raised by ``read_safetensors`` before any tensor is read. Used by checkpoint
loading (``jaxkv.models.loading``) and by small artefacts such as the IntentKV head.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxkv.errors import CheckpointError, CheckpointNotFoundError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class LazyTensor:
    """One tensor of an open safetensors file: ``shape`` / ``dtype`` from the header,
    the data read on ``np.asarray(tensor)`` (a fresh array each time)."""

    def __init__(self, handle, path: Path, name: str):
        info = handle.get_slice(name)
        self._handle, self.path, self.name = handle, path, name
        self.shape = tuple(int(n) for n in info.get_shape())
        self.dtype_name = info.get_dtype()  # the file's name for it: "F32", "BF16", ...

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __array__(self, dtype=None, copy=None):
        try:
            arr = self._handle.get_tensor(self.name)
        except (SafetensorError, TypeError, ValueError) as err:
            raise CheckpointError(f"{self.path}: tensor {self.name!r} ({self.dtype_name}) cannot be read: {err}") from err
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={self.shape}, dtype={self.dtype_name}, file={self.path.name})"


class SafetensorsTensors(Mapping):
    """name -> ``LazyTensor`` over the open files of one checkpoint."""

    def __init__(self, tensors: dict[str, LazyTensor]):
        self._tensors = tensors

    def __getitem__(self, name: str) -> LazyTensor:
        return self._tensors[name]

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _open(path: Path):
    if not path.is_file():
        raise CheckpointNotFoundError(f"weights file {path} is missing")
    try:
        return safe_open(str(path), framework="numpy")
    except SafetensorError as err:
        raise CheckpointError(f"{path} is truncated or corrupt: {err}") from err
    except OSError as err:
        raise CheckpointError(f"{path} cannot be opened: {err}") from err


def _index_weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index} is corrupt: {err}") from err
    return weight_map


def _safetensors_files(folder: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The weights files of ``folder`` and the index's weight map (None without one)."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = _index_weight_map(index)
        files = sorted({folder / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointNotFoundError(f"shards named in {index.name} are missing: {', '.join(missing)}")
        return files, weight_map
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE], None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"{folder} has no *.safetensors weights")
    return files, None


def read_safetensors(folder_or_file) -> SafetensorsTensors:
    """Every tensor of a checkpoint folder (or of one ``.safetensors`` file), lazily.

    All headers are opened and checked here; no tensor data is read (see the
    module docstring for the errors)."""
    where = Path(folder_or_file)
    files, weight_map = ([where], None) if where.suffix == ".safetensors" and not where.is_dir() else _safetensors_files(where)
    tensors: dict[str, LazyTensor] = {}
    for path in files:
        handle = _open(path)
        for name in handle.keys():
            if name in tensors:
                raise CheckpointError(f"tensor {name!r} is in both {tensors[name].path.name} and {path.name}")
            tensors[name] = LazyTensor(handle, path, name)
    if weight_map is not None:
        absent = [name for name, file in weight_map.items() if name not in tensors or tensors[name].path.name != Path(file).name]
        if absent:
            raise CheckpointError(f"{INDEX_FILE} names tensor(s) its shards do not hold: {', '.join(sorted(absent)[:5])}")
    return SafetensorsTensors(tensors)


def write_safetensors(path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write ``tensors`` (numpy arrays, any dtype the package's numpy backend takes,
    bfloat16 included) to one safetensors file at ``path``."""
    path = Path(path)
    arrays = {name: np.asarray(tensors[name], order="C") for name in sorted(tensors)}
    partial = path.with_name(path.name + ".partial")
    try:
        save_file(arrays, str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
