"""Parsing vLLM's Prometheus text."""

from __future__ import annotations

from kvturn_server.local._metrics import parse, total

TEXT = """\
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 12.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 256.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 1e3
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
garbage line
"""


def test_parse_and_total_by_label() -> None:
    samples = parse(TEXT)
    name = "vllm:prompt_tokens_by_source_total"
    assert total(samples, name, source="local_compute") == 12
    assert total(samples, name, source="external_kv_transfer") == 1000
    assert total(samples, name) == 1268
    assert total(samples, "vllm:nixl_num_failed_transfers_total") == 0
    assert total(samples, "missing") == 0
