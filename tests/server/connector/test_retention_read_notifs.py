"""A prefill's read of a retention ends with a NIXL notification the decode's vLLM must not see.

vLLM would take ``b"<remote_request_id>:<n>"`` as "this request's blocks may be freed now", for
a request it no longer knows; the decode's worker drops (and counts) those of retentions.
"""

from __future__ import annotations

from kvturn_server.connector._params import READ_PREFIX
from kvturn_server.connector._worker import READ_NOTIF_PREFIX, _drop_retention_reads


def filtered(notifs: dict[str, list[bytes]]) -> tuple[dict[str, list[bytes]], int]:
    served: list[int] = []
    get = _drop_retention_reads(lambda: notifs, lambda: served.append(1))
    return get(), len(served)


def test_the_worker_recognises_what_the_scheduler_publishes() -> None:
    assert READ_PREFIX.encode() == READ_NOTIF_PREFIX


def test_only_retention_reads_are_dropped_and_each_is_counted() -> None:
    out, served = filtered({
        "prefill-a": [b"kvturn-read/req-1:1", b"cmpl-7-0:1", b"kvturn-read/req-2:2"],
        "prefill-b": [b"kvturn-read/req-3:1"],
        "prefill-c": [b"cmpl-9-0:1"],
    })
    assert out == {"prefill-a": [b"cmpl-7-0:1"], "prefill-b": [], "prefill-c": [b"cmpl-9-0:1"]}
    assert served == 3


def test_a_request_id_merely_containing_the_prefix_is_kept() -> None:
    out, served = filtered({"p": [b"cmpl-kvturn-read/x:1", b"kvturn-rea:1"]})
    assert out == {"p": [b"cmpl-kvturn-read/x:1", b"kvturn-rea:1"]}
    assert served == 0


def test_no_notifications_is_no_notifications() -> None:
    assert filtered({}) == ({}, 0)


def test_each_poll_sees_only_that_polls_notifications() -> None:
    batches = iter([{"p": [b"kvturn-read/a:1"]}, {"p": [b"cmpl-1:1"]}])
    served: list[int] = []
    get = _drop_retention_reads(lambda: next(batches), lambda: served.append(1))
    assert get() == {"p": []}
    assert get() == {"p": [b"cmpl-1:1"]}
    assert served == [1]
