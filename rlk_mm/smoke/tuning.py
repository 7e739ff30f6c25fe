"""``SmokeTuning``: the smoke test's settings that are not command-line options, as one
frozen config that ``run_smoke(args, tuning=...)`` takes. The defaults are what
``bench/smoke_sweep.py`` chose; the sweep passes a ``SmokeTuning`` per run (never module
globals)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from .policy import TINY_MODEL
from .tasks.colour import BACKGROUND_RATE, TWO_IMAGE_RATE

__all__ = ["SmokeTuning"]

#: the module constants of earlier sweep configs ("set": {...}) -> the field that replaces each
_CONSTANTS = {"TINY_MODEL": "tiny_model", "BACKGROUND_RATE": "background_rate", "TWO_IMAGE_RATE": "two_image_rate"}
#: settings of earlier sweep configs that are options now -> the option (``bench/smoke_sweep.py``
#: passes them as such)
MOVED_TO_OPTIONS = MappingProxyType({"LR_FLOOR": "--lr-floor", "lr_floor": "--lr-floor"})


@dataclass(frozen=True)
class SmokeTuning:
    """Settings of the run that the command line does not offer (each default is the module
    constant named beside it)."""

    tiny_model: Mapping = field(default_factory=lambda: MappingProxyType(dict(TINY_MODEL)))  # tiny_qwen2_5_vl sizes
    background_rate: float = BACKGROUND_RATE  # colour task: how often the dominant colour is the background
    two_image_rate: float = TWO_IMAGE_RATE  # colour task: how often a prompt has a second image

    def __post_init__(self):
        for name in ("background_rate", "two_image_rate"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (math.isfinite(value) and 0 <= value <= 1):
                raise ValueError(f"SmokeTuning.{name} must be a number in [0, 1], got {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.tiny_model, Mapping):
            raise TypeError(f"SmokeTuning.tiny_model must be a mapping of tiny_qwen2_5_vl sizes, got {type(self.tiny_model).__name__}")
        for key, value in self.tiny_model.items():
            if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SmokeTuning.tiny_model[{key!r}] must be an int >= 1 (a tiny_qwen2_5_vl size), got {value!r}")
        object.__setattr__(self, "tiny_model", MappingProxyType(dict(self.tiny_model)))

    @classmethod
    def from_mapping(cls, values: Mapping) -> "SmokeTuning":
        """A tuning from field names (``{"background_rate": 0.8}``); the module-constant names
        of earlier sweep configs (``TINY_MODEL``, ``BACKGROUND_RATE``, ``TWO_IMAGE_RATE``) are
        read as their fields. Unknown names are refused, and so is the learning-rate floor: an
        option now (``--lr-floor``)."""
        if not isinstance(values, Mapping):
            raise TypeError(f"a smoke tuning is a mapping of settings, got {type(values).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        given = {}
        for key, value in values.items():
            name = _CONSTANTS.get(key, key)
            if key in MOVED_TO_OPTIONS:
                raise ValueError(
                    f"smoke tuning {key!r} is the option {MOVED_TO_OPTIONS[key]} now: pass it with the run's options")
            if name not in fields:
                raise ValueError(f"unknown smoke tuning {key!r}; the settings are {', '.join(sorted(fields))}")
            given[name] = value
        return cls(**given)

    def as_dict(self) -> dict:
        """The settings as plain JSON values (for the report)."""
        return {f.name: dict(v) if isinstance(v := getattr(self, f.name), Mapping) else v for f in dataclasses.fields(self)}
