"""Save and load a batch: one safetensors file, tensors plus the other fields as JSON.

Never pickle: a saved batch is tensors (spans as their CSR tensors) and a JSON metadata
record with the format name and version. ``RLBatch.save`` / ``RLBatch.load`` call these;
loading checks the invariants again, and each media item's pixel rows against the digest
saved with them (so a file whose pixels changed never loads with its old cache keys). A saved file gets the permissions of any new file
(the umask's), so other users on the machine can read it unless the umask says otherwise.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Iterable, Optional

import torch

from .media import content_key
from .spans import Modality, SchemaError, SpanTable

__all__ = ["BatchFileError"]

FORMAT = "rlk_mm.RLBatch"
FORMAT_VERSION = "1"


class BatchFileError(SchemaError):
    """A saved batch cannot be read: corrupt, truncated, or not written by rlk_mm."""


def path_arg(name: str, value) -> Path:
    """``value`` as a ``Path``: a non-empty str or an ``os.PathLike`` (never None, bytes or a number)."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value:
        raise TypeError(f"{name} must be a file path (a non-empty str or pathlib.Path), got {type(value).__name__} {value!r:.60}")
    return Path(value)


def save(batch, path) -> Path:
    """Write ``batch`` (an RLBatch) to one safetensors file. Filesystem errors (a directory,
    a missing folder, no permission) raise the ``OSError`` naming the path."""
    from safetensors.torch import save_file

    if batch.device.type == "meta":
        raise ValueError("a batch on the meta device holds no values to save: save it before .to('meta')")
    path = path_arg("path", path)
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
    with open(path, "ab"):  # a new file gets the umask's mode; an existing one keeps its own
        mode = stat.S_IMODE(os.stat(path).st_mode)
    # safetensors writes a private (0600) temporary file and renames it over the path
    metadata = {"format": FORMAT, "version": FORMAT_VERSION, "fields": json.dumps(meta),
                "media_digests": json.dumps(media_digests(batch))}
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, mode)
    return path


def media_digests(batch) -> list[Optional[str]]:
    """A digest of each media item's pixel rows, grid and modality (None where the batch keeps no pixels)."""
    rows = batch.media_pixel_rows()
    labels = [] if batch.media_modality is None else [Modality(m).label for m in batch.media_modality.tolist()]
    return [None if r is None else content_key(r, batch.media_grid_thw[g].tolist(), labels[g], "") for g, r in enumerate(rows)]


def check_media_digests(batch, digests: Optional[list], path) -> None:
    """Each media item's pixel rows are those saved with its cache key (``digests``: the file's
    ``media_digests``; None for a file written before they were saved)."""
    if digests is None:
        return
    if not isinstance(digests, list) or len(digests) != batch.num_media:
        raise BatchFileError(f"{path}: media_digests lists {len(digests) if isinstance(digests, list) else digests!r} "
                             f"entries; the batch has {batch.num_media} media items")
    for g, (saved, now) in enumerate(zip(digests, media_digests(batch))):
        if saved != now:
            raise BatchFileError(f"{path}: media item {g} ({batch.media_ids[g]!r}): its pixel rows are not those saved with "
                                 f"its cache key {batch.media_cache_keys[g][:16]}...: the file was changed after RLBatch.save; "
                                 "rebuild the batch from its media")


def load_fields(path, field_names: Iterable[str]) -> tuple[dict, Optional[list]]:
    """The fields a file written by ``save`` holds, checked against ``field_names``, and its
    media digests (None in a file that has none)."""
    from safetensors import safe_open

    path = path_arg("path", path)
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
    try:
        digests = json.loads(metadata["media_digests"]) if "media_digests" in metadata else None
    except json.JSONDecodeError as e:
        raise BatchFileError(f"{path}: media_digests is damaged ({e})") from None
    return values, digests
