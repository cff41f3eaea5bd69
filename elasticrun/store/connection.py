"""Opening an etcd connection: TLS credentials, user/password auth and its token, gRPC options.

The connection half of :class:`~elasticrun.store.client.EtcdStore` (which adds retries and
the key/value, lease and watch calls): checks the TLS and auth settings with one-line
:class:`~elasticrun.errors.StoreError` messages, builds the ``pyetcd`` client and renews its
auth token. With :mod:`elasticrun.store.client`, the only modules that import the etcd library.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Dict, List, Optional, Tuple

import grpc
import pyetcd.exceptions as etcd_exc
from pyetcd import etcdrpc
from pyetcd.client import _EXCEPTIONS_BY_CODE, Endpoint, EtcdTokenCallCredentials, MultiEndpointEtcd3Client

from elasticrun.errors import StoreSetupError

# Never draw from the global `random` the training script seeds and checkpoints (a background
# thread drawing from it would change the script's random numbers): pyetcd's endpoint choice
# uses a private generator (and so does the client's retry jitter).
sys.modules["pyetcd.client"].random = random.Random()  # type: ignore[attr-defined]

# gRPC reconnects slowly by default (up to 120 s backoff); an etcd restart must not stall us.
GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_http_proxy", 0),
]
# WatchTimedOut: a watch was not confirmed within `timeout` (etcd or our watch thread busy): retry.
TRANSIENT = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.WatchTimedOut,
)


def _read(path: Optional[str], what: str) -> Optional[bytes]:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise StoreSetupError(f"cannot read etcd {what} {path!r}: {err.strerror}") from None


def client_args(
    endpoints: str,
    hosts: List[Tuple[str, int]],
    timeout: float,
    user: Optional[str],
    ca_cert: Optional[str],
    cert_key: Optional[str],
    cert_cert: Optional[str],
) -> Dict[str, Any]:
    """The keyword arguments of a ``pyetcd`` client for ``hosts`` (TLS when any certificate is
    given); StoreSetupError, one line, for settings that cannot work."""
    creds = None
    if ca_cert or cert_cert or cert_key:
        if bool(cert_key) != bool(cert_cert):
            raise StoreSetupError("TLS client auth needs both --etcd-cert and --etcd-key")
        creds = grpc.ssl_channel_credentials(
            _read(ca_cert, "CA certificate"), _read(cert_key, "key"), _read(cert_cert, "certificate")
        )
    if user is not None and creds is None:
        # gRPC sends call credentials only over TLS: fail here, not with a cryptic gRPC error later.
        raise StoreSetupError(
            f"etcd user/password authentication needs TLS: also pass --etcd-cacert (etcd at {endpoints} "
            "must serve https)"
        )
    eps = [
        Endpoint(h, p, secure=creds is not None, creds=creds, time_retry=0.5, opts=GRPC_OPTIONS)
        for h, p in hosts
    ]
    return dict(endpoints=eps, timeout=timeout, failover=True)


class _Client(MultiEndpointEtcd3Client):  # type: ignore[misc]
    """pyetcd's client, except that a call's error on the only endpoint fails neither the endpoint nor the
    watches.

    pyetcd answers an UNAVAILABLE or DEADLINE_EXCEEDED call by marking the endpoint failed (every call of
    the client then fails at once until ``time_retry``) and closing the client's watch stream (every
    watch re-reads). With several endpoints that moves the client to another member; with one there is
    none to move to, and one slow call on a busy etcd made every agent that shares the client fail its
    calls and every view re-read the job — more load on the etcd that was slow (measured: 4,096
    simulated agents lost their leases in that loop). A dead etcd breaks the watch stream by itself.
    """

    def _manage_grpc_errors(self, exc: grpc.RpcError) -> None:
        if len(self.endpoints) > 1:
            super()._manage_grpc_errors(exc)
        exception = _EXCEPTIONS_BY_CODE.get(exc.code())
        if exception is None:
            raise exc
        raise exception()


def new_client(args: Dict[str, Any], user: Optional[str], password: Optional[str]) -> MultiEndpointEtcd3Client:
    """A ``pyetcd`` client (it authenticates at once when a user is given)."""
    if (user is None) != (password is None):
        raise StoreSetupError("etcd authentication needs both --etcd-user and a password "
                         "($ELASTICRUN_ETCD_PASSWORD or --etcd-password-file)")
    return _Client(**args, user=user, password=password)


def renew_token(client: MultiEndpointEtcd3Client, user: str, password: Optional[str], timeout: float) -> None:
    """Authenticate again and make ``client`` use the new token for every later call (and new watches)."""
    resp = client.authstub.Authenticate(etcdrpc.AuthenticateRequest(name=user, password=password), timeout)
    client.metadata = (("token", resp.token),)
    client.call_credentials = grpc.metadata_call_credentials(EtcdTokenCallCredentials(resp.token))
    watcher = client._stubs.get("watcher")
    if watcher is not None:
        watcher._metadata = client.metadata
        watcher._credentials = client.call_credentials




def keepalives(client: MultiEndpointEtcd3Client, ids: List[int], timeout: float) -> Dict[int, int]:
    """Send one keep-alive per lease over one LeaseKeepAlive stream with deadline ``timeout``; the TTL
    etcd answered for each (a lease without an answer is absent). An endpoint that times out or is
    unavailable is failed over from (the library's error handling), and the error raised."""
    requests = iter([etcdrpc.LeaseKeepAliveRequest(ID=i) for i in ids])
    answers: Dict[int, int] = {}
    try:
        for resp in client.leasestub.LeaseKeepAlive(requests, timeout, credentials=client.call_credentials,
                                                    metadata=client.metadata):
            answers[int(resp.ID)] = int(resp.TTL)
            if len(answers) == len(ids):
                break
    except grpc.RpcError as err:
        if answers and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            return answers  # a busy etcd answered part of the batch: those leases are confirmed, the rest failed
        client._manage_grpc_errors(err)  # UNAVAILABLE/DEADLINE_EXCEEDED: the member is failed over from
    return answers


__all__ = ["GRPC_OPTIONS", "TRANSIENT", "client_args", "keepalives", "new_client", "renew_token"]
