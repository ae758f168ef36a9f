"""What a starting stack says while it waits for its members: the ``progress`` callback of
``Stack.start`` and ``Fleet.start`` that ``kvturn up``, the demo and the benchmarks pass.

A leaf module (no kvturn imports) so that the command line (``cli.py``) is the only module that
imports the benchmarks and nothing imports the command line."""

from __future__ import annotations

import sys


class ProgressLine:
    """Start-up progress: one rewritten line on a terminal, a line every 10 s otherwise."""

    def __init__(self, stream: object = sys.stderr) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self._last = -10.0

    def __call__(self, elapsed: float, ready: list[str], waiting: list[str]) -> None:
        if not waiting:
            msg = f"{', '.join(ready)} healthy after {elapsed:.0f} s"
            print(("\r" if self.tty else "") + msg + " " * 20, file=sys.stderr, flush=True)
            return
        msg = (f"starting: {elapsed:4.0f} s, waiting for {', '.join(waiting)}"
               + (f" (ready: {', '.join(ready)})" if ready else ""))
        if self.tty:
            print("\r" + msg + " " * 10, end="", file=sys.stderr, flush=True)
        elif elapsed - self._last >= 10:
            self._last = elapsed
            print(msg, file=sys.stderr, flush=True)
