"""What happens to a thread's conversation when the root run that used it ends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OnEnd = Literal["release", "keep"]
OnInterrupt = Literal["hold", "keep", "release"]


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    """The lease policy of a thread's conversation (and its forks) at the end of a root run.

    * ``on_end``: when the run finishes or fails. ``"release"`` (default) frees the decode's
      retention at once (``DELETE``); ``"keep"`` leaves it to its TTL, so that the thread's next
      run (the user's next message) still reuses it.
    * ``on_interrupt``: when the run stops at a human-in-the-loop ``interrupt()``. ``"hold"``
      (default) renews the lease in the background until the thread resumes (its next model
      call or the end of the next run), for at most ``max_hold`` seconds (the router also caps
      a lease at its own maximum hold); ``"keep"`` leaves it to its TTL; ``"release"`` frees it.
    """

    on_end: OnEnd = "release"
    on_interrupt: OnInterrupt = "hold"
    max_hold: float = 3600.0

    def __post_init__(self) -> None:
        if self.on_end not in ("release", "keep"):
            raise ValueError(f"on_end must be 'release' or 'keep', got {self.on_end!r}")
        if self.on_interrupt not in ("hold", "keep", "release"):
            raise ValueError("on_interrupt must be 'hold', 'keep' or 'release', "
                             f"got {self.on_interrupt!r}")
        if not self.max_hold > 0:
            raise ValueError(f"max_hold must be positive, got {self.max_hold}")
