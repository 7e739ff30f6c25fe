"""The Qwen2.5-VL runners' arguments (rlk_mm.models.qwen2_5_vl): one padding argument
(``padding=None`` packed, ``"left"``/``"right"``, ``rlk_mm.schema.PaddingSide``; the old
``layout=`` warns and still works) and the one temperature rule of every op and runner
(schema.checks.temperature_arg)."""

import math
import warnings

import pytest
import torch

from rlk_mm import RLBatch, models
from rlk_mm.fixtures import processor_inputs, synthetic_image_text
from rlk_mm.models.forward import batch_logprobs, forward_hidden, group_logprobs, layout_inputs
from rlk_mm.schema import PaddingSide
from rlk_mm.schema.checks import MIN_TEMPERATURE

IM_END = 151645


@pytest.fixture(scope="module")
def batch(processor):
    samples = synthetic_image_text(2, seed=3, max_images=1, sizes=[(56, 56), (84, 56)])
    responses = [processor.tokenizer.encode(t) + [IM_END] for t in ("red", "a blue one")]
    return RLBatch.from_qwen_vl(processor_inputs(processor, samples), processor=processor, responses=responses, group_ids=["a", "b"])


@pytest.mark.parametrize("runner", [batch_logprobs, group_logprobs], ids=["batch_logprobs", "group_logprobs"])
@pytest.mark.parametrize("temperature", [0, 1e-9, MIN_TEMPERATURE / 2, -1.0, math.nan, math.inf])
def test_runners_refuse_a_temperature_the_ops_refuse(tiny_model, batch, runner, temperature):
    """1e-9 used to pass the runners' "> 0" and fail later, inside selected_logprob."""
    with pytest.raises(ValueError, match=rf"temperature must be a finite number >= {MIN_TEMPERATURE}"):
        runner(tiny_model, batch, temperature=temperature)


@pytest.mark.parametrize("temperature", ["1", True, None])
def test_runners_refuse_a_temperature_that_is_no_number(tiny_model, batch, temperature):
    with pytest.raises(TypeError, match="temperature must be a number"):
        batch_logprobs(tiny_model, batch, temperature=temperature)


def test_the_smallest_temperature_runs(tiny_model, batch):
    with torch.no_grad():
        logp = batch_logprobs(tiny_model, batch, temperature=MIN_TEMPERATURE)
    assert logp.shape == (int(batch.loss_spans.token_counts().sum()),) and bool((logp <= 0).all())


# ----------------------------------------------------------------------------- padding
def _same_inputs(a, b):
    assert a[0].keys() == b[0].keys() and torch.equal(a[1], b[1])
    for key, value in a[0].items():
        assert (value is None and b[0][key] is None) or torch.equal(value, b[0][key]), key


@pytest.mark.parametrize("padding", [None, "left", "right", PaddingSide.LEFT, PaddingSide.RIGHT])
def test_layout_inputs_padding(batch, padding):
    inputs, rows = layout_inputs(batch, padding, 7)
    if padding is None:
        assert inputs["input_ids"].shape == (1, batch.num_tokens) and inputs["attention_mask"] is None
        assert torch.equal(rows, torch.arange(batch.num_tokens))
    else:
        width = int(batch.seq_lengths().max())
        assert inputs["input_ids"].shape == (2, width)
        ids = inputs["input_ids"].flatten()
        assert torch.equal(ids[rows], batch.input_ids)
        short = int(torch.argmin(batch.seq_lengths()))
        pad_at = 0 if PaddingSide(padding) is PaddingSide.LEFT else width - 1
        assert int(inputs["input_ids"][short, pad_at]) == 7 and int(inputs["attention_mask"][short, pad_at]) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new keyword never warns
        layout_inputs(batch, padding=padding)


@pytest.mark.parametrize("old,new", [("packed", None), ("left", "left"), ("right", "right")])
def test_the_old_layout_keyword_warns_and_gives_the_same_result(tiny_model, batch, old, new):
    with pytest.warns(DeprecationWarning, match=r"layout_inputs\(layout=\.\.\.\) is deprecated.*use padding="):
        _same_inputs(layout_inputs(batch, layout=old), layout_inputs(batch, new))
    with torch.no_grad():
        want = forward_hidden(tiny_model, batch, padding=new)
        with pytest.warns(DeprecationWarning, match=r"forward_hidden\(layout=\.\.\.\) is deprecated"):
            assert torch.equal(forward_hidden(tiny_model, batch, layout=old), want)
        want = batch_logprobs(tiny_model, batch, padding=new)
        with pytest.warns(DeprecationWarning, match=r"batch_logprobs\(layout=\.\.\.\) is deprecated"):
            assert torch.equal(batch_logprobs(tiny_model, batch, layout=old), want)
    with pytest.warns(DeprecationWarning, match=r"layout_inputs\(padding='packed'\) is deprecated: pass padding=None"):
        _same_inputs(layout_inputs(batch, "packed"), layout_inputs(batch))  # the old positional form


def test_bad_padding_names_the_argument_and_the_choices(tiny_model, batch):
    with pytest.raises(ValueError, match=r"padding='middle': expected None \(packed: one row, no padding\), 'left' or 'right'"):
        layout_inputs(batch, "middle")
    with pytest.raises(ValueError, match=r"padding='up'"):
        forward_hidden(tiny_model, batch, padding="up")
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=r"padding='packd': expected None"):
        forward_hidden(tiny_model, batch, layout="packd")
    with pytest.raises(TypeError, match=r"layout is the old name of padding; pass padding only"):
        batch_logprobs(tiny_model, batch, padding="left", layout="left")


def test_the_layout_enum_is_gone():
    """``padding=`` and ``rlk_mm.schema.PaddingSide`` replaced it before 0.1.0 was published."""
    for module in (models, models.qwen2_5_vl):
        with pytest.raises(AttributeError, match="has no attribute 'Layout'"):
            module.Layout


def test_signatures_show_the_padding_option():
    import inspect

    import rlk_mm

    assert rlk_mm.PaddingSide is PaddingSide and [p.value for p in PaddingSide] == ["left", "right"]
    for fn in (layout_inputs, forward_hidden, batch_logprobs):
        parameter = inspect.signature(fn).parameters["padding"]
        assert parameter.default is None and "PaddingSide" in str(parameter.annotation)
        assert "layout" not in inspect.signature(fn).parameters  # its deprecated name: rlk_mm.deprecations
