"""examples/quickstart.py against the fake router (and against nothing at all)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx2
import pytest

import kvturn
from tests.fakes.router import FakeRouter

EXAMPLE = Path(__file__).parents[2] / "examples" / "quickstart.py"


@pytest.fixture
def quickstart() -> ModuleType:
    spec = importlib.util.spec_from_file_location("quickstart", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def wire(monkeypatch: pytest.MonkeyPatch, handler: Any) -> None:
    real = kvturn.OpenAI

    def with_transport(**kwargs: Any) -> kvturn.OpenAI:
        return real(http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
                    retry_policy=kvturn.RetryPolicy(sleep=lambda seconds: None), **kwargs)

    monkeypatch.setattr(kvturn, "OpenAI", with_transport)


def test_five_turns_reuse_and_release(quickstart: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    router = FakeRouter()
    wire(monkeypatch, router)
    assert quickstart.main(["--base-url", "http://router.test:8000/v1"]) == 0
    out = capsys.readouterr().out.splitlines()
    turns = [line for line in out if line.startswith("turn ")]
    assert len(turns) == 5
    assert "reuse=miss" in turns[0] and all("reuse=hit" in line for line in turns[1:])
    assert all("TTFT" in line and "no-reuse" not in line for line in turns)
    assert out[-1].startswith("released conversation kvt-")
    assert len(router.to("", method="DELETE")) == 1


def test_a_clear_error_when_nothing_listens(quickstart: ModuleType,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(request: httpx2.Request) -> httpx2.Response:
        raise httpx2.ConnectError("connection refused")

    wire(monkeypatch, refuse)
    assert quickstart.main([]) == 2
    assert "nothing answers at http://127.0.0.1:8000/v1" in capsys.readouterr().err
