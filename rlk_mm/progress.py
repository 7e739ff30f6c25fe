"""A progress bar with an ETA for the ``rlk-mm`` commands, on stderr, standard library only.

Shown when stderr is a terminal, unless ``--quiet``; ``--progress`` shows it anyway (in a log
file each update is a line of its own). Nothing here imports torch, so a command's parser and
its bar cost no import time.
"""

from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

__all__: list[str] = []

#: characters of the bar itself
WIDTH = 24


def progress_wanted(quiet: bool = False, progress: bool = False, stream: Optional[TextIO] = None) -> bool:
    """Whether to draw a bar.

    Parameters
    ----------
    quiet : bool
        ``--quiet``: never.
    progress : bool
        ``--progress``: always (unless ``quiet``).
    stream : file, optional
        Where the bar goes (default ``sys.stderr``); without either flag, only when it is a terminal.

    Returns
    -------
    bool
    """
    if quiet:
        return False
    if progress:
        return True
    stream = sys.stderr if stream is None else stream
    return bool(getattr(stream, "isatty", lambda: False)())


def add_progress_flags(parser) -> None:
    """Add ``--quiet`` and ``--progress`` to an argparse parser.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        The sub-command's parser.
    """
    parser.add_argument("--quiet", action="store_true", help="no progress bar (the results are still printed)")
    parser.add_argument("--progress", action="store_true",
                        help="draw the progress bar even when stderr is not a terminal (a line per update)")


def duration(seconds: float) -> str:
    """``seconds`` as a clock reading: "0:42", "12:05", "1:02:09"."""
    seconds = max(int(round(seconds)), 0)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"


def about(seconds: float) -> str:
    """``seconds`` rounded for an estimate: "8 s", "4 min", "1.6 h"."""
    if seconds < 59.5:
        return f"{max(int(round(seconds)), 1)} s"
    if seconds < 90 * 60:
        return f"{int(round(seconds / 60))} min"
    return f"{seconds / 3600:.1f} h"


def eta(times: list[float], left: int) -> str:
    """The time ``left`` more steps take at the mean of the step ``times`` so far ("?" before the first)."""
    return duration(sum(times) / len(times) * left) if times else "?"


class Progress:
    """A bar of ``total`` steps with the elapsed time and an ETA from the mean step so far.

    Parameters
    ----------
    total : int
        Steps to the end (at least 1).
    label : str
        What runs, shown before the bar.
    enabled : bool
        False: every call is a no-op (see ``progress_wanted``).
    stream : file, optional
        Where to draw (default ``sys.stderr``).
    clock : callable, optional
        Seconds as a float (default ``time.monotonic``); for tests.

    Raises
    ------
    ValueError
        If ``total`` is below 1.
    """

    def __init__(self, total: int, label: str, *, enabled: bool = True, stream: Optional[TextIO] = None,
                 clock=time.monotonic) -> None:
        if int(total) < 1:
            raise ValueError(f"total must be at least 1, got {total!r}")
        self.total, self.label, self.enabled = int(total), label, enabled
        self.stream = sys.stderr if stream is None else stream
        self.clock = clock
        self.done = 0
        self.start = clock()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self, note: str = "") -> str:
        """The bar as text: label, bar, steps, elapsed time, ETA and ``note``."""
        elapsed = self.clock() - self.start
        filled = WIDTH * self.done // self.total
        bar = "#" * filled + "-" * (WIDTH - filled)
        left = duration(elapsed / self.done * (self.total - self.done)) if self.done else "?"
        text = f"{self.label} [{bar}] {self.done}/{self.total} {duration(elapsed)} elapsed, ETA {left}"
        return f"{text}  {note}" if note else text

    def update(self, done: Optional[int] = None, note: str = "") -> None:
        """Set the steps done (default: one more) and redraw.

        Parameters
        ----------
        done : int, optional
            Steps done so far; ``None`` adds one.
        note : str
            What the last step was.
        """
        self.done = min(self.done + 1 if done is None else int(done), self.total)
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line(note))
        else:
            self.stream.write(self.line(note) + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar's line, so what is printed next starts on a line of its own."""
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
