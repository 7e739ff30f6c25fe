"""The ops' public API surface: option enums, signatures, renamed arguments and ``batch=``.

- ``rlk_mm.ops.options``: every option set is a documented ``Choice``, accepting a member or
  its string wherever an op takes it; signatures annotate them, and ``help()`` lists them;
- each renamed keyword (``kl_penalty(kind=)``, ``scatter_rewards(loss_spans=)``,
  ``unpack_to_padded(side=)``) still works for one release, warns naming the new name, and
  gives bitwise the same result;
- the reward and advantage ops take ``batch=`` as the log-prob ops do;
- one backend resolver: a bad name is a ``ValueError`` naming the argument, Triton where it
  cannot run is ``BackendUnavailableError`` (a RuntimeError and a ValueError) everywhere.
"""

import inspect
import pydoc
import warnings

import pytest
import torch

import rlk_mm.ops as ops
from rlk_mm.ops import options
from rlk_mm.ops._backend import BackendUnavailableError, backend_arg, resolve_backend
from rlk_mm.schema import RLBatch, Span, SpanTable
from support.helpers import use_backend

OPTION_SETS = [options.AggMode, options.KLType, options.RatioMode, options.Estimator, options.RewardPlacement,
               options.Backend]


# ----------------------------------------------------------------------------- the enums
@pytest.mark.parametrize("enum", OPTION_SETS, ids=lambda e: e.__name__)
def test_option_sets_are_documented_choices_in_one_public_home(enum):
    from rlk_mm.schema.choice import Choice

    assert issubclass(enum, Choice) and enum.__module__ == "rlk_mm.ops.options"
    assert getattr(ops, enum.__name__) is enum
    for member in enum:
        assert member.__doc__ and member.__doc__ != enum.__doc__, member  # one line of its own
        assert enum.parse(member.value, "x") is member and enum.parse(member, "x") is member
        assert member == member.value and str(member) == member.value
        assert f"{member.value!r}" in enum.__doc__  # help(enum) lists it
    with pytest.raises(ValueError, match=r"my_arg='nope': expected one of"):
        enum.parse("nope", "my_arg")
    first = next(iter(enum)).value
    for bad in ("nope", None, 3):  # the class called directly lists its values too
        with pytest.raises(ValueError, match=rf"{bad!r} is not a valid {enum.__name__}: expected one of {first}"):
            enum(bad)


def test_padding_side_is_served_from_options_and_schema():
    from rlk_mm.schema import PaddingSide

    assert options.PaddingSide is PaddingSide is ops.PaddingSide


def test_the_ops_modules_use_the_one_home_of_the_enums():
    from rlk_mm.ops import rewards
    from rlk_mm.ops.loss import op as loss

    assert loss.AggMode is options.AggMode and loss.KLType is options.KLType and loss.RatioMode is options.RatioMode
    assert rewards.Estimator is options.Estimator and rewards.RewardPlacement is options.RewardPlacement


def test_ops_take_members_and_strings_alike():
    g = torch.Generator().manual_seed(0)
    scores, ids = torch.randn(8, generator=g), torch.arange(4).repeat_interleave(2)
    for est in options.Estimator:
        assert torch.equal(ops.group_advantages(scores, ids, estimator=est),
                           ops.group_advantages(scores, ids, estimator=est.value))
    x, m = torch.randn(3, 4, generator=g), torch.rand(3, 4, generator=g) > 0.3
    for mode in (options.AggMode.TOKEN_MEAN, options.AggMode.SEQ_MEAN_TOKEN_MEAN, options.AggMode.SEQ):
        assert torch.equal(ops.agg_loss(x, m, mode), ops.agg_loss(x, m, mode.value))
    logp, ref = torch.randn(5, generator=g), torch.randn(5, generator=g)
    for kl in options.KLType:
        assert torch.equal(ops.kl_penalty(logp, ref, kl), ops.kl_penalty(logp, ref, kl.value))


SIGNATURES = [  # (op, parameter, an option set its annotation names)
    ("agg_loss", "loss_agg_mode", "AggMode"),
    ("kl_penalty", "kl_type", "KLType"),
    ("group_advantages", "estimator", "Estimator"),
    ("lagrangian_advantages", "estimator", "Estimator"),
    ("scatter_rewards", "mode", "RewardPlacement"),
    ("unpack_to_padded", "padding", "PaddingSide"),
    ("sample", "backend", "Backend"),
    ("sample_from_hidden", "backend", "Backend"),
    ("batch_invariant", "backend", "Backend"),
    ("linear_policy_loss", "padding", "PaddingSide"),
]


@pytest.mark.parametrize("op, parameter, enum", SIGNATURES, ids=[f"{o}.{p}" for o, p, _ in SIGNATURES])
def test_signatures_annotate_options_and_help_lists_them(op, parameter, enum):
    fn = getattr(ops, op)
    annotation = str(inspect.signature(fn).parameters[parameter].annotation)
    assert enum in annotation and "str" in annotation, annotation
    assert enum in pydoc.render_doc(fn), "help() names the option set"


def test_policy_loss_config_fields_annotate_their_options():
    fields = {f.name: str(f.type) for f in __import__("dataclasses").fields(ops.PolicyLossConfig)}
    assert "RatioMode" in fields["ratio"] and "KLType" in fields["kl_type"] and "AggMode" in fields["loss_agg_mode"]
    text = pydoc.render_doc(ops.policy_loss)
    assert "PolicyLossConfig" in text and "RatioMode" in text and "AggMode" in text and "KLType" in text


# ----------------------------------------------------------------------------- renamed keywords
def _warns_new_name(new: str):
    return pytest.warns(DeprecationWarning, match=rf"use {new}=")


def test_kl_penalty_kind_is_kl_type():
    g = torch.Generator().manual_seed(1)
    logp, ref = torch.randn(6, generator=g), torch.randn(6, generator=g)
    for name in ("k1", "k3", "low_var_kl", "k3+"):
        new = ops.kl_penalty(logp, ref, kl_type=name)
        with _warns_new_name("kl_type"):
            old = ops.kl_penalty(logp, ref, kind=name)
        assert torch.equal(new, old) and torch.equal(new, ops.kl_penalty(logp, ref, name))
    with pytest.raises(TypeError, match="kind is the old name of kl_type"):
        ops.kl_penalty(logp, ref, kind="k1", kl_type="k1")


def _loss_table():
    return SpanTable.from_lists([[Span(1, 4)], [Span(2, 3), Span(4, 6)]])


def test_scatter_rewards_loss_spans_is_batch():
    table, rewards = _loss_table(), torch.tensor([1.0, -2.0])
    new = ops.scatter_rewards(table, rewards, mode="spread")
    with _warns_new_name("batch"):
        old = ops.scatter_rewards(loss_spans=table, rewards=rewards, mode="spread")
    assert torch.equal(new, old) and torch.equal(new, ops.scatter_rewards(batch=table, rewards=rewards, mode="spread"))


def test_unpack_to_padded_side_is_padding():
    x = torch.arange(10.0).reshape(2, 5)
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    packed, cu = ops.pack_padded(x, mask)
    for how in ("left", "right", options.PaddingSide.LEFT, mask):
        new = ops.unpack_to_padded(packed, cu, 5, padding=how)
        with _warns_new_name("padding"):
            old = ops.unpack_to_padded(packed, cu, 5, side=how)
        assert torch.equal(new, old) and torch.equal(new, ops.unpack_to_padded(packed, cu, 5, how))


def test_renamed_keywords_keep_the_signature():
    assert "kind" not in inspect.signature(ops.kl_penalty).parameters
    assert list(inspect.signature(ops.scatter_rewards).parameters)[0] == "batch"
    assert "side" not in inspect.signature(ops.unpack_to_padded).parameters


def test_no_warning_without_the_old_names():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ops.kl_penalty(torch.zeros(2), torch.zeros(2), "k2")
        ops.scatter_rewards(_loss_table(), torch.ones(2))


# ----------------------------------------------------------------------------- batch=
def _batch(group_ids, rewards=None):
    B, L = len(group_ids), 6
    return RLBatch(
        input_ids=torch.arange(B * L), cu_seqlens=torch.arange(0, B * L + 1, L, dtype=torch.int32),
        position_ids=torch.arange(B * L).expand(3, B * L).clone(),
        modality_spans=SpanTable.from_lists([[Span(0, L)]] * B), loss_spans=SpanTable.from_lists([[Span(3, L)]] * B),
        processor_fingerprint="test", group_ids=group_ids, rewards=rewards,
    )


def test_group_advantages_takes_a_batch():
    batch = _batch(["a", "b", "a", "c", "b", "a"])
    scores = torch.tensor([1.0, 2.0, 0.5, 3.0, -1.0, 2.5])
    expected = ops.group_advantages(scores, batch.group_index())
    assert torch.equal(ops.group_advantages(scores, batch=batch), expected)
    assert torch.equal(ops.group_advantages(scores, batch=batch, estimator="rloo"),
                       ops.group_advantages(scores, batch.group_index(), estimator="rloo"))
    with pytest.raises(TypeError, match="either group_ids or batch=, not both"):
        ops.group_advantages(scores, batch.group_index(), batch=batch)
    with pytest.raises(TypeError, match=r"give the groups: group_ids .* or batch="):
        ops.group_advantages(scores)
    with pytest.raises(TypeError, match="batch must be an RLBatch, got list"):
        ops.group_advantages(scores, batch=[0, 1])


def test_lagrangian_advantages_take_a_batch():
    batch = _batch(["a", "a", "b", "b"])
    rewards, costs, lam = torch.tensor([1.0, 0.0, 2.0, 1.0]), torch.tensor([0.5, 0.1, 0.0, 0.3]), torch.tensor(0.4)
    a = ops.lagrangian_advantages(rewards, costs, batch.group_index(), lam)
    b = ops.lagrangian_advantages(rewards, costs, lam=lam, batch=batch)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    lagrangian = ops.Lagrangian(0.2, init=0.4)
    assert all(torch.equal(x, y) for x, y in zip(lagrangian.advantages(rewards, costs, batch=batch), a))
    with pytest.raises(TypeError, match="needs lam"):
        ops.lagrangian_advantages(rewards, costs, batch=batch)


def test_scatter_rewards_takes_the_batch_or_its_loss_spans():
    batch = _batch(["a", "b"], rewards=torch.tensor([1.0, -1.0]))
    assert torch.equal(ops.scatter_rewards(batch), ops.scatter_rewards(batch.loss_spans, batch.rewards))
    assert torch.equal(ops.scatter_rewards(batch=batch), ops.scatter_rewards(batch))


# ----------------------------------------------------------------------------- the backend resolver
@pytest.fixture
def no_interpreter(monkeypatch):
    """Triton's interpreter off, as on a machine with neither CUDA nor TRITON_INTERPRET=1."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def test_backend_names_are_checked_naming_the_argument():
    B = options.Backend
    assert backend_arg(None) is B.AUTO and backend_arg("auto") is B.AUTO and backend_arg(B.TORCH) is B.TORCH
    assert backend_arg("triton") is B.TRITON
    for bad in ("cuda", 1, "flashinfer", ["torch"]):
        with pytest.raises(ValueError, match=r"backend=.*: backend must be None, 'torch' or 'triton'"):
            backend_arg(bad)
    logits, seeds = torch.randn(2, 8), torch.arange(2)
    with pytest.raises(ValueError, match=r"backend='cuda': backend must be None, 'torch', 'triton' or 'flashinfer'"):
        ops.sample(logits, seeds=seeds, backend="cuda")
    with pytest.raises(ValueError, match=r"backend='cuda': backend must be None, 'torch' or 'triton'"):
        ops.batch_invariant(backend="cuda").__enter__()
    x = torch.zeros(2, 3)
    with use_backend("cuda"), pytest.raises(ValueError, match=r"RLK_MM_BACKEND='cuda': expected one of auto, torch"):
        ops.policy_loss(x, x, x)
    with use_backend("flashinfer"), pytest.raises(ValueError, match=r"RLK_MM_BACKEND='flashinfer'"):
        resolve_backend(on_cuda=False)


def test_resolution_order_argument_then_environment_then_device():
    B = options.Backend
    with use_backend("torch"):
        assert resolve_backend(on_cuda=True) is B.TORCH
        assert resolve_backend(B.TRITON, on_cuda=True) is B.TRITON
    with use_backend("auto"):
        assert resolve_backend(on_cuda=True) is B.TRITON and resolve_backend(on_cuda=False) is B.TORCH
        assert resolve_backend(B.TORCH, on_cuda=True) is B.TORCH


def test_triton_without_cuda_or_interpreter_is_one_error_type(no_interpreter):
    assert issubclass(BackendUnavailableError, RuntimeError) and issubclass(BackendUnavailableError, ValueError)
    assert ops.BackendUnavailableError is BackendUnavailableError
    logits, seeds = torch.randn(2, 8), torch.arange(2)
    calls = {
        "sample(backend=)": lambda: ops.sample(logits, seeds=seeds, backend="triton"),
        "sample_from_hidden(backend=)": lambda: ops.sample_from_hidden(
            torch.randn(2, 4), torch.randn(8, 4), seeds=seeds, backend=options.Backend.TRITON),
        "batch_invariant(backend=)": lambda: ops.batch_invariant(backend="triton").__enter__(),
    }
    for name, call in calls.items():
        with pytest.raises(BackendUnavailableError, match=r"'triton'.* needs TRITON_INTERPRET=1"):
            call()
    with use_backend("triton"):
        x = torch.zeros(2, 3)
        for call in (lambda: ops.policy_loss(x, x, x), lambda: ops.batch_invariant().__enter__(),
                     lambda: ops.sample(logits, seeds=seeds)):
            with pytest.raises(BackendUnavailableError, match=r"RLK_MM_BACKEND='triton'.* needs TRITON_INTERPRET=1"):
                call()


# ----------------------------------------------------------------------------- one temperature rule, one dtype tuple
def test_every_op_applies_the_one_temperature_rule():
    from rlk_mm.schema.checks import MIN_TEMPERATURE
    from rlk_mm.schema.checks import MIN_TEMPERATURE as RULE

    assert MIN_TEMPERATURE == RULE == 1e-5
    h, w, seeds = torch.randn(3, 8), torch.randn(10, 8), torch.arange(3)
    rows = torch.arange(3)
    calls = [
        lambda t: ops.selected_logprob(h, w, index=rows, targets=rows, temperature=t),
        lambda t: ops.sample(torch.randn(3, 10), seeds=seeds, temperature=t),
        lambda t: ops.sample_from_hidden(h, w, seeds=seeds, temperature=t),
        lambda t: ops.linear_policy_loss(h, w, index=rows, targets=rows, temperature=t, old_log_probs=None,
                                         advantages=torch.zeros(3), sample_index=rows, num_samples=3),
    ]
    for call in calls:
        for t in (0.0, 1e-9, -1.0, float("nan")):
            with pytest.raises(ValueError, match=r"temperature must be a finite number >= 1e-05.*greedy.*argmax"):
                call(t)
        with pytest.raises(TypeError, match="temperature must be a number"):
            call("1.0")


def test_every_kernel_op_takes_the_one_dtype_tuple():
    from rlk_mm.schema.checks import KERNEL_FLOAT_DTYPES

    for dtype in (torch.float64, torch.int32):
        with pytest.raises(TypeError, match="float32"):
            ops.sample(torch.zeros(2, 4, dtype=dtype), seeds=torch.arange(2))
        with pytest.raises(TypeError, match="float32"):
            ops.selected_logprob(torch.zeros(2, 4, dtype=dtype), torch.zeros(3, 4, dtype=dtype), index=torch.arange(2),
                                 targets=torch.arange(2))
    from rlk_mm.ops.invariant.rmsnorm import rms_norm

    with pytest.raises(TypeError, match="/".join(str(d).replace("torch.", "") for d in KERNEL_FLOAT_DTYPES)):
        rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.ones(4), 1e-6)


def test_packing_lives_by_what_it_packs():
    from rlk_mm.ops import packed_batch, padded

    for name, home in (("pack", packed_batch), ("unpack", packed_batch), ("PackedBatch", packed_batch),
                       ("pack_padded", padded), ("unpack_to_padded", padded)):
        assert getattr(ops, name) is getattr(home, name)
