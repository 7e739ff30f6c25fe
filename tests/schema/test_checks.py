"""rlk_mm.schema.checks: the shared argument checks name the argument and refuse coercions."""

import math

import numpy as np
import pytest
import torch

from rlk_mm.schema.checks import DeviceChecks, bool_arg, first_true, float_arg, int_arg, tensor_arg

BAD_INTS = [  # (value, largest allowed, error, message words)
    (True, None, TypeError, "must be an int, got bool"),
    (2.0, None, TypeError, "must be an int, got float"),
    ("3", None, TypeError, "must be an int, got str"),
    (None, None, TypeError, "must be an int, got NoneType"),
    (torch.tensor(1.0), None, TypeError, "must be an int, got Tensor"),
    (torch.tensor([1, 2]), None, TypeError, "must be an int, got Tensor"),
    (-1, None, ValueError, "n=-1 is out of range: it must be >= 0"),
    (11, 10, ValueError, "n=11 is out of range: it must be >= 0 and <= 10"),
]


@pytest.mark.parametrize("value,largest,error,words", BAD_INTS)
def test_int_arg_refuses(value, largest, error, words):
    with pytest.raises(error, match=words):
        int_arg("n", value, min=0, max=largest)


def test_int_arg_accepts_integers_of_every_kind():
    assert [int_arg("n", v, min=0) for v in (3, np.int64(3), torch.tensor(3))] == [3, 3, 3]


BAD_FLOATS = [
    (True, TypeError, "must be a number, got bool"),
    ("0.1", TypeError, "must be a number, got str"),
    (float("nan"), ValueError, "must be a finite number"),
    (math.inf, ValueError, "must be a finite number"),
    (0.0, ValueError, "out of range: it must be > 0"),
    (-1.0, ValueError, "out of range: it must be > 0"),
]


@pytest.mark.parametrize("value,error,words", BAD_FLOATS)
def test_float_arg_refuses(value, error, words):
    with pytest.raises(error, match=words):
        float_arg("temperature", value, min=0.0, min_open=True)


def test_float_arg_accepts_and_allows_infinity_when_asked():
    assert float_arg("t", 2, min=0.0) == 2.0 and float_arg("t", torch.tensor(0.5)) == 0.5
    assert float_arg("c", math.inf, finite=False) == math.inf
    with pytest.raises(ValueError, match="finite"):
        float_arg("c", math.nan, finite=False)


def test_bool_arg():
    assert bool_arg("flag", False) is False
    for bad in (0, 1, "yes", None):
        with pytest.raises(TypeError, match="flag must be True or False"):
            bool_arg("flag", bad)


def test_tensor_arg():
    t = torch.zeros(2, 3, dtype=torch.int64)
    assert tensor_arg("x", t, ndim=2, shape=(2, None), dtypes=(torch.int64,)) is t
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        tensor_arg("x", [[0, 0, 0]])
    with pytest.raises(ValueError, match="x must be 1-D or 3-D, got shape \\(2, 3\\)"):
        tensor_arg("x", t, ndim=(1, 3))
    with pytest.raises(ValueError, match="x must have shape \\[3, \\*\\], got \\(2, 3\\)"):
        tensor_arg("x", t, shape=(3, None))
    with pytest.raises(TypeError, match="x must be float32/bfloat16, got torch.int64"):
        tensor_arg("x", t, dtypes=(torch.float32, torch.bfloat16))


def test_device_checks_read_once_and_raise_the_first_failure():
    x = torch.tensor([1.0, float("nan"), -2.0])
    checks = DeviceChecks()
    checks.run()  # nothing to check: no error
    calls = []

    def fail(what):
        def raise_it():
            calls.append(what)
            raise ValueError(f"{what} at {first_true(~torch.isfinite(x))}")
        return raise_it

    checks.add((x < -5).any(), fail("below -5"))
    checks.add((~torch.isfinite(x)).any(), fail("not finite"))
    checks.add((x < 0).any(), fail("negative"))
    with pytest.raises(ValueError, match=r"not finite at \(1,\)"):
        checks.run()
    assert calls == ["not finite"]
