"""Parsing vLLM's Prometheus text."""

from __future__ import annotations

import pytest

from kvturn_server.local._metrics import parse, sources, total

TEXT = """\
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 12.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 256.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 1e3
vllm:nixl_num_failed_transfers_total{engine="0",model_name="m"} 0.0
"""


def test_parse_and_total_by_label() -> None:
    samples = parse(TEXT)
    name = "vllm:prompt_tokens_by_source_total"
    assert total(samples, name, source="local_compute") == 12
    assert total(samples, name, source="external_kv_transfer") == 1000
    assert total(samples, name) == 1268
    assert total(samples, "vllm:nixl_num_failed_transfers_total") == 0
    assert total(samples, "missing") == 0
    got = sources(samples)
    assert (got.computed, got.local_cache, got.transferred) == (12, 256, 1000)


def test_a_brace_and_an_escaped_quote_inside_a_label_value() -> None:
    # A model name may hold any character: `}` ended the label set for the old regex parser,
    # which then lost the sample's labels.
    text = ('vllm:prompt_tokens_by_source_total{model_name="a}b \\"q\\" \\\\ c",'
            'source="local_compute"} 7\n'
            'vllm:prompt_tokens_by_source_total{model_name="x",source="local_compute"} 5\n')
    samples = parse(text)
    name = "vllm:prompt_tokens_by_source_total"
    assert total(samples, name, model_name='a}b "q" \\ c', source="local_compute") == 7
    assert total(samples, name, source="local_compute") == 12


def test_text_that_is_not_prometheus_is_refused() -> None:
    with pytest.raises(ValueError):
        parse("vllm:x 1\nthis is not a sample\n")
