"""The etcd client's endpoint list replaced while it runs (store/connection.py ``Client.set_endpoints``):
channels are made lazily by gRPC, so no etcd is needed to see which ones are kept, moved off and closed."""

from __future__ import annotations

from typing import List

import pytest

from elasticrun.store.connection import client_args, new_client


def _client(endpoints: str):  # noqa: ANN202 - the library's client type
    hosts = [(h, int(p)) for h, p in (e.split(":") for e in endpoints.split(","))]
    return new_client(client_args(endpoints, hosts, 1.0, None, None, None, None), None, None)


def _endpoints(endpoints: str) -> List:
    hosts = [(h, int(p)) for h, p in (e.split(":") for e in endpoints.split(","))]
    return client_args(endpoints, hosts, 1.0, None, None, None, None)["endpoints"]


def test_a_listed_member_keeps_its_channel_and_a_dropped_one_is_left() -> None:
    client = _client("127.0.0.1:1")
    try:
        client._current_endpoint_label = "127.0.0.1:1"
        first = client.endpoints["127.0.0.1:1"]
        client.set_endpoints(_endpoints("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"))
        assert list(client.endpoints) == ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
        assert client.endpoints["127.0.0.1:1"] is first, "the channel in use is kept"
        assert client._current_endpoint_label == "127.0.0.1:1"

        client.set_endpoints(_endpoints("127.0.0.1:2,127.0.0.1:3"))
        assert list(client.endpoints) == ["127.0.0.1:2", "127.0.0.1:3"]
        assert client._current_endpoint_label == "127.0.0.1:2", "moved off the member no longer listed"
        assert client.endpoint_in_use is client.endpoints["127.0.0.1:2"]
        assert client._retired == [first], "closed at the next change, not under a call still waiting on it"
        with pytest.raises(ValueError):  # a label no longer listed reads as a failed member: callers fail over
            client._current_endpoint_label = "127.0.0.1:9"
            client.endpoint_in_use  # noqa: B018 - the property raises
    finally:
        client.close()


def test_the_failover_order_skips_a_member_that_failed() -> None:
    client = _client("127.0.0.1:1,127.0.0.1:2")
    try:
        client._current_endpoint_label = "127.0.0.1:1"
        client.endpoints["127.0.0.1:1"].fail()
        client.set_endpoints(_endpoints("127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"))
        assert client.endpoints["127.0.0.1:1"].is_failed(), "a failed member stays failed when listed again"
        client.channel  # noqa: B018 - picks the member to use
        assert client._current_endpoint_label in ("127.0.0.1:2", "127.0.0.1:3")
    finally:
        client.close()


class _Call:
    """The gRPC stream of a watcher, as far as ending it goes."""

    def __init__(self) -> None:
        self.cancelled = 0

    def cancel(self) -> None:
        self.cancelled += 1


def _watcher():  # noqa: ANN202 - the library's watcher type
    from elasticrun.store.connection import LiveWatcher

    watcher = LiveWatcher(object(), "127.0.0.1:1", timeout=1.0)
    watcher.call = _Call()
    return watcher


def test_a_refused_watch_ends_the_stream_instead_of_being_kept_silent() -> None:
    from pyetcd import etcdrpc
    from pyetcd.watch import _NewWatch

    watcher = _watcher()
    watcher._new_watch = _NewWatch(lambda _resp: None)  # a watch being made
    watcher._handle_response(etcdrpc.WatchResponse(created=True, canceled=True, watch_id=-1,
                                                   cancel_reason="etcdserver: permission denied"))
    assert watcher.call.cancelled == 1 and watcher.refused == 1, "the stream is ended: the watch is made again"
    assert -1 not in watcher._callbacks, "the refused watch is not kept"

    watcher._new_watch = None
    watcher._callbacks[7] = lambda _resp: None  # a watch we hold, ended by etcd
    watcher._handle_response(etcdrpc.WatchResponse(canceled=True, watch_id=7, cancel_reason="gone"))
    assert watcher.call.cancelled == 2 and watcher.refused == 2


def test_the_answer_to_our_own_cancel_or_a_compaction_leaves_the_stream_alone() -> None:
    from pyetcd import etcdrpc

    watcher = _watcher()
    watcher._handle_response(etcdrpc.WatchResponse(canceled=True, watch_id=3))  # we cancelled 3: no callback left
    seen: List = []
    watcher._callbacks[4] = seen.append
    watcher._handle_response(etcdrpc.WatchResponse(canceled=True, watch_id=4, compact_revision=9))
    assert watcher.call.cancelled == 0 and watcher.refused == 0
    assert len(seen) == 1 and type(seen[0]).__name__ == "RevisionCompactedError", "the library reports compaction"
