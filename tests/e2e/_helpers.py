"""Shared helpers for the e2e tests: requests, metrics deltas, process lookup."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvturn_server.local import PromptSources, StackConfig, free_port, prompt_sources, scrape
from kvturn_server.local._direct import control
from kvturn_server.local._http import post_json
from kvturn_server.local._metrics import total
from kvturn_server.local._process import ServerSpec, launch, wait_healthy

from ._greedy import chat_logprobs

post = post_json


def failed_transfers(base_url: str) -> float:
    return total(scrape(base_url), "vllm:nixl_num_failed_transfers_total")


class Delta:
    """Prompt-token sources of an instance over a block of requests."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.before = prompt_sources(base_url)
        self.value: PromptSources | None = None

    def __enter__(self) -> Delta:
        return self

    def __exit__(self, *exc: object) -> None:
        self.value = prompt_sources(self.base_url) - self.before


def descendant(pid: int, comm: str) -> int:
    """The descendant process of ``pid`` named ``comm`` (vLLM sets its process titles)."""
    children: dict[int, list[int]] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            names[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    todo = [pid]
    while todo:
        current = todo.pop()
        if names.get(current, "").startswith(comm) and current != pid:
            return current
        todo.extend(children.get(current, []))
    raise LookupError(f"no {comm} process under {pid} (pid {os.getpid()} looked)")


def metric(base_url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample on an instance's /metrics (0 when absent)."""
    return total(scrape(base_url), name, **labels)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str,
               interval: float = 0.1) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(interval)


def retention_stats(control_url: str) -> dict[str, Any]:
    status, body = control(control_url, "GET", "/kvturn/v1/stats")
    assert status == 200, body
    stats: dict[str, Any] = body["retention"]
    return stats


def plain_chat(base_url: str, model: str, messages: list[dict[str, Any]], max_tokens: int,
               **extra: Any) -> dict[str, Any]:
    """A greedy chat turn on a plain instance (the reference every e2e answer is held to), with
    the logprobs that ``assert_same_text`` needs to tell a near-tie from a wrong answer."""
    return post(f"{base_url}/v1/chat/completions", {
        "model": model, "messages": messages, "temperature": 0, "max_tokens": max_tokens,
        **chat_logprobs(), **extra})


def start_router(cfg: StackConfig, name: str, logs: Path, *args: str,
                 health: str = "/health") -> tuple[str, subprocess.Popen[bytes]]:
    """One more router over the session stack's prefill and decode (with ``args`` after the
    backends), healthy at ``health`` before it returns; its URL and process (stop it with
    ``stop_group(proc.pid)``; it also dies with the test process)."""
    port = free_port()
    spec = ServerSpec(
        name=name, port=port, health_url=f"http://127.0.0.1:{port}{health}",
        log_path=logs / f"{name}.log", env={"PYTHONUNBUFFERED": "1"},
        argv=[sys.executable, "-m", "kvturn_server.cli", "router", "--port", str(port),
              "--prefill", cfg.prefill_url,
              "--decode", f"{cfg.decode_url},control={cfg.decode_control_url}",
              "--retention-ttl", f"{cfg.decoder_kv_blocks_ttl:g}", *args])
    proc = launch(spec, die_with_parent=True)
    wait_healthy({name: (spec, proc)}, timeout=60)
    return f"http://127.0.0.1:{port}", proc
