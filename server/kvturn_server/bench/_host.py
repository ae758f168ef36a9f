"""The host a benchmark ran on, as its figures must state it: the CPU model and whether it has
AMX (bfloat16 and int8 matrix tiles; without them vLLM's CPU backend runs bfloat16 models far
slower, so the same benchmark can rank differently on another host)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")


def cpu_info(path: Path = CPUINFO) -> dict[str, Any]:
    """``model``: the first ``model name`` of ``path``; ``amx``: whether its first ``flags``
    line has ``amx_tile``. Both None where the file or the line is missing (not Linux, or an
    architecture whose cpuinfo names them otherwise)."""
    model: str | None = None
    amx: bool | None = None
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {"model": None, "amx": None}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip() or None
        elif key == "flags" and amx is None:
            amx = "amx_tile" in value.split()
        if model is not None and amx is not None:
            break
    return {"model": model, "amx": amx}


def host_info(path: Path = CPUINFO) -> dict[str, Any]:
    """What ``machine`` says in a benchmark's JSON."""
    cpu = cpu_info(path)
    return {"cpus": os.cpu_count(), "cpu_model": cpu["model"], "amx": cpu["amx"],
            "python": platform.python_version(), "platform": platform.platform()}


def describe_cpu(machine: dict[str, Any]) -> str:
    """``AMD EPYC, 2 CPUs, no AMX``: the host in a table's configuration line."""
    amx = {True: "AMX", False: "no AMX", None: "AMX unknown"}[machine.get("amx")]
    return f"{machine.get('cpu_model') or 'unknown CPU'}, {machine.get('cpus')} CPUs, {amx}"
