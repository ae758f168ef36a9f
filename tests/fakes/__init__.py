"""Fakes shared by the SDK's and the LangGraph integration's tests.

``router_api``: what every fake kvturn router does the same way (docs/http-api.md, section A):
record requests, report reuse in the response headers, serve keepalive and release.
``router``: the SDK tests' router, with scripted answers and canned replies.
``agent_router``: the integration tests' router, which plays a tool-calling model.
"""
