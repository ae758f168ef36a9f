"""What ``kvturn bench fleet`` and ``kvturn bench trace`` share of their settings: how their
instances start (KV on a GPU, more vLLM flags, the offload modes' host tier), how each run is
driven (warm-up, sampling, progress, settling, draining, the client's retries and timeout) and
where the results go. Each bench's settings extend ``InstanceRunSettings`` with what is its own
(``_fleet_plan.py``, ``trace/_plan.py``); ``_fleet.py`` runs both through these fields.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvturn_server.bench._profiles import HOST_TIER_MULTIPLE, PLAIN


@dataclass(frozen=True)
class InstanceRunSettings:
    gpu: bool = False
    """KV in the accelerator's memory (vLLM's default) instead of the CPU build's host buffer."""
    vllm_args: tuple[str, ...] = ()
    """More ``vllm serve`` flags for every instance (``--gpu-memory-utilization=0.28``)."""
    host_tier_multiple: float = HOST_TIER_MULTIPLE
    """The offload modes' host tier, a multiple of each instance's device KV."""
    warmup: bool = True
    sample_interval_s: float = 1.0
    progress_interval_s: float = 10.0
    settle_s: float = 2.0
    drain_timeout_s: float = 60.0
    max_retries: int = 2
    request_timeout_s: float = 600.0
    json_path: Path | None = None
    plot_path: Path | None = None

    def check_instances(self, profiles: Iterable[str]) -> None:
        """Refuse a host tier that is not positive, and ``--gpu`` with instances other than
        plain ones (``profiles``: those of the modes that run)."""
        if not self.host_tier_multiple > 0:
            raise ValueError(f"--host-tier must be positive, got {self.host_tier_multiple:g}")
        if self.gpu and any(p != PLAIN for p in profiles):
            raise ValueError("the offload modes size the host tier against the instances' "
                             "device KV, known before start only on the CPU build: run them "
                             "without --gpu")

    def describe(self) -> dict[str, Any]:
        """Every field as JSON (paths as text, tuples as lists): the bench's own first, then
        these, the order the results have always listed them in."""
        data = asdict(self)
        shared = [f.name for f in fields(InstanceRunSettings)]
        own = [f.name for f in fields(self) if f.name not in shared]
        return {name: _json_ready(data[name]) for name in (*own, *shared)}


def _json_ready(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_json_ready(v) for v in value]
    return value
