"""The local stack: a locally built model, vLLM prefill + decode on CPU, and the router.

Besides the stack, the face exports what the benchmarks and the command line drive it with:
direct calls to an instance (``DirectConversation``, ``control``, ``post_json``), its Prometheus
counters (``scrape``, ``total``, ``sources``), the progress line and restart backoff, and the
tokenizer's words (``WORDS``). ``run_demo`` is loaded on first access: the demo pulls the SDK's
HTTP client and the example agent, which nothing else here needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvturn_server.local._adapter import build_lora_adapter
from kvturn_server.local._corpus import WORDS
from kvturn_server.local._demo_report import STOCK_ROUTER_ARGS
from kvturn_server.local._direct import DirectConversation, control
from kvturn_server.local._fleet import DECODE, PREFILL, Fleet, FleetConfig, Instance, Router
from kvturn_server.local._http import post_json
from kvturn_server.local._launch import kv_transfer_config
from kvturn_server.local._metrics import (
    PromptSources,
    Samples,
    host_tokens,
    prompt_sources,
    scrape,
    sources,
    total,
)
from kvturn_server.local._model import SIZES, ModelSize, build_model, is_built
from kvturn_server.local._process import StackError, free_port, log_tail
from kvturn_server.local._progress import ProgressLine
from kvturn_server.local._stack import (
    INSTALL_HINT,
    Progress,
    RunningStack,
    Stack,
    read_running,
    stop_running,
    vllm_is_installed,
)
from kvturn_server.local._stack_config import StackConfig
from kvturn_server.local._supervise import Backoff

if TYPE_CHECKING:
    from kvturn_server.local._demo import run_demo

__all__ = [
    "DECODE",
    "INSTALL_HINT",
    "PREFILL",
    "SIZES",
    "STOCK_ROUTER_ARGS",
    "WORDS",
    "Backoff",
    "DirectConversation",
    "Fleet",
    "FleetConfig",
    "Instance",
    "ModelSize",
    "Progress",
    "ProgressLine",
    "PromptSources",
    "Router",
    "RunningStack",
    "Samples",
    "Stack",
    "StackConfig",
    "StackError",
    "build_lora_adapter",
    "build_model",
    "control",
    "free_port",
    "host_tokens",
    "is_built",
    "kv_transfer_config",
    "log_tail",
    "post_json",
    "prompt_sources",
    "read_running",
    "run_demo",
    "scrape",
    "sources",
    "stop_running",
    "total",
    "vllm_is_installed",
]


def __getattr__(name: str) -> Any:
    if name == "run_demo":
        from kvturn_server.local._demo import run_demo

        return run_demo
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
