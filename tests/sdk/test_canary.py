"""Canaries: every openai (and tenacity) internal kvturn relies on, pinned.

openai may change ``_``-prefixed internals in a minor release. If one of these fails after an
upgrade, read the new openai source for that hook before changing the expectation here: the
matching kvturn code (named in each test) must change with it.
"""

from __future__ import annotations

import inspect
from typing import Any

import httpx2
import openai
import pytest
import tenacity
from openai import AsyncStream, Stream
from openai._base_client import AsyncAPIClient, BaseClient, SyncAPIClient, get_platform
from openai._legacy_response import LegacyAPIResponse
from openai._models import FinalRequestOptions

import kvturn
from kvturn._streams import StreamFollower


def params(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


KW = inspect.Parameter.KEYWORD_ONLY
POS = inspect.Parameter.POSITIONAL_OR_KEYWORD


@pytest.mark.parametrize("cls", [SyncAPIClient, AsyncAPIClient])
def test_request_is_the_one_loop_with_this_signature(cls: type) -> None:
    # kvturn._client: OpenAI.request / AsyncOpenAI.request wrap it.
    assert params(cls.request) == [("self", POS), ("cast_to", POS), ("options", POS),
                                   ("stream", KW), ("stream_cls", KW)]
    source = inspect.getsource(cls.request)
    # openai's own loop, which kvturn switches off with options.max_retries = 0
    assert "input_options.get_max_retries(self.max_retries)" in source
    assert "for retries_taken in range(max_retries + 1)" in source
    assert "self._process_response(" in source


@pytest.mark.parametrize("cls", [SyncAPIClient, AsyncAPIClient])
def test_process_response_sees_the_final_response(cls: type) -> None:
    # kvturn._client: _process_response notes the response for the reuse headers.
    assert params(cls._process_response) == [
        ("self", POS), ("cast_to", KW), ("options", KW), ("response", KW), ("stream", KW),
        ("stream_cls", KW), ("retries_taken", KW)]


@pytest.mark.parametrize(("ours", "theirs"), [(kvturn.OpenAI, openai.OpenAI),
                                              (kvturn.AsyncOpenAI, openai.AsyncOpenAI)])
def test_our_overrides_match_openais_signatures(ours: type, theirs: type) -> None:
    for hook in ("request", "_process_response", "_process_response_data"):
        assert params(getattr(ours, hook)) == params(getattr(theirs, hook)), hook
    # every argument kvturn passes by name to copy() and __init__ still exists there
    copy_params = dict(params(theirs.copy))
    for name, kind in params(ours.copy):
        if name in ("self", "kwargs", "retry_policy", "keepalive_interval", "kvturn_url"):
            continue
        assert copy_params.get(name) == kind, name
    init_params = dict(params(theirs.__init__))
    for name, kind in params(ours.__init__):
        if name in ("self", "kwargs", "retry_policy", "keepalive_interval", "kvturn_url",
                    "_kvturn_conversation"):
            continue
        assert init_params.get(name) == kind, name
    assert ours.with_options is ours.copy


def test_copy_rebuilds_through_the_class_with_extra_kwargs() -> None:
    # kvturn._client: OpenAI.__new__ picks the conversation class from these kwargs.
    source = inspect.getsource(openai.lib._client_auth.synccopy)  # type: ignore[attr-defined]
    assert "self.__class__(" in source and "**_extra_kwargs" in source
    source = inspect.getsource(openai.lib._client_auth.asynccopy)  # type: ignore[attr-defined]
    assert "self.__class__(" in source and "**_extra_kwargs" in source


def test_final_request_options_fields() -> None:
    # kvturn._client._own_options and kvturn._state.ConversationState.prepare
    fields = FinalRequestOptions.model_fields
    for name in ("method", "url", "headers", "max_retries", "json_data", "extra_json",
                 "idempotency_key", "files", "content"):
        assert name in fields, name
    options = FinalRequestOptions.construct(method="post", url="/x", max_retries=3)
    assert options.get_max_retries(7) == 3
    assert FinalRequestOptions.construct(method="post", url="/x").get_max_retries(7) == 7
    copied = options.model_copy(update={"max_retries": 0, "headers": {"a": "b"}})
    assert (copied.max_retries, copied.headers, options.max_retries) == (0, {"a": "b"}, 3)
    # prepare writes json_data to the field's storage, skipping pydantic's __setattr__: the
    # field lives in vars() and every request's options are constructed with it set
    body_options = FinalRequestOptions.construct(method="post", url="/x", json_data={"a": 1})
    assert vars(body_options)["json_data"] == {"a": 1}
    assert "json_data" in body_options.model_fields_set
    for verb in ("post", "patch", "put", "delete"):
        for cls in (SyncAPIClient, AsyncAPIClient):
            assert "json_data=body" in inspect.getsource(getattr(cls, verb)), (cls, verb)


@pytest.mark.parametrize("cls", [Stream, AsyncStream])
def test_streams_decode_every_chunk_through_the_client(cls: type) -> None:
    # kvturn._streams: a followed stream's _client is a stand-in whose _process_response_data
    # sees each chunk. The stream reads it from its client when iteration starts, and uses
    # its client for nothing else after it is built.
    source = inspect.getsource(cls.__stream__)
    assert "process_data = self._client._process_response_data" in source
    assert "response=response" in source
    methods = [f for f in vars(cls).values() if inspect.isfunction(f)]
    assert sum(inspect.getsource(f).count("self._client") for f in methods) == 2  # __init__
    assert "self._decoder = client._make_sse_decoder()" in inspect.getsource(cls.__init__)
    assert params(BaseClient._process_response_data) == [
        ("self", POS), ("data", KW), ("cast_to", KW), ("response", KW)]
    assert params(StreamFollower.take) == params(BaseClient._process_response_data)


def test_raw_responses_cache_their_parse() -> None:
    # kvturn._observe parses a with_raw_response result early; the caller gets the same object.
    source = inspect.getsource(LegacyAPIResponse.parse)
    assert "self._parsed_by_type[cache_key] = parsed" in source


def test_user_agent_is_a_property_named_after_the_class() -> None:
    # kvturn._client: user_agent keeps openai's value for scoped clients.
    assert isinstance(inspect.getattr_static(BaseClient, "user_agent"), property)
    assert "self.__class__.__name__" in inspect.getsource(BaseClient.user_agent.fget)  # type: ignore[union-attr]


def test_httpx2_response_headers_expose_raw_pairs() -> None:
    # kvturn._turns.TurnInfo.from_headers reads headers.raw in one pass.
    response = httpx2.Response(200, headers={"X-KVTurn-Reuse": "hit"})
    assert (b"X-KVTurn-Reuse", b"hit") in response.headers.raw


def test_tenacity_api() -> None:
    # kvturn._retry: the controller and the callbacks it is given.
    for cls in (tenacity.Retrying, tenacity.AsyncRetrying):
        names = inspect.signature(cls.__init__).parameters
        for name in ("sleep", "stop", "wait", "retry", "before_sleep", "reraise"):
            assert name in names, name
    state = tenacity.RetryCallState(tenacity.Retrying(), fn=None, args=(), kwargs={})
    assert state.upcoming_sleep == 0.0 and state.attempt_number == 1
    assert issubclass(tenacity.stop_any, tenacity.stop.stop_base)


@pytest.mark.parametrize(("ours", "theirs", "base"), [
    (kvturn.OpenAI, openai.OpenAI, SyncAPIClient),
    (kvturn.AsyncOpenAI, openai.AsyncOpenAI, AsyncAPIClient)])
def test_the_request_loop_calls_the_hooks_kvturn_overrides(ours: Any, theirs: Any,
                                                            base: Any) -> None:
    # kvturn._base_client: the hooks openai's loop calls per attempt, with these signatures.
    for hook in ("_build_request", "_should_retry", "_sleep_for_retry"):
        assert params(getattr(ours, hook)) == params(getattr(theirs, hook)), hook
    assert params(BaseClient._build_request) == [("self", POS), ("options", POS),
                                                 ("retries_taken", KW)]
    assert params(BaseClient._should_retry) == [("self", POS), ("response", POS)]
    assert params(base._sleep_for_retry) == [("self", POS), ("retries_taken", KW),
                                             ("max_retries", KW), ("options", KW),
                                             ("response", KW)]
    source = inspect.getsource(base.request)
    # the options _build_request stamps are the very object _process_response is given
    assert ("options = self._prepare_options(options)" in source
            or "options = await self._prepare_options(options)" in source)
    assert "request = self._build_request(options, retries_taken=retries_taken)" in source
    assert "options=options," in source and "retries_taken=retries_taken," in source
    # status errors ask _should_retry; connection errors and timeouts go straight to
    # _sleep_for_retry from inside the except block (kvturn raises the loop's error there)
    assert "self._should_retry(err.response)" in source
    assert source.count("_sleep_for_retry(") == 3
    assert "raise APITimeoutError(request=request) from err" in source
    assert "raise APIConnectionError(request=request) from err" in source


def test_timeout_exceptions_are_httpx2s() -> None:
    # kvturn._base_client: the error class raised when the policy stops a timed-out call.
    from kvturn._compat import timeout_exceptions

    assert httpx2.TimeoutException in timeout_exceptions()


def test_the_async_client_looks_its_platform_up_once_per_client() -> None:
    # kvturn._base_client.KVTurnClientBase.copy hands ``_platform`` down to each conversation:
    # openai's async request loop fills it in a worker thread when it is still None.
    source = inspect.getsource(openai.AsyncOpenAI.request)
    assert "self._platform is None" in source and "asyncify(get_platform)" in source
    client = openai.AsyncOpenAI(api_key="x", base_url="http://router.test/v1")
    assert client._platform is None
    assert get_platform() is not None  # what kvturn hands its conversations up front
