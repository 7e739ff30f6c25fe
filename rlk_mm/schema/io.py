"""Save and load a batch: one safetensors file, tensors plus the other fields as JSON.

Never pickle: a saved batch is tensors (spans as their CSR tensors) and a JSON metadata
record with the format name and version. ``RLBatch.save`` / ``RLBatch.load`` call these.
A saved file gets the permissions of any new file (the umask's), so other users on the
machine can read it unless the umask says otherwise.

What a load trusts: nothing that identifies content. ``save`` writes, beside the fields, an
identity record: a digest of every field as written (pixel tensors by dtype and shape, their
values per item below), and per media item its id, cache key, modality, grid and the content
key of its pixel rows (``media_cache_key`` under the batch's fingerprint). ``load`` refuses,
naming the field and the item: a field whose value is not the one saved (a cache key or media
id swapped or edited, another fingerprint or layout family, a changed grid, ...); an item whose
pixel rows are not those saved with it; and a cache key that no longer names its item's pixels
(a key derived from the pixels, as the builders derive it, that now names another item's or no
item's), so that a shared ``VisionCache`` never serves one item's rows for another. The batch
invariants are checked again as for any construction. A file written before the record
existed is checked as far as it can be: its pixel digests (where it has them), and no derived
key may name another item's pixels.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path
from typing import Iterable, Optional

import torch

from .media import SETTINGS_SEPARATOR, content_key
from .spans import Modality, SchemaError, SpanTable

__all__ = ["BatchFileError"]

FORMAT = "rlk_mm.RLBatch"
FORMAT_VERSION = "1"
#: fields whose values are checked item by item (their record holds each item's value)
_PER_ITEM = {"media_ids": "id", "media_cache_keys": "key"}
_PIXELS = ("pixel_values", "pixel_values_videos")
_REBUILD = ("the file was changed after RLBatch.save: rebuild the batch from its media and tokens (or, if the change is "
            "meant, build the changed batch and save it again)")


class BatchFileError(SchemaError):
    """A saved batch cannot be read: corrupt, truncated, changed after saving, or not written by rlk_mm."""


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
    identity = {"fields": {name: _field_digest(name, meta, tensors) for name in type(batch).model_fields},
                "media": media_record(batch)}
    with open(path, "ab"):  # a new file gets the umask's mode; an existing one keeps its own
        mode = stat.S_IMODE(os.stat(path).st_mode)
    # safetensors writes a private (0600) temporary file and renames it over the path
    metadata = {"format": FORMAT, "version": FORMAT_VERSION, "fields": json.dumps(meta), "identity": json.dumps(identity)}
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, mode)
    return path


# ----------------------------------------------------------------------------- digests
def _tensor_digest(h, t: torch.Tensor, values: bool = True) -> None:
    t = t.detach().contiguous().cpu()
    h.update(f"{t.dtype}{tuple(t.shape)}|".encode())
    if values:
        h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())


def _field_digest(name: str, values: dict, tensors: dict) -> str:
    """The digest of field ``name`` as a file holds it: its JSON value, its tensor, or its span
    table's tensors; a pixel tensor by dtype and shape (its values per item, ``media_record``)."""
    h = hashlib.sha256(name.encode() + b"|")
    if name in values:
        h.update(json.dumps(values[name], sort_keys=True).encode())
    elif name in tensors:
        _tensor_digest(h, tensors[name], values=name not in _PIXELS)
    else:
        parts = sorted(k for k in tensors if k.startswith(f"{name}."))
        for k in parts:
            h.update(k.encode())
            _tensor_digest(h, tensors[k])
        if not parts:
            h.update(b"absent")
    return h.hexdigest()


def media_record(batch) -> list[dict]:
    """Each media item's id, cache key, modality, grid, the content key of its pixel rows under
    the batch's fingerprint (None where the batch keeps no pixels) and whether its cache key is
    derived from them (the builders' keys; a caller's own key is not)."""
    out = []
    for g, rows in enumerate(batch.media_pixel_rows()):
        label = Modality(int(batch.media_modality[g])).label
        grid = batch.media_grid_thw[g].tolist()
        content = None if rows is None else content_key(rows, grid, label, batch.processor_fingerprint)
        key = batch.media_cache_keys[g]
        out.append({"id": batch.media_ids[g], "key": key, "modality": label, "grid": grid, "content": content,
                    "derived": content is not None and key.partition(SETTINGS_SEPARATOR)[0] == content})
    return out


# ----------------------------------------------------------------------------- load
def load_fields(path, field_names: Iterable[str]) -> tuple[dict, dict]:
    """The fields a file written by ``save`` holds, checked against ``field_names`` and against the
    file's identity record (a field whose value is not the one saved is refused, naming it and,
    for per-item fields, the item), and what ``check_media`` needs (``record``)."""
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
    values = _json(path, metadata, "fields", dict)
    names = list(field_names)
    unknown = set(values) - set(names)
    owners = {k.split(".", 1)[0] if "." in k else k for k in tensors}
    unknown |= owners - set(names)
    if unknown:
        raise BatchFileError(f"{path}: unknown batch fields {sorted(unknown)}")
    twice = sorted(owners & set(values))
    if twice:
        raise BatchFileError(f"{path}: {twice[0]} is both a tensor and a metadata value of the file: {_REBUILD}")
    record = {"identity": _json(path, metadata, "identity", dict) if "identity" in metadata else None,
              "digests": _json(path, metadata, "media_digests", list) if "media_digests" in metadata else None}
    if record["identity"] is not None:
        _check_fields(path, record["identity"], names, values, tensors)
    for name in names:
        if name in values:
            continue
        if f"{name}.starts" in tensors:
            try:
                values[name] = SpanTable.from_tensors(tensors, name)
            except (SchemaError, TypeError, ValueError) as e:
                raise BatchFileError(f"{path}: {name}: {e}") from None
        elif name in tensors:
            values[name] = tensors[name]
    return values, record


def _json(path, metadata: dict, key: str, kind: type):
    try:
        value = json.loads(metadata[key])
    except (KeyError, TypeError, json.JSONDecodeError) as e:
        raise BatchFileError(f"{path}: batch metadata {key!r} is damaged ({type(e).__name__}: {e})") from None
    if not isinstance(value, kind):
        raise BatchFileError(f"{path}: batch metadata {key!r} is damaged (a {type(value).__name__}, not a {kind.__name__})")
    return value


def _media_entries(path, identity: dict) -> list[dict]:
    media = identity.get("media")
    keys = {"id", "key", "modality", "grid", "content", "derived"}
    if not isinstance(media, list) or not all(isinstance(m, dict) and set(m) == keys for m in media):
        raise BatchFileError(f"{path}: the identity record's media list is damaged: {_REBUILD}")
    return media


def _check_fields(path, identity: dict, names: list[str], values: dict, tensors: dict) -> None:
    """Every field's digest is the one saved; the first that is not is refused, by name (and item)."""
    saved = identity.get("fields")
    held = {k.split(".", 1)[0] for k in tensors} | set(values)
    if not isinstance(saved, dict) or not set(saved) <= set(names) or not held <= set(saved):
        raise BatchFileError(f"{path}: the identity record's field digests are damaged (they name "
                             f"{sorted(saved) if isinstance(saved, dict) else saved!r:.200}): {_REBUILD}")
    media = _media_entries(path, identity)
    for name in saved:  # a field of a later rlk_mm that the file predates is absent from it: its default
        if _field_digest(name, values, tensors) == saved[name]:
            continue
        now = values.get(name)
        if name in _PER_ITEM and isinstance(now, list):
            entry = _PER_ITEM[name]
            for g, m in enumerate(media):
                if g >= len(now) or now[g] != m[entry]:
                    got = "missing" if g >= len(now) else repr(now[g])
                    raise BatchFileError(f"{path}: {name}[{g}] (media item {g}: {m['modality']}, grid {m['grid']}) is "
                                         f"{got} but the file was saved with {m[entry]!r} for that item; a {entry} that "
                                         f"names another item's content makes a shared VisionCache serve the wrong rows: "
                                         f"{_REBUILD}")
            raise BatchFileError(f"{path}: {name} lists {len(now)} items; the file was saved with {len(media)}: {_REBUILD}")
        if name == "media_grid_thw" and isinstance(tensors.get(name), torch.Tensor):
            grids = tensors[name].tolist()
            for g, m in enumerate(media):
                if g >= len(grids) or grids[g] != m["grid"]:
                    raise BatchFileError(f"{path}: media_grid_thw[{g}] (media item {g}, id {m['id']!r}) is "
                                         f"{grids[g] if g < len(grids) else 'missing'} but the file was saved with "
                                         f"{m['grid']}: {_REBUILD}")
        what = f"is {now!r:.120}, not the value saved" if name in values else "is not the tensor saved (its digest differs)"
        raise BatchFileError(f"{path}: {name} {what}: {_REBUILD}")


def check_media(batch, record: dict, path) -> None:
    """Each media item's pixel rows are those saved with it, and its cache key, where derived from
    its pixels, names them and no other item's (``record``: what ``load_fields`` returned)."""
    if record["identity"] is not None:
        media = _media_entries(path, record["identity"])
        if len(media) != batch.num_media:
            raise BatchFileError(f"{path}: the identity record lists {len(media)} media items; the batch has "
                                 f"{batch.num_media}: {_REBUILD}")
        now = media_record(batch)
        contents = [item["content"] for item in now]
        for g, (saved, item) in enumerate(zip(media, now)):
            if item["content"] != saved["content"]:
                raise BatchFileError(f"{path}: media item {g} ({batch.media_ids[g]!r}): its pixel rows (or its grid, "
                                     "modality or the batch's processor_fingerprint) are not those saved with its cache key "
                                     f"{batch.media_cache_keys[g][:16]}...: {_REBUILD}")
            if saved["derived"] and not item["derived"]:
                raise BatchFileError(f"{path}: media_cache_keys[{g}] (media item {g}, id {batch.media_ids[g]!r}) was derived "
                                     "from the item's pixels but no longer names them: a shared VisionCache would serve "
                                     f"other rows under it: {_REBUILD}")
    else:
        contents = [m["content"] for m in media_record(batch)]
        if record["digests"] is not None:
            _check_legacy_digests(batch, record["digests"], path)
    _check_derived_keys(batch, contents, path)


def _check_derived_keys(batch, contents: list[Optional[str]], path) -> None:
    """A cache key derived from pixels (its part before any settings tag is a content key of the
    batch) names its own item's pixels: one that names another item's is refused."""
    owner = {c: g for g, c in enumerate(contents) if c is not None}
    for g, key in enumerate(batch.media_cache_keys):
        base = key.partition(SETTINGS_SEPARATOR)[0]
        j = owner.get(base)
        if j is not None and contents[g] != base:
            raise BatchFileError(f"{path}: media_cache_keys[{g}] (media item {g}, id {batch.media_ids[g]!r}) is the key of "
                                 f"media item {j}'s pixels, not of its own: the keys were swapped or edited, and a shared "
                                 f"VisionCache would serve item {j}'s rows for item {g}: {_REBUILD}")


def _check_legacy_digests(batch, digests: list, path) -> None:
    """A file written before the identity record: each item's pixel rows against the digest saved with them."""
    if len(digests) != batch.num_media:
        raise BatchFileError(f"{path}: media_digests lists {len(digests)} entries; the batch has {batch.num_media} media items")
    rows = batch.media_pixel_rows()
    for g, (saved, r) in enumerate(zip(digests, rows)):
        label = Modality(int(batch.media_modality[g])).label
        now = None if r is None else content_key(r, batch.media_grid_thw[g].tolist(), label, "")
        if saved != now:
            raise BatchFileError(f"{path}: media item {g} ({batch.media_ids[g]!r}): its pixel rows are not those saved with "
                                 f"its cache key {batch.media_cache_keys[g][:16]}...: {_REBUILD}")
