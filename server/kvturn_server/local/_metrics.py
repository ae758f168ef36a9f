"""Read a vLLM instance's Prometheus metrics (what the demo, benches and tests measure by)."""

from __future__ import annotations

import re
import urllib.request
from dataclasses import dataclass

_LINE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Samples of a Prometheus text exposition, keyed by (name, labels)."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        labels = frozenset(_LABEL.findall(m.group("labels") or ""))
        try:
            samples[(m.group("name"), labels)] = float(m.group("value"))
        except ValueError:
            continue
    return samples


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(base_url: str, timeout: float = 5.0) -> Samples:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as resp:
        return parse(resp.read().decode("utf-8", errors="replace"))


def total(samples: Samples, name: str,
          **labels: str) -> float:
    """Sum of ``name`` over every sample whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


@dataclass(frozen=True)
class PromptSources:
    """Prompt tokens an instance has processed, by where their KV came from."""

    computed: float
    local_cache: float
    transferred: float

    def __sub__(self, other: PromptSources) -> PromptSources:
        return PromptSources(self.computed - other.computed,
                             self.local_cache - other.local_cache,
                             self.transferred - other.transferred)


def sources(s: Samples) -> PromptSources:
    """The prompt-token counters of one scrape, by source."""
    name = "vllm:prompt_tokens_by_source_total"
    return PromptSources(
        computed=total(s, name, source="local_compute"),
        local_cache=total(s, name, source="local_cache_hit"),
        transferred=total(s, name, source="external_kv_transfer"),
    )


def prompt_sources(base_url: str) -> PromptSources:
    return sources(scrape(base_url))
