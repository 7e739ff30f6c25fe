"""What a batch's content identity rests on: the media cache keys, media ids, fingerprint, layout family,
grids and pixel rows must stay in step. ``RLBatch.load`` refuses a file changed after ``save`` (naming
the field and the item), every construction (``select``, ``concat``, the builders, ``load``) refuses a
key shared by different pixel rows, and ``to`` keeps every field as it is. A table of tampered files and
mixed batches (``context_cases``), and properties that swap keys and ids or change pixel rows at random."""

import json

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlk_mm import RLBatch
from rlk_mm.schema import BatchFileError, SchemaError
from support.context_cases import TRAINING, Case, Raises, Returns, assert_well, fail, make_schema_context, rewritten

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
REBUILD = r"the file was changed after RLBatch.save: rebuild the batch"


@pytest.fixture(scope="module")
def ctx(processor, tmp_path_factory):
    return make_schema_context(processor, tmp_path_factory.mktemp("identity"))


def swap(values: dict, name: str, i: int = 0, j: int = 2) -> None:
    values[name][i], values[name][j] = values[name][j], values[name][i]


def constructed(batch: RLBatch, **changes) -> RLBatch:
    """``batch`` with fields changed and nothing checked (as a framework that builds its own might hold it)."""
    return RLBatch.model_construct(**{**dict(batch), **changes})


def saved(c, batch: RLBatch, name: str):
    return batch.save(c.tmp / name)


def both_wide(c) -> torch.Tensor:
    """Pixel rows with item 1's rows replaced by item 0's (the 56x56 image) and item 2's left alone."""
    rows = c.batch.media_pixel_rows()
    return torch.cat([rows[0], rows[0] + 1, rows[2]])


def _load(path):
    return RLBatch.load(path)


BAD = [
    # ---- a file edited after save: each identity field, named with its item
    Case("load.keys.swapped", lambda c: _load(rewritten(c, "k.safetensors", fields=lambda v: swap(v, "media_cache_keys"))),
         Raises(BatchFileError, r"media_cache_keys\[0\] \(media item 0: image, grid \[1, 4, 4\]\) is '[0-9a-f]{64}' but the "
                                r"file was saved with '[0-9a-f]{64}' for that item.*VisionCache.*" + REBUILD)),
    Case("load.ids.swapped", lambda c: _load(rewritten(c, "i.safetensors", fields=lambda v: swap(v, "media_ids"))),
         Raises(BatchFileError, r"media_ids\[0\] \(media item 0: image, grid \[1, 4, 4\]\) is 'image-[0-9a-f]+' but the file "
                                r"was saved with 'image-[0-9a-f]+'")),
    Case("load.ids.one_dropped",
         lambda c: _load(rewritten(c, "i2.safetensors", fields=lambda v: v["media_ids"].pop())),
         Raises(BatchFileError, r"media_ids\[2\] \(media item 2: image, grid \[1, 4, 6\]\) is missing")),
    Case("load.key.edited",
         lambda c: _load(rewritten(c, "k2.safetensors", fields=lambda v: v["media_cache_keys"].__setitem__(2, "k"))),
         Raises(BatchFileError, r"media_cache_keys\[2\] \(media item 2: image, grid \[1, 4, 6\]\) is 'k'")),
    Case("load.fingerprint",
         lambda c: _load(rewritten(c, "f.safetensors", fields=lambda v: v.update(processor_fingerprint="0" * 64))),
         Raises(BatchFileError, r"processor_fingerprint is '0{64}', not the value saved: " + REBUILD)),
    Case("load.layout_family",
         lambda c: _load(rewritten(c, "l.safetensors", fields=lambda v: v.update(layout_family="qwen2_vl"))),
         Raises(BatchFileError, r"layout_family is 'qwen2_vl', not the value saved")),
    Case("load.image_token_id",
         lambda c: _load(rewritten(c, "t.safetensors", fields=lambda v: v.update(image_token_id=151656))),
         Raises(BatchFileError, r"image_token_id is 151656, not the value saved")),
    Case("load.grid.transposed",
         lambda c: _load(rewritten(c, "g.safetensors",
                                   tensors=lambda t: t["media_grid_thw"].__setitem__(2, torch.tensor([1, 6, 4])))),
         Raises(BatchFileError, r"media_grid_thw\[2\] \(media item 2, id 'image-[0-9a-f]+'\) is \[1, 6, 4\] but the file was "
                                r"saved with \[1, 4, 6\]")),
    Case("load.pixels.changed",
         lambda c: _load(rewritten(c, "p.safetensors", tensors=lambda t: t["pixel_values"][-3:].mul_(-1))),
         Raises(BatchFileError, r"media item 2 \('image-[0-9a-f]+'\): its pixel rows \(or its grid.*\) are not those saved")),
    Case("load.pixels.rows_moved",
         lambda c: _load(rewritten(c, "p2.safetensors", tensors=lambda t: t.update(pixel_values=t["pixel_values"].roll(1, 0)))),
         Raises(BatchFileError, r"media item 0 .*its pixel rows .* are not those saved")),
    Case("load.pixels.dtype",
         lambda c: _load(rewritten(c, "p3.safetensors", tensors=lambda t: t.update(pixel_values=t["pixel_values"].half()))),
         Raises(BatchFileError, r"pixel_values is not the tensor saved \(its digest differs\)")),
    Case("load.input_ids", lambda c: _load(rewritten(c, "ids.safetensors", tensors=lambda t: t["input_ids"][-1:].add_(1))),
         Raises(BatchFileError, r"input_ids is not the tensor saved \(its digest differs\): " + REBUILD)),
    Case("load.loss_spans", lambda c: _load(rewritten(c, "s.safetensors", tensors=lambda t: t["loss_spans.ends"][:1].sub_(1))),
         Raises(BatchFileError, r"loss_spans is not the tensor saved")),
    Case("load.rewards", lambda c: _load(rewritten(c, "r.safetensors", tensors=lambda t: t["rewards"].mul_(2))),
         Raises(BatchFileError, r"rewards is not the tensor saved")),
    Case("load.costs.dropped", lambda c: _load(rewritten(c, "c.safetensors", tensors=lambda t: t.pop("costs"))),
         Raises(BatchFileError, r"costs is not the tensor saved")),
    Case("load.group_ids", lambda c: _load(rewritten(c, "gr.safetensors", fields=lambda v: v.update(group_ids=["g", "h", "h"]))),
         Raises(BatchFileError, r"group_ids is \['g', 'h', 'h'\], not the value saved")),
    Case("load.unknown_tensor", lambda c: _load(rewritten(c, "u.safetensors", tensors=lambda t: t.update(extra=torch.zeros(1)))),
         Raises(BatchFileError, r"unknown batch fields \['extra'\]")),
    Case("load.tensor_and_value",
         lambda c: _load(rewritten(c, "tv.safetensors", tensors=lambda t: t.update(bbox_targets=torch.zeros(0, 4)))),
         Raises(BatchFileError, r"bbox_targets is both a tensor and a metadata value of the file")),
    Case("load.identity.damaged", lambda c: _load(rewritten(c, "d.safetensors", identity=lambda r: r["media"].pop())),
         Raises(BatchFileError, r"the identity record lists 2 media items; the batch has 3")),
    Case("load.identity.entry", lambda c: _load(rewritten(c, "d2.safetensors", identity=lambda r: r["media"][0].pop("key"))),
         Raises(BatchFileError, r"the identity record's media list is damaged")),
    Case("load.identity.fields", lambda c: _load(rewritten(c, "d3.safetensors", identity=lambda r: r["fields"].pop("rewards"))),
         Raises(BatchFileError, r"the identity record's field digests are damaged")),
    Case("load.identity.not_json", lambda c: _load(_rewrite_raw(c, "d4.safetensors", identity="{")),
         Raises(BatchFileError, r"batch metadata 'identity' is damaged \(JSONDecodeError")),
    # ---- keys that no longer name their pixels, in a file consistent with itself
    Case("load.keys.swapped.saved_so",
         lambda c: _load(saved(c, constructed(c.batch, media_cache_keys=[c.batch.media_cache_keys[i] for i in (2, 2, 0)]),
                               "ks.safetensors")),
         Raises(BatchFileError, r"media_cache_keys\[0\] \(media item 0, id 'image-[0-9a-f]+'\) is the key of media item 2's "
                                r"pixels, not of its own.*VisionCache would serve item 2's rows for item 0")),
    Case("load.keys.swapped.legacy",
         lambda c: _load(rewritten(c, "kl.safetensors", fields=lambda v: swap(v, "media_cache_keys"), drop=("identity",))),
         Raises(BatchFileError, r"media_ids: media items 0 and 1 share the id .* but have different media_cache_keys")),
    Case("load.keys_and_ids.swapped.legacy",
         lambda c: _load(rewritten(c, "kil.safetensors", fields=lambda v: (swap(v, "media_cache_keys", 0, 1),
                                                                            swap(v, "media_ids", 0, 1)),
                                   drop=("identity",), source=saved(c, _two_of_one_grid(c), "two.safetensors"))),
         Raises(BatchFileError, r"media_cache_keys\[0\] \(media item 0, .*\) is the key of media item 1's pixels, not of its "
                                r"own")),
    Case("load.key.stale",
         lambda c: _load(_stale_key(c)),
         Raises(BatchFileError, r"media_cache_keys\[1\] \(media item 1, .*\) was derived from the item's pixels but no longer "
                                r"names them")),
    # ---- one key over different pixel rows, however the batch is made
    Case("construct.key_over_two_contents",
         lambda c: RLBatch(**{**dict(c.batch), "pixel_values": both_wide(c)}),
         Raises(SchemaError, r"media_cache_keys: media items 0 and 1 share the key '[0-9a-f]{40}' but their pixel rows differ "
                             r"\(pixel_values row 16, row 0 of item 1\): a key names one vision-tower input")),
    Case("select.key_over_two_contents",
         lambda c: constructed(c.batch, pixel_values=both_wide(c)).select([1, 0]),
         Raises(SchemaError, r"media items 0 and 1 share the key .* but their pixel rows differ")),
    Case("concat.key_over_two_contents", lambda c: RLBatch.concat([_keyed(c, "k", 0), _keyed(c, "k", 1)]),
         Raises(SchemaError, r"media items 0 and 1 share the key 'k' but their pixel rows differ")),
    Case("concat.key_over_two_grids", lambda c: RLBatch.concat([_keyed(c, "k", 0), _keyed(c, "k", 0, sample=2)]),
         Raises(SchemaError, r"media items 0 and 1 share a key but have different grids \(\[1, 4, 4\] and \[1, 4, 6\]\)")),
]


GOOD = [
    Case("load.round_trip", lambda c: _load(c.path), Returns(lambda r, c: r.equals(c.batch) or fail(r))),
    Case("load.save_again", lambda c: _load(saved(c, _load(c.path), "again.safetensors")),
         Returns(lambda r, c: r.equals(c.batch) or fail(r))),
    Case("load.caller_keys_without_pixels",
         lambda c: _load(saved(c, _no_pixels(c), "np.safetensors")),
         Returns(lambda r, c: r.media_cache_keys == ["a", "a", "b"] and r.pixel_values is None or fail(r))),
    Case("load.caller_keys_with_pixels",
         lambda c: _load(saved(c, RLBatch.from_token_lists(c.prompts, c.responses, processor=c.processor,
                                                           image_grid_thw=c.batch.media_grid_thw,
                                                           pixel_values=c.batch.pixel_values, media_cache_keys=["x", "x", "y"]),
                               "ck.safetensors")),
         Returns(lambda r, c: r.media_cache_keys == ["x", "x", "y"] or fail(r))),
    Case("load.legacy_file", lambda c: _load(rewritten(c, "old.safetensors", drop=("identity",))),
         Returns(lambda r, c: r.equals(c.batch) or fail(r))),
    Case("load.file_before_a_field",  # a file of an rlk_mm that had no region_spans yet: the field is absent, its default
         lambda c: _load(rewritten(c, "pre.safetensors", fields=lambda v: v.pop("region_spans"),
                                   identity=lambda r: r["fields"].pop("region_spans"))),
         Returns(lambda r, c: r.equals(c.batch) or fail(r))),
    Case("load.fixture_without_record", lambda c: _load(TRAINING), Returns(lambda r, c: r.num_samples == 2 or fail(r))),
    Case("concat.one_key_one_content", lambda c: RLBatch.concat([c.batch.select([0]), c.batch.select([1, 2])]),
         Returns(lambda r, c: r.equals(c.batch) or fail(r))),
    Case("select.shared_key", lambda c: c.batch.select([1, 0, 1]),
         Returns(lambda r, c: len(set(r.media_cache_keys)) == 1 or fail(r))),
    Case("to.keeps_identity", lambda c: c.batch.to("cpu"),
         Returns(lambda r, c: r.equals(c.batch) and r.media_cache_keys is not c.batch.media_cache_keys or fail(r))),
]


def _rewrite_raw(c, name: str, **metadata) -> object:
    """The saved file with metadata entries replaced by raw strings."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(c.path), framework="pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    path = c.tmp / name
    save_file(tensors, str(path), metadata={**meta, **metadata})
    return path


def _stale_key(c):
    """Item 1's pixel rows changed both in the file and in its identity record (item 1 keeps item 0's key)."""
    batch = constructed(c.batch, pixel_values=both_wide(c))
    from rlk_mm.schema.io import media_record

    record = media_record(batch)
    return rewritten(c, "stale.safetensors", tensors=lambda t: t.update(pixel_values=batch.pixel_values),
                     identity=lambda r: r["media"][1].update(content=record[1]["content"]))


def _keyed(c, key: str, shift: float, sample: int = 0) -> RLBatch:
    """Sample ``sample``'s prompt as a one-sample batch whose image has the caller key ``key`` and
    its pixel rows plus ``shift`` (another content for another shift)."""
    return RLBatch.from_token_lists([c.prompts[sample]], [c.responses[sample]], processor=c.processor,
                                    image_grid_thw=c.batch.media_grid_thw[sample : sample + 1],
                                    pixel_values=c.batch.media_pixel_rows()[sample] + shift, media_cache_keys=[key])


def _two_of_one_grid(c) -> RLBatch:
    """Two samples of one grid and two contents, keys derived from their pixels."""
    return RLBatch.concat([_derived(c, 0.0), _derived(c, 1.0)])


def _derived(c, shift: float) -> RLBatch:
    return RLBatch.from_token_lists([c.prompts[0]], [c.responses[0]], processor=c.processor,
                                    image_grid_thw=c.batch.media_grid_thw[:1], pixel_values=c.batch.media_pixel_rows()[0] + shift)


def _no_pixels(c) -> RLBatch:
    return RLBatch.from_token_lists(c.prompts, c.responses, processor=c.processor, image_grid_thw=c.batch.media_grid_thw,
                                    media_cache_keys=["a", "a", "b"])


@pytest.mark.parametrize("case", BAD + GOOD, ids=lambda case: case.id)
def test_input(case, ctx):
    assert_well(case, ctx)


# ----------------------------------------------------------------------------- properties
@settings(max_examples=20, **SETTINGS)
@given(st.permutations(range(3)), st.sampled_from([("media_cache_keys",), ("media_ids",), ("media_ids", "media_cache_keys")]),
       st.booleans())
def test_a_file_whose_keys_or_ids_were_permuted_is_refused(ctx, order, names, legacy):
    """Any reordering of the keys, the ids or both in a saved file: the file loads as saved when no
    entry moved to an item of other content, else it is refused naming the first item whose entry
    changed (a file without the identity record: naming the key or id that no longer fits its item)."""
    saved_values = {name: getattr(ctx.batch, name) for name in names}
    moved = {name: [values[i] for i in order] for name, values in saved_values.items()}
    path = rewritten(ctx, f"perm-{len(names)}-{legacy}.safetensors", fields=lambda v: v.update(moved),
                     drop=("identity",) if legacy else ())
    name = names[0]  # media_ids precedes media_cache_keys among the fields
    first = next((g for g in range(3) if moved[name][g] != saved_values[name][g]), None)
    if first is None:
        assert RLBatch.load(path).equals(ctx.batch)
    elif legacy:
        with pytest.raises(BatchFileError, match=r"media_(cache_keys|ids)(\[\d\])?: .*(share|is the key of)"):
            RLBatch.load(path)
    else:
        with pytest.raises(BatchFileError, match=rf"{name}\[{first}\] \(media item {first}: image, grid .*\) is "
                                                 rf"'{moved[name][first]}' but the file was saved with '{saved_values[name][first]}'"):
            RLBatch.load(path)


@settings(max_examples=20, **SETTINGS)
@given(st.integers(0, 10_000), st.integers(0, 10_000), st.sampled_from([1e-3, -1.0, 7.0]))
def test_a_file_whose_pixel_value_changed_names_its_item(ctx, row, column, delta):
    """One pixel value of a saved file changed: the item owning that row is named."""
    pixels = ctx.batch.pixel_values
    r, k = row % pixels.shape[0], column % pixels.shape[1]
    path = rewritten(ctx, "one-pixel.safetensors", tensors=lambda t: t["pixel_values"][r, k].add_(delta))
    item = int(torch.searchsorted(torch.cumsum(ctx.batch.media_grid_thw.prod(1), 0), torch.tensor(r), right=True))
    with pytest.raises(BatchFileError, match=rf"media item {item} .*its pixel rows .* are not those saved"):
        RLBatch.load(path)


#: the four one-sample batches of the property below: (sample, pixel shift) = content A, A, B (A's grid), C (another grid)
PARTS = [(0, 0.0), (1, 0.0), (0, 1.0), (2, 0.0)]


@settings(max_examples=15, **SETTINGS)
@given(st.lists(st.sampled_from(["k0", "k1", "k2"]), min_size=4, max_size=4), st.permutations(range(4)))
def test_concat_refuses_a_key_over_two_contents(ctx, keys, order):
    """Caller keys over four one-sample batches (two of one content, one of another content of the same
    grid, one of another grid), concatenated in any order: the batch builds, saves and loads exactly
    when no key covers two contents; else the first pair is named, a grid clash before a pixel clash."""
    parts = [_keyed(ctx, keys[p], PARTS[p][1], sample=PARTS[p][0]) for p in order]
    content = [{0: "A", 1: "A", 2: "B", 3: "C"}[p] for p in order]
    named = [keys[p] for p in order]
    lead = [named.index(k) for k in named]
    pairs = [(lead[j], j) for j in range(4) if lead[j] != j]
    grids = [c == "C" for c in content]
    grid_clash = [(i, j) for i, j in pairs if grids[i] != grids[j]]
    row_clash = [(i, j) for i, j in pairs if content[i] != content[j]]
    if grid_clash:
        i, j = grid_clash[0]
        with pytest.raises(SchemaError, match=rf"media items {i} and {j} share a key but have different grids"):
            RLBatch.concat(parts)
    elif row_clash:
        i, j = row_clash[0]
        with pytest.raises(SchemaError, match=rf"media items {i} and {j} share the key '{named[j]}' but their pixel rows"):
            RLBatch.concat(parts)
    else:
        batch = RLBatch.concat(parts)
        assert batch.media_cache_keys == named
        assert RLBatch.load(batch.save(ctx.tmp / "keys.safetensors")).equals(batch)


def test_the_identity_record_is_json_beside_the_fields(ctx):
    """The record names every field and each item's id, key, modality, grid, content key and whether the key is derived."""
    from safetensors import safe_open

    with safe_open(str(ctx.path), framework="pt") as f:
        record = json.loads(f.metadata()["identity"])
    assert set(record["fields"]) == set(RLBatch.model_fields)
    assert [m["derived"] for m in record["media"]] == [True, True, True]
    assert [m["key"] for m in record["media"]] == ctx.batch.media_cache_keys
    assert record["media"][2]["grid"] == [1, 4, 6] and record["media"][0]["content"] == ctx.batch.media_cache_keys[0]
