"""Fake routers and fake vLLM backends, in process behind ``httpx2.MockTransport``, and the
harnesses the tests drive them with.

``router_api``: what every fake kvturn router does the same way (docs/http-api.md, section A):
record requests, report reuse in the response headers, serve keepalive and release.
``router``: the SDK tests' router, with scripted answers and canned replies.
``agent_router``: the integration tests' router, which plays a tool-calling model;
``agent_clients``: what the integration tests' clients on it share.
``bench_router``: the agent benchmarks' routers (streamed replies, conversation endpoints).
``backends``: the router tests' vLLM prefills, decodes and control endpoints (``Cluster``).
``router_harness``: a real router over ``backends.Cluster`` with an in-process client
(``Harness``; the ``make_harness`` fixture of ``tests/server/conftest.py`` builds them).
``keeper``: vLLM's block pool and a manual clock for the connector's retention keeper.

Tests import fakes from here, never from a ``conftest`` (``tests/test_layout.py``).
"""
