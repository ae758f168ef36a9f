"""What ``kvturn bench reuse`` sends: its rows, its five modes, their order per run, the prompts
of every timed request and the token sources each mode is planned to have.

Plain data over plain inputs, so that the plan can be checked without vLLM (docs of the
measurement itself are in ``_reuse.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvturn_server.local import PromptSources

NEW_TOKENS = 64
"""The next turn's new message (a user or tool message) in tokens: always computed."""

MODES: tuple[str, ...] = ("recompute", "reuse", "floor", "stock", "reuse_cached")
LABELS: dict[str, str] = {
    "recompute": "(a) recompute",
    "reuse": "(b) reuse",
    "floor": "(c) floor",
    "stock": "(d) stock",
    "reuse_cached": "(e) reuse+cache",
}
DESCRIPTIONS: dict[str, str] = {
    "recompute": "nothing cached anywhere: the prefill computes the whole prompt, the decode "
                 "reads all of it from the prefill",
    "reuse": "kvturn, the prefill holds none of the conversation (another prefill served the "
             "last turn, or it evicted it): it reads the previous prompt and the generated "
             "tokens from the decode's retention and computes the new message",
    "floor": "the prefill's cache already holds every token of the history (previous prompt and "
             "generated tokens): it computes only the new message; the best any reuse can do",
    "stock": "vLLM's default P/D: the prefill's cache holds the previous prompt (it computed it "
             "last turn), it computes the generated tokens and the new message",
    "reuse_cached": "kvturn on vLLM's default: the prefill's cache holds the previous prompt, it "
                    "reads only the generated tokens from the decode",
}

PINNED = frozenset({"reuse", "reuse_cached"})
"""Modes whose prefill leg reads the decode's retention (pin, read, unpin: a router's turn)."""
DECODE_HOLDS = frozenset({"reuse", "floor", "stock", "reuse_cached"})
"""Modes whose history the decode holds, as after any P/D turn: their decode legs are alike."""
SHARED_PROMPT = frozenset({"floor", "stock", "reuse_cached"})
"""Modes whose previous prompt the prefill holds: the row's one shared previous prompt."""
PREFILL_WARM = frozenset({"floor"})
"""Modes whose whole history the prefill is warmed with before the timed request."""


@dataclass(frozen=True)
class Row:
    """One line of the table: the previous turn's prompt and how many tokens it generated."""

    tokens: int
    generated: int

    @property
    def history(self) -> int:
        """Tokens the previous turn left: its prompt plus what it generated."""
        return self.tokens + self.generated

    @property
    def prompt_tokens(self) -> int:
        """The timed request's prompt: the history plus the new message."""
        return self.history + NEW_TOKENS


def plan_rows(sizes: Sequence[int], generated: Sequence[int],
              generated_sizes: Sequence[int] | None) -> list[Row]:
    """Every size with the smallest ``generated`` count, and the sizes in ``generated_sizes``
    (None: every size) with each count: the generated axis costs most where prompts are long."""
    if not sizes or not generated:
        raise ValueError("at least one size and one generated count are needed")
    least = min(generated)
    chosen = set(sizes) if generated_sizes is None else set(generated_sizes)
    unknown = chosen - set(sizes)
    if unknown:
        raise ValueError(f"generated sizes {sorted(unknown)} are not among the sizes "
                         f"{sorted(set(sizes))}")
    return [Row(s, g) for s in sorted(set(sizes)) for g in sorted(set(generated))
            if g == least or s in chosen]


def williams_orders(modes: Sequence[str] = MODES) -> list[tuple[str, ...]]:
    """A Williams design: every mode in every position, and every mode right after every other,
    equally often (over ``len(modes)`` orders for an even count, twice that for an odd one).

    Rotating alone would put each mode always after the same one; what ran just before a timed
    request (its caches, the CPU's state) is then balanced too.
    """
    n = len(modes)
    first: list[int] = [0]
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    rows = [[(i + shift) % n for i in first] for shift in range(n)]
    if n % 2:
        rows += [list(reversed(r)) for r in rows]
    return [tuple(modes[i] for i in r) for r in rows]


def run_orders(runs: int, modes: Sequence[str] = MODES) -> list[tuple[str, ...]]:
    """The order of the modes in each of ``runs`` runs: the Williams design, cycled."""
    design = williams_orders(modes)
    return [design[i % len(design)] for i in range(runs)]


@dataclass(frozen=True)
class ModePrompts:
    """One mode's requests in one run."""

    mode: str
    history: tuple[int, ...]
    """What the previous turn left: its prompt, then its generated tokens."""
    new: tuple[int, ...]

    @property
    def prompt(self) -> list[int]:
        """The timed request's prompt."""
        return [*self.history, *self.new]


Fresh = Callable[[int], list[int]]
"""``fresh(n)``: n token ids no earlier request contained (random ids in practice)."""


def run_prompts(row: Row, shared_prompt: Sequence[int], fresh: Fresh,
                modes: Sequence[str] = MODES) -> dict[str, ModePrompts]:
    """Every mode's prompts for one run.

    Each mode's history is its own from its first block on, except the previous prompt that
    ``SHARED_PROMPT`` modes share by design (the prefill holds it in each of them); their
    generated tokens and every mode's new message are fresh, so no mode's timed request finds
    what another mode's requests left in a cache.
    """
    if len(shared_prompt) != row.tokens:
        raise ValueError(f"the shared prompt has {len(shared_prompt)} tokens, not {row.tokens}")
    out: dict[str, ModePrompts] = {}
    for mode in modes:
        prompt = list(shared_prompt) if mode in SHARED_PROMPT else fresh(row.tokens)
        generated = fresh(row.generated) if row.generated else []
        out[mode] = ModePrompts(mode, tuple(prompt + generated), tuple(fresh(NEW_TOKENS)))
    return out


def expected_prefill(mode: str, row: Row) -> PromptSources:
    """The prefill's prompt tokens in ``mode`` by source, as planned (block rounding aside)."""
    s, g, new = row.tokens, row.generated, NEW_TOKENS
    planned = {
        "recompute": PromptSources(computed=s + g + new, local_cache=0, transferred=0),
        "reuse": PromptSources(computed=new, local_cache=0, transferred=s + g),
        "floor": PromptSources(computed=new, local_cache=s + g, transferred=0),
        "stock": PromptSources(computed=g + new, local_cache=s, transferred=0),
        "reuse_cached": PromptSources(computed=new, local_cache=s, transferred=g),
    }
    return planned[mode]


def expected_decode(mode: str, row: Row) -> PromptSources:
    """The decode's prompt tokens in ``mode`` by source: it holds the history in every mode but
    recompute and reads the rest from the prefill."""
    if mode in DECODE_HOLDS:
        return PromptSources(computed=0, local_cache=row.history, transferred=NEW_TOKENS)
    return PromptSources(computed=0, local_cache=0, transferred=row.prompt_tokens)


def mismatch(actual: PromptSources, planned: PromptSources, tolerance: float) -> bool:
    """Whether any source differs from the plan by more than ``tolerance`` tokens (a block:
    only full blocks are cached or read, so a history that is not block-aligned moves up to a
    block from cached or read to computed)."""
    return any(abs(a - p) > tolerance for a, p in (
        (actual.computed, planned.computed), (actual.local_cache, planned.local_cache),
        (actual.transferred, planned.transferred)))
