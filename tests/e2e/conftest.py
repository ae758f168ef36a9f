"""One real stack per test session: prefill + decode vLLM (CPU) with the kvturn connector, the
router, and a plain single vLLM instance of the same model and flags as the reference, which
also scores answers teacher-forced past a near-tie (``_forced``). The session fails when its
answers took more near-ties than ``_ties.BUDGET`` (3): each is a place a comparison had to
accept a different token, and rounding makes them rare.

Each member listens on a loopback address of its own (``_settings.HOSTS``), as on separate
hosts of a fleet, so every test also proves that nothing assumes one host
(test_multi_address.py checks the addresses themselves)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvturn_server.local import (
    INSTALL_HINT,
    Stack,
    StackConfig,
    build_lora_adapter,
    free_port,
    vllm_is_installed,
)
from kvturn_server.local._process import port_is_free
from kvturn_server.local._supervise import Backoff

from ._forced import ReferenceScorer, use_reference
from ._settings import (
    ADAPTERS,
    DECODE_BLOCKS,
    HOSTS,
    KV_READ_TIMEOUT,
    LORA_RANK,
    PREFILL_CONNECTOR_EXTRA,
    RETENTION_BUDGET,
    RETENTION_TTL,
)
from ._ties import BUDGET, TALLY


def same_port(*hosts: str) -> int:
    """A port free on every one of ``hosts``: the prefill's and the decode's side channel and
    control endpoint use the same numbers, as every host of a fleet does (5600, 8101)."""
    while True:
        port = free_port(hosts[0])
        if all(port_is_free(host, port) for host in hosts[1:]):
            return port


def lora_args(state: Path) -> tuple[str, ...]:
    modules = [f"{name}={build_lora_adapter(state / 'adapters' / name, seed=seed, rank=LORA_RANK)}"
               for name, seed in ADAPTERS.items()]
    return ("--enable-lora", "--max-lora-rank", str(LORA_RANK), "--max-loras", "2",
            "--lora-modules", *modules)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that restart the session's decode run last: a restart costs a minute, and the
    other tests should not have to care that the decode they talk to is a new engine."""
    items.sort(key=lambda item: item.get_closest_marker("restarts_decode") is not None)


@pytest.fixture(scope="session")
def say(pytestconfig: pytest.Config) -> Callable[[str], None]:
    """Print past pytest's capture (start-up and restarts take long and must not look hung)."""
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")

    def emit(message: str) -> None:
        with capture.global_and_fixture_disabled():
            print(f"\n[e2e] {message}", flush=True)  # noqa: T201

    return emit


@pytest.fixture(scope="session", autouse=True)
def near_tie_budget() -> Iterator[None]:
    """Fails the session (an error at its last teardown) past ``BUDGET`` near-ties."""
    yield
    verdict = TALLY.verdict(BUDGET)
    if verdict is not None:
        pytest.fail(verdict, pytrace=False)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The session's near-ties, counted whether or not over budget."""
    ties = TALLY.ties
    terminalreporter.write_sep("-", f"near-ties taken: {len(ties)} (budget {BUDGET})")
    for tie in ties:
        terminalreporter.write_line(f"  {tie}")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory,
          say: Callable[[str], None]) -> Iterator[Stack]:
    def progress(elapsed: float, ready: list[str], waiting: list[str]) -> None:
        if waiting and int(elapsed) % 15 == 0 and elapsed - int(elapsed) < 0.5:
            say(f"starting vLLM stack: {elapsed:.0f} s, waiting for {', '.join(waiting)}")

    if not vllm_is_installed():
        pytest.fail(f"e2e tests need the vLLM CPU stack: {INSTALL_HINT}", pytrace=False)
    state = tmp_path_factory.mktemp("stack")
    side, control = (same_port(HOSTS["prefill_host"], HOSTS["decode_host"]) for _ in range(2))
    ports = {"router_port": free_port(HOSTS["router_host"]),
             "prefill_port": free_port(HOSTS["prefill_host"]),
             "decode_port": free_port(HOSTS["decode_host"]),
             "reference_port": free_port(HOSTS["reference_host"]),
             "prefill_side_channel_port": side, "decode_side_channel_port": side,
             "prefill_control_port": control, "decode_control_port": control}
    cfg = StackConfig(state_dir=state, model_dir=Path(state) / "model", with_reference=True,
                      kv_read_timeout=KV_READ_TIMEOUT, decoder_kv_blocks_ttl=RETENTION_TTL,
                      retention_max_hold=10 * RETENTION_TTL, retention_budget=RETENTION_BUDGET,
                      decode_num_blocks=DECODE_BLOCKS,
                      # The session router exercises the prefill path (pins, verified reads):
                      # most tests assert what the prefill read. Turns the decode continues
                      # itself are tested through a second router (test_placement.py).
                      router_args=("--decode-continue-tokens", "0"),
                      prefill_connector_extra=PREFILL_CONNECTOR_EXTRA,
                      extra_vllm_args=lora_args(Path(state)), **HOSTS, **ports)
    started = time.monotonic()
    # Supervised as `kvturn up` runs it (test_supervise.py kills a member); 1 s backoff.
    with Stack(cfg, die_with_parent=True, supervise=True, say=say,
               backoff=Backoff(initial=1.0)) as running:
        running.start(progress=progress)
        use_reference(ReferenceScorer(cfg.reference_url, cfg.served_model_name))
        say(f"stack healthy after {time.monotonic() - started:.0f} s (logs: {state / 'logs'})")
        yield running
