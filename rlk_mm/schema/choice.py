"""``Choice``: the base of every string option set (loss modes, KL types, layouts, ...).

A ``Choice`` member is a ``str``, so plain strings keep working wherever one is expected;
``parse`` turns a user's value into a member or raises an error that names the argument
and lists the accepted values.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["Choice"]


class Choice(str, Enum):
    """A string option set: members compare equal to their values."""

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value, argument: str, error: type[Exception] = ValueError):
        """The member for ``value`` (a member or its string), else ``error`` naming ``argument``."""
        try:
            return cls(value)
        except ValueError:
            raise error(f"{argument}={value!r}: expected one of {', '.join(c.value for c in cls)}") from None
