"""What every ``rlk-mm`` command shares: its exit codes, how an outcome maps to one,
``--debug``, and the argument types that refuse bad values at parse time.

Exit codes: 0 ok; 1 the documented negative result (layout mismatch, not invariant, a smoke
gate or the learning check failed); 2 bad input or usage, with a one-line message; 3 an
internal error, with a one-line message (the traceback only with ``--debug``).

Bad input is: an argparse error, ``UsageError`` (a command's own checks), a batch file that
cannot be read or breaks the contract (``SchemaError``), a file that cannot be read or
written (``OSError``), and a ValueError, TypeError or NotImplementedError that rlk_mm's own
argument checks raised (the innermost frame is rlk_mm's). Anything else escaping a command
is an internal error.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback
from pathlib import Path

__all__: list[str] = []

OK, NEGATIVE, BAD_INPUT, INTERNAL = 0, 1, 2, 3
_PACKAGE = Path(__file__).resolve().parent


class UsageError(Exception):
    """Bad input or usage found by a command's own checks (exit 2)."""


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """``--debug`` on ``parser`` (set only when given, so a sub-command's never hides the top level's)."""
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="print the traceback of an internal error (exit 3)")


def main(parser: argparse.ArgumentParser, argv=None) -> int:
    """Parse ``argv`` and run the chosen command (``args.func``); the exit code, never an exception."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed the usage error (2) or the help (0)
        return int(e.code or 0)
    prog = parser.prog + (f" {args.command}" if getattr(args, "command", None) else "")
    debug = getattr(args, "debug", False)
    try:
        return int(args.func(args) or OK)
    except Exception as e:  # noqa: BLE001 (every outcome becomes an exit code)
        code = BAD_INPUT if _bad_input(e) else INTERNAL
        if debug:
            traceback.print_exc()
        message = " ".join(str(e).split())
        if code == INTERNAL:
            hint = "" if debug else " (run with --debug for the traceback)"
            message = f"internal error: {type(e).__name__}: {message}{hint}"
        print(f"{prog}: {message}", file=sys.stderr)
        return code


def _bad_input(e: Exception) -> bool:
    from .schema import SchemaError

    if isinstance(e, (UsageError, SchemaError, OSError)):
        return True
    if isinstance(e, (ValueError, TypeError, NotImplementedError)):
        frames = traceback.extract_tb(e.__traceback__)
        return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(_PACKAGE)
    return False


# ------------------------------------------------------------------------------ argument types
def int_at_least(low: int):
    """An argparse type: an int >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is not an int >= {low}")
        return value

    return parse


def number(low: float, *, open_low: bool, high: float = math.inf):
    """An argparse type: a finite number > ``low`` (``open_low``) or >= ``low``, and <= ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or (value <= low if open_low else value < low):
            raise argparse.ArgumentTypeError(f"{text} is not a number {'>' if open_low else '>='} {low:g}")
        if value > high:
            raise argparse.ArgumentTypeError(f"{text} is not a number <= {high:g}")
        return value

    return parse


def device(text: str) -> str:
    """An argparse type: a torch device that exists here ("cpu", "cuda", "cuda:1")."""
    import torch

    from .schema.checks import device_arg

    try:
        dev = device_arg(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("device=", "", 1)) from None
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return text


def folder(text: str) -> str:
    """An argparse type: an existing folder."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text}: no such folder")
    return text


def output_file(text: str) -> str:
    """An argparse type: a file path (not empty, not a folder) whose folder exists (checked before any work)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path: give a file name")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a folder: give a file name inside it")
    parent = Path(text).parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: the folder {parent} does not exist")
    return text


def output_folder(text: str) -> str:
    """An argparse type: a folder to write into, made if missing: not empty, not an existing
    file, and its nearest existing ancestor a folder (checked before any work)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path: give a folder name")
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file: give a folder (it is made if missing)")
    for ancestor in path.absolute().parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise argparse.ArgumentTypeError(f"{text}: {ancestor} is a file, so the folder cannot be made")
            break
    return text


#: the picture formats the --png options write (matplotlib writes each with its own backends)
IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def image_file(text: str) -> str:
    """An argparse type: an ``output_file`` whose suffix names a picture format (``IMAGE_SUFFIXES``),
    so the file written is the path given."""
    text = output_file(text)
    if Path(text).suffix.lower() not in IMAGE_SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text}: give a file name ending in {', '.join(IMAGE_SUFFIXES)} "
                                         "(the picture's format)")
    return text
