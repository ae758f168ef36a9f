"""Read a vLLM instance's Prometheus metrics (what the demo, benches and tests measure by)."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Samples of a Prometheus text exposition, keyed by (name, labels); label values unescaped.

    Raises ValueError on text that is not the exposition format (vLLM's ``/metrics`` is written
    by prometheus_client, so a failure means the URL is not a vLLM metrics endpoint).
    """
    # prometheus_client comes with the [router] extra: imported here, so that the ``kvturn``
    # command (which imports this package) still starts where only the SDK's dependencies are
    # installed. Only the demo, the benches and the tests scrape, and they run the full install.
    from prometheus_client.parser import text_string_to_metric_families

    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


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
    """Loaded through a KV connector: a NIXL transfer, or vLLM's CPU offloading's host tier."""
    host: float = 0.0
    """Of the cached tokens, those vLLM's CPU offloading loaded from its host tier (counted in
    ``transferred`` too)."""

    def __sub__(self, other: PromptSources) -> PromptSources:
        return PromptSources(self.computed - other.computed,
                             self.local_cache - other.local_cache,
                             self.transferred - other.transferred, self.host - other.host)


def sources(s: Samples) -> PromptSources:
    """The prompt-token counters of one scrape, by source."""
    name = "vllm:prompt_tokens_by_source_total"
    return PromptSources(
        computed=total(s, name, source="local_compute"),
        local_cache=total(s, name, source="local_cache_hit"),
        transferred=total(s, name, source="external_kv_transfer"),
        host=host_tokens(s),
    )


def host_tokens(s: Samples) -> float:
    """Prompt tokens vLLM's CPU offloading has loaded from its host tier (0 without one)."""
    return total(s, "vllm:prompt_tokens_cached_by_source_total", source="host")


def prompt_sources(base_url: str) -> PromptSources:
    return sources(scrape(base_url))
