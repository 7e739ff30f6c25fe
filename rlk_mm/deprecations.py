"""Every deprecated name of rlk_mm in one table: moved modules, moved names, renamed keywords.

0.1.0 was never published, so nothing here has a one-release shim file: a moved module's old
import path fails at once naming its new home, a moved name is still served (with a
``DeprecationWarning`` naming its home) by its old package's ``__getattr__``, and a renamed
keyword is still accepted (with a warning) by the function it belongs to. Each entry goes in
the next release; ``tests/test_deprecations.py`` checks every one.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import inspect
import sys
import warnings

__all__ = ["MOVED_MODULES", "MOVED_NAMES", "RENAMED_KEYWORDS", "RENAMED_VALUES"]

#: old module path -> its new home; ``import old`` raises ``ModuleNotFoundError`` naming the new one
MOVED_MODULES: dict[str, str] = {
    "rlk_mm.schema.grounding": "rlk_mm.schema.coordinates",
    "rlk_mm.schema.support": "rlk_mm.schema.unsupported",
    "rlk_mm.schema.media_fallback": "rlk_mm.schema.unsupported",
    "rlk_mm.ops.packing": "rlk_mm.ops.packed_batch",
    "rlk_mm.smoke.task": "rlk_mm.smoke.tasks.base",
    "rlk_mm.smoke.point_task": "rlk_mm.smoke.tasks.point",
    "rlk_mm.ops.loss_config": "rlk_mm.ops.loss.config",
    "rlk_mm.ops.linear_loss": "rlk_mm.ops.loss.fused",
    "rlk_mm.ops.vocab_parallel": "rlk_mm.ops._vocab_parallel",
    "rlk_mm.integrations.verl_fused": "rlk_mm.integrations.verl.fused",
    "rlk_mm.integrations.trl_on_policy": "rlk_mm.integrations.trl.on_policy",
}

#: ``package.name`` -> the module that holds it now; the package's ``__getattr__`` serves it with a warning
MOVED_NAMES: dict[str, str] = {
    "rlk_mm.ops.batch_logprobs": "rlk_mm.models",
    "rlk_mm.ops.forward_hidden": "rlk_mm.models",
    "rlk_mm.ops.VisionCache": "rlk_mm.models",
    "rlk_mm.ops.group_logprobs": "rlk_mm.models",
}

#: ``module.function`` -> {old keyword: new keyword}
RENAMED_KEYWORDS: dict[str, dict[str, str]] = {
    "rlk_mm.ops.padded.unpack_to_padded": {"side": "padding"},
    "rlk_mm.ops.loss.op.kl_penalty": {"kind": "kl_type"},
    "rlk_mm.ops.rewards.scatter_rewards": {"loss_spans": "batch"},
    "rlk_mm.models.forward.layout_inputs": {"layout": "padding"},
    "rlk_mm.models.forward.forward_hidden": {"layout": "padding"},
    "rlk_mm.models.forward.batch_logprobs": {"layout": "padding"},
}

#: keyword -> {old value: new value}, for the functions of ``RENAMED_KEYWORDS`` that take the keyword
RENAMED_VALUES: dict[str, dict[object, object]] = {
    "padding": {"packed": None},  # the packed layout is padding=None
}


def moved_name(package: str, name: str):
    """What ``package.__getattr__(name)`` returns: a moved name from its new home, with a
    ``DeprecationWarning``; any other name is an ``AttributeError``."""
    home = MOVED_NAMES.get(f"{package}.{name}")
    if home is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(f"{package}.{name} moved to {home}.{name}; import it from there (the old name goes in the next "
                  "release)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(home), name)


def renamed_keywords(fn):
    """Decorator: the function's old keywords (``RENAMED_KEYWORDS``) and old values
    (``RENAMED_VALUES``) are passed as the new ones, each with a ``DeprecationWarning``; an old
    and a new keyword at once is a ``TypeError``. ``help()`` shows the function's own signature."""
    renames = RENAMED_KEYWORDS[f"{fn.__module__}.{fn.__name__}"]
    values = {new: RENAMED_VALUES[new] for new in renames.values() if new in RENAMED_VALUES}
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        for old, new in renames.items():
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{fn.__name__}() got {old}= and {new}=: {old} is the old name of {new}; "
                                    f"pass {new} only")
                warnings.warn(f"{fn.__name__}({old}=...) is deprecated: use {new}= (the old name goes in the "
                              "next release)", DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
        if values:
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)  # the function's own error for a call that does not fit
            for keyword, table in values.items():
                value = bound.arguments.get(keyword)
                if isinstance(value, str) and value in table:
                    warnings.warn(f"{fn.__name__}({keyword}={value!r}) is deprecated: pass {keyword}={table[value]!r} "
                                  "(the old value goes in the next release)", DeprecationWarning, stacklevel=2)
                    bound.arguments[keyword] = table[value]
            args, kwargs = bound.args, bound.kwargs
        return fn(*args, **kwargs)

    return call


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Fails the import of a moved module at once, naming its new home."""

    def find_spec(self, fullname, path=None, target=None):
        home = MOVED_MODULES.get(fullname)
        if home is not None:
            raise ModuleNotFoundError(f"{fullname} moved to {home}: import it from there", name=fullname)
        return None


if not any(type(finder).__name__ == "_MovedModuleFinder" for finder in sys.meta_path):  # once, even on reload
    sys.meta_path.insert(0, _MovedModuleFinder())
