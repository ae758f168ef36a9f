"""The local stack: a locally built model, vLLM prefill + decode on CPU, and the router."""

from kvturn_server.local._adapter import build_lora_adapter
from kvturn_server.local._fleet import Fleet, FleetConfig, Instance, Router
from kvturn_server.local._metrics import PromptSources, prompt_sources, scrape
from kvturn_server.local._model import SIZES, ModelSize, build_model, is_built
from kvturn_server.local._process import StackError, free_port
from kvturn_server.local._stack import (
    INSTALL_HINT,
    RunningStack,
    Stack,
    StackConfig,
    kv_transfer_config,
    read_running,
    stop_running,
    vllm_is_installed,
)

__all__ = [
    "INSTALL_HINT",
    "SIZES",
    "Fleet",
    "FleetConfig",
    "Instance",
    "ModelSize",
    "PromptSources",
    "Router",
    "RunningStack",
    "Stack",
    "StackConfig",
    "StackError",
    "build_lora_adapter",
    "build_model",
    "free_port",
    "is_built",
    "kv_transfer_config",
    "prompt_sources",
    "read_running",
    "scrape",
    "stop_running",
    "vllm_is_installed",
]
