"""A busy etcd: one slow call must not fail a whole client, and "too many requests" is retried.

Unit tests (no etcd: the calls are fakes raising the gRPC errors etcd sends). Both failed on the
code before: a DEADLINE_EXCEEDED on the only endpoint marked it failed (every call of the client
then failed at once for a while, and its watches were closed), and etcd's "too many requests"
(its apply behind its log) was raised to the agent as a hard error.
"""

from __future__ import annotations

from typing import List

import grpc
import pyetcd.exceptions as etcd_exc
import pytest

from elasticrun.store.client import EtcdStore
from elasticrun.store.connection import client_args, new_client


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def client_of(endpoints: str):
    hosts = [(h, int(p)) for h, p in (e.rsplit(":", 1) for e in endpoints.split(","))]
    return new_client(client_args(endpoints, hosts, 1.0, None, None, None, None), None, None)


def test_a_slow_call_on_the_only_endpoint_does_not_fail_the_client():
    client = client_of("127.0.0.1:1")
    try:
        with pytest.raises(etcd_exc.ConnectionTimeoutError):
            client._manage_grpc_errors(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"))
        assert not client.endpoint_in_use.is_failed()  # the other calls of the client go on
    finally:
        client.close()


def test_with_several_endpoints_a_slow_member_is_failed_over_from():
    client = client_of("127.0.0.1:1,127.0.0.1:2")
    try:
        used = client.endpoint_in_use
        with pytest.raises(etcd_exc.ConnectionTimeoutError):
            client._manage_grpc_errors(FakeRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "slow"))
        assert used.is_failed()
    finally:
        client.close()


def test_too_many_requests_is_retried_and_other_errors_are_not():
    store = EtcdStore("127.0.0.1:1", retry_timeout=5)
    try:
        calls: List[int] = []

        def busy_twice(_client: object) -> int:
            calls.append(1)
            if len(calls) <= 2:
                raise FakeRpcError(grpc.StatusCode.UNKNOWN, "etcdserver: too many requests")
            return 42

        assert store._call("put", busy_twice) == 42 and len(calls) == 3

        def refused(_client: object) -> int:
            calls.append(1)
            raise FakeRpcError(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: key is not provided")

        calls.clear()
        with pytest.raises(Exception, match="key is not provided"):
            store._call("put", refused)
        assert len(calls) == 1
    finally:
        store.close()
