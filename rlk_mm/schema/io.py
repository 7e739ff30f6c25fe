"""Save and load a batch: one safetensors file, tensors plus the other fields as JSON.

Never pickle: a saved batch is tensors (spans as their CSR tensors) and a JSON metadata
record with the format name and version. ``RLBatch.save`` / ``RLBatch.load`` call these;
loading checks the invariants again. A saved file gets the permissions of any new file
(the umask's), so other users on the machine can read it unless the umask says otherwise.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Iterable

import torch

from .spans import SchemaError, SpanTable

__all__ = ["BatchFileError", "FORMAT", "FORMAT_VERSION", "load_fields", "save"]

FORMAT = "rlk_mm.RLBatch"
FORMAT_VERSION = "1"


class BatchFileError(SchemaError):
    """A saved batch cannot be read: corrupt, truncated, or not written by rlk_mm."""


def save(batch, path) -> Path:
    """Write ``batch`` (an RLBatch) to one safetensors file. Filesystem errors (a directory,
    a missing folder, no permission) raise the ``OSError`` naming the path."""
    from safetensors.torch import save_file

    if batch.device.type == "meta":
        raise ValueError("a batch on the meta device holds no values to save: save it before .to('meta')")
    tensors: dict[str, torch.Tensor] = {}
    meta: dict = {}
    for name in type(batch).model_fields:
        v = getattr(batch, name)
        if isinstance(v, SpanTable):
            tensors.update(v.tensors(name))
        elif isinstance(v, torch.Tensor):
            tensors[name] = v.detach().contiguous().cpu()
        else:
            meta[name] = v
    path = Path(path)
    with open(path, "ab"):  # a new file gets the umask's mode; an existing one keeps its own
        mode = stat.S_IMODE(os.stat(path).st_mode)
    # safetensors writes a private (0600) temporary file and renames it over the path
    save_file(tensors, str(path), metadata={"format": FORMAT, "version": FORMAT_VERSION, "fields": json.dumps(meta)})
    os.chmod(path, mode)
    return path


def load_fields(path, field_names: Iterable[str]) -> dict:
    """The fields a file written by ``save`` holds, checked against ``field_names``."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        raise BatchFileError(f"{path} is a directory, not a batch file: pass the .safetensors file RLBatch.save wrote")
    if not path.is_file():
        raise BatchFileError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises several types for bad headers/data
        raise BatchFileError(f"{path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if metadata.get("format") != FORMAT:
        raise BatchFileError(f"{path}: not an rlk_mm batch (format={metadata.get('format')!r})")
    if metadata.get("version") != FORMAT_VERSION:
        raise BatchFileError(f"{path}: batch format version {metadata.get('version')!r}, this rlk_mm reads {FORMAT_VERSION!r}")
    try:
        values = dict(json.loads(metadata["fields"]))
    except (KeyError, json.JSONDecodeError) as e:
        raise BatchFileError(f"{path}: batch metadata is damaged ({e})") from None
    names = list(field_names)
    for name in names:
        if name in values:
            continue
        if f"{name}.starts" in tensors:
            values[name] = SpanTable.from_tensors(tensors, name)
        elif name in tensors:
            values[name] = tensors[name]
    unknown = set(values) - set(names)
    if unknown:
        raise BatchFileError(f"{path}: unknown batch fields {sorted(unknown)}")
    return values
