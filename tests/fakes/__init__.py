"""Fake routers and fake vLLM backends, in process behind ``httpx2.MockTransport``.

``router_api``: what every fake kvturn router does the same way (docs/http-api.md, section A):
record requests, report reuse in the response headers, serve keepalive and release.
``router``: the SDK tests' router, with scripted answers and canned replies.
``agent_router``: the integration tests' router, which plays a tool-calling model.
``bench_router``: the agent benchmarks' routers (streamed replies, conversation endpoints).
``backends``: the router tests' vLLM prefills, decodes and control endpoints (``Cluster``).
"""
