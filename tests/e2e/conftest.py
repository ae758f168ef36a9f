"""One real stack per test session: prefill + decode vLLM (CPU) with the kvturn connector, the
router, and a plain single vLLM instance of the same model and flags as the reference."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvturn_server.local import INSTALL_HINT, Stack, StackConfig, free_port, vllm_is_installed

# Short enough that the stalled-transfer test finishes quickly, long enough that a healthy read
# on a loaded 2-core machine never trips it.
KV_READ_TIMEOUT = 5.0


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory,
          pytestconfig: pytest.Config) -> Iterator[Stack]:
    # Start-up takes 1-2 minutes and should not look like a hang: print past pytest's capture.
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def say(message: str) -> None:
        with capture.global_and_fixture_disabled():
            print(f"\n[e2e] {message}", flush=True)  # noqa: T201

    def progress(elapsed: float, ready: list[str], waiting: list[str]) -> None:
        if waiting and int(elapsed) % 15 == 0 and elapsed - int(elapsed) < 0.5:
            say(f"starting vLLM stack: {elapsed:.0f} s, waiting for {', '.join(waiting)}")

    if not vllm_is_installed():
        pytest.fail(f"e2e tests need the vLLM CPU stack: {INSTALL_HINT}", pytrace=False)
    state = tmp_path_factory.mktemp("stack")
    ports = {name: free_port() for name in (
        "router_port", "prefill_port", "decode_port", "reference_port",
        "prefill_side_channel_port", "decode_side_channel_port")}
    cfg = StackConfig(state_dir=state, model_dir=Path(state) / "model", with_reference=True,
                      kv_read_timeout=KV_READ_TIMEOUT, bidirectional=True,
                      decoder_kv_blocks_ttl=120, **ports)
    started = time.monotonic()
    with Stack(cfg, die_with_parent=True) as running:
        running.start(progress=progress)
        say(f"stack healthy after {time.monotonic() - started:.0f} s (logs: {state / 'logs'})")
        yield running
