"""The router sends the control API's shared secret; a decode that refuses it gets no pins.

Fake decodes (``tests/fakes/backends.py``) require the secret when ``control_secret`` is set
and answer 401 otherwise, as the connector does (``test_control_auth.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvturn.wire import HEADER_CONTROL_SECRET
from kvturn_server._control_secret import ENV, ENV_FILE
from kvturn_server.router import RouterConfig, RouterConfigError, add_router_args
from kvturn_server.router._flags import router_config_from_args
from tests.fakes.backends import Cluster
from tests.fakes.router_harness import MakeHarness

SECRET = "fleet-secret-0123456789abcdef"
P, D = "http://prefill:8100", "http://decode:8200"


async def test_every_control_call_carries_the_secret(make_harness: MakeHarness) -> None:
    cluster = Cluster()
    cluster.decodes[0].control_secret = SECRET
    h = await make_harness(cluster, control_secret=SECRET)
    await h.router.health.check_all()
    assert h.router.decodes.members[0].control_ok
    assert (await h.chat("c")).status_code == 200
    resp = await h.chat("c", stream=True)  # captured by describe over the control API
    assert resp.headers["X-KVTurn-Reuse"] == "hit"
    assert (await h.chat("c")).headers["X-KVTurn-Reuse"] == "hit"
    assert (await h.client.post("/kvturn/v1/conversations/c/keepalive")).status_code == 200
    assert (await h.client.delete("/kvturn/v1/conversations/c")).json()["released"] is True
    await h.router.wait_idle()
    control = [e for e in cluster.log if e.backend == "decode0.control"]
    kinds = {e.path.rsplit("/", 1)[-1] for e in control}
    assert {"health", "pin", "keepalive"} <= kinds and len(control) >= 6
    assert all(e.headers.get(HEADER_CONTROL_SECRET.lower()) == SECRET for e in control)
    # Never sent to a completion leg: it is for the control API only.
    assert not any(HEADER_CONTROL_SECRET.lower() in e.headers for e in cluster.log
                   if not e.backend.endswith(".control"))


@pytest.mark.parametrize("router_secret", [None, "another-secret-0123456789"],
                         ids=["no-secret", "wrong-secret"])
async def test_a_refused_secret_means_no_pins_and_turns_still_answer(
        make_harness: MakeHarness, router_secret: str | None) -> None:
    cluster = Cluster()
    h = await make_harness(cluster, control_secret=router_secret)
    decode = cluster.decodes[0]
    assert (await h.chat("c")).status_code == 200  # retained while the secrets agreed
    retained = dict(decode.retentions)
    decode.control_secret = SECRET  # now the decode requires a secret the router lacks
    await h.router.health.check_all()
    assert not h.router.decodes.members[0].control_ok
    resp = await h.chat("c")
    assert resp.status_code == 200
    assert resp.headers["X-KVTurn-Reuse"] == "stale"
    # Nothing reached the keeper: no pin was taken, the retention is as it was (the decode
    # leg itself retains again: that goes through vLLM's API, not the control API).
    assert decode.pins == {}
    assert not any(e.path.endswith("/pin") for e in cluster.log
                   if e.backend == "decode0.control")
    assert set(decode.retentions) == set(retained)
    keepalive = await h.client.post("/kvturn/v1/conversations/c/keepalive")
    assert keepalive.status_code in (404, 503)


async def test_a_401_from_a_pin_is_a_control_failure_not_a_gone(
        make_harness: MakeHarness) -> None:
    cluster = Cluster()
    h = await make_harness(cluster)
    await h.chat("c")
    cluster.decodes[0].control_secret = SECRET  # between two health checks
    resp = await h.chat("c")
    assert resp.status_code == 200 and resp.headers["X-KVTurn-Reuse"] == "stale"
    assert await h.router.store.get("-/c") is not None  # not forgotten: the record is fine
    metrics = (await h.client.get("/metrics")).text
    assert 'kind="unauthorized"' in metrics


# Where the router's secret comes from.

def _parse(*argv: str, environ: dict[str, str] | None = None) -> RouterConfig:
    parser = argparse.ArgumentParser(prog="kvturn router")
    add_router_args(parser)
    return router_config_from_args(parser.parse_args(["--prefill", P, "--decode", D, *argv]),
                                   environ=environ or {})


def test_the_secret_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")
    assert _parse().control_secret is None
    assert _parse(environ={ENV: SECRET}).control_secret == SECRET
    assert _parse(environ={ENV_FILE: str(path), ENV: "x" * 20}).control_secret == SECRET
    assert _parse("--control-secret-file", str(path), environ={ENV: "y" * 20}) \
        .control_secret == SECRET
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"control_secret": SECRET}))
    assert _parse("--config", str(config), environ={ENV: "z" * 20}).control_secret == SECRET


def test_unusable_secrets_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(RouterConfigError, match="cannot read"):
        _parse("--control-secret-file", str(tmp_path / "absent"))
    with pytest.raises(RouterConfigError, match="16-1024"):
        _parse(environ={ENV: "short"})
    with pytest.raises(RouterConfigError, match="not both"):
        RouterConfig(prefill=(P,), decode=(D,), control_secret=SECRET,
                     control_secret_file=str(tmp_path / "s"))


@pytest.mark.parametrize("flag", ["--control-secret", "--control-sec"])
def test_a_secret_typed_as_a_flag_is_refused_not_read_as_a_file_name(
        flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    # An abbreviation of --control-secret-file would make the secret a path, and the
    # "cannot read" error would print it.
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([flag, "s3cret-s3cret-s3cret"])
    assert "unrecognized arguments" in capsys.readouterr().err
