"""Shared helpers for the e2e tests: requests, metrics deltas, process lookup."""

from __future__ import annotations

import os
from pathlib import Path

from kvturn_server.local import PromptSources, prompt_sources, scrape
from kvturn_server.local._http import post_json
from kvturn_server.local._metrics import total

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
