"""Opening an etcd connection: TLS credentials, user/password auth and its token, gRPC options.

The connection half of :class:`~elasticrun.store.client.EtcdStore` (which adds retries and
the key/value, lease and watch calls): checks the TLS and auth settings with one-line
:class:`~elasticrun.errors.StoreError` messages, builds the ``pyetcd`` client and renews its
auth token. With :mod:`elasticrun.store.client`, the only modules that import the etcd library.
"""

from __future__ import annotations

import logging
import queue
import random
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import grpc
import pyetcd.exceptions as etcd_exc
from pyetcd import etcdrpc
from pyetcd.client import (
    _EXCEPTIONS_BY_CODE,
    _FAILED_EP_CODES,
    Endpoint,
    EtcdTokenCallCredentials,
    MultiEndpointEtcd3Client,
)
from pyetcd.watch import Watcher

from elasticrun.errors import StoreSetupError

log = logging.getLogger(__name__)

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


T = TypeVar("T")
_PROGRESS = etcdrpc.WatchRequest(progress_request=etcdrpc.WatchProgressRequest())


class _CallRecorder:
    """A Watch stub that remembers the stream it opened, so that the stream can be ended from outside."""

    def __init__(self, stub: Any, owner: LiveWatcher) -> None:
        self._stub, self._owner = stub, owner

    def Watch(self, requests: Any, **kwargs: Any) -> Any:  # noqa: N802 - the gRPC method's name
        self._owner.probed = 0.0  # a new stream (pyetcd reopens one on the same watcher): no probe pending
        call = self._owner.call = self._stub.Watch(requests, **kwargs)
        return call


class LiveWatcher(Watcher):
    """pyetcd's watch stream (every watch of a client shares one), made observable: the member it
    is on (``label``), when that member last answered on it (``heard``), a progress request that
    asks it to answer (:meth:`probe`) and :meth:`end`, which ends the stream: each of its watches
    gets the error (its ``on_error``). A frozen or partitioned member keeps a stream open forever
    and silent; this is how :mod:`elasticrun.store.watchdog` notices and moves the watches."""

    def __init__(self, stub: Any, label: str, **kwargs: Any) -> None:
        super().__init__(_CallRecorder(stub, self), **kwargs)
        self.label = label
        self.call: Any = None
        self.heard = self.probed = 0.0
        self.refused = 0  # watches etcd refused or ended, each of which ended the stream

    def _handle_response(self, rs: Any) -> None:
        self.heard = time.monotonic()
        if rs.canceled and not rs.compact_revision and self._ours(rs):
            # etcd refused a watch being made (the token this stream was opened with expired) or ended one
            # we hold: pyetcd would keep it, silent forever. End the stream instead: each of its watches
            # gets its error and is made again, on a new stream that carries the client's current token.
            self.refused += 1
            log.info("etcd ended a watch on %s (%s): watching again", self.label, rs.cancel_reason or "no reason")
            self.end()
            return
        super()._handle_response(rs)

    def _ours(self, rs: Any) -> bool:
        """Whether ``rs`` answers the watch being made, or concerns a watch we still hold (not one we cancelled)."""
        with self._lock:
            return bool(rs.created and self._new_watch is not None) or rs.watch_id in self._callbacks

    @property
    def active(self) -> bool:
        """Whether the stream carries watches (and has not ended)."""
        return bool(self._callbacks) and not self._stopping

    def probe(self) -> None:
        """Ask the member for a progress answer (etcd answers at once, even with no change)."""
        self.probed = time.monotonic()
        try:
            self._request_queue.put_nowait(_PROGRESS)
        except queue.Full:
            pass

    def end(self) -> None:
        """End the stream now (its watches get a CANCELLED error)."""
        if self.call is not None:
            self.call.cancel()


class Client(MultiEndpointEtcd3Client):
    """The ``pyetcd`` client, with watch streams that :meth:`check_watches` can tell silent."""

    def __init__(self, **kwargs: Any) -> None:
        self.watchers: List[LiveWatcher] = []  # streams that may still carry watches
        self._on = threading.local()  # .label: the member this thread's call went to
        self._retired: List[Endpoint] = []  # endpoints no longer listed, closed at the next change
        super().__init__(**kwargs)

    @property
    def endpoint_in_use(self) -> Endpoint:
        """The member in use (ValueError, as for a failed one, when it is no longer listed)."""
        endpoint = self.endpoints.get(self._current_endpoint_label)
        if endpoint is None:
            raise ValueError("the member in use is no longer listed")
        return endpoint

    def set_endpoints(self, endpoints: List[Endpoint]) -> None:
        """Use ``endpoints`` from now on. The list is replaced whole (other threads may be iterating the old
        one); a member still listed keeps its channel. The channels of members no longer listed are closed
        at the next change, not now: a call still waiting on one must end with that member's answer."""
        old = self.endpoints
        new = {ep.netloc: old.get(ep.netloc, ep) for ep in endpoints}
        for ep in endpoints:
            if new[ep.netloc] is not ep:
                ep.close()
        for ep in self._retired:
            ep.close()
        self._retired = [ep for label, ep in old.items() if label not in new]
        self.endpoints = {**old, **new}  # the member in use stays listed until we moved off it
        if self._current_endpoint_label not in new:
            self._current_endpoint_label = next(iter(new))  # ends the watch stream: its watches move
        self.endpoints = new

    def close(self) -> None:
        super().close()
        for ep in self._retired:
            ep.close()
        self._retired = []

    @property
    def channel(self) -> grpc.Channel:
        """The channel of the member in use; when it failed, of the member whose last failure is the
        oldest (pyetcd takes the first in the list that is not failed right now: after half a second, the
        frozen member we just left)."""
        try:
            return self.endpoint_in_use.use()
        except ValueError:
            pass
        for label, endpoint in sorted(self.endpoints.items(), key=lambda item: item[1].last_failed):
            if not endpoint.is_failed():
                self._current_endpoint_label = label
                return endpoint.use()
        raise etcd_exc.NoServerAvailableError("No endpoint available and not failed")

    def call(self, fn: Callable[[Client], T]) -> T:
        """``fn(self)``, remembering the member it is sent to (see :meth:`_manage_grpc_errors`)."""
        self._on.label = self._current_endpoint_label
        return fn(self)

    def _manage_grpc_errors(self, exc: grpc.RpcError) -> None:
        """pyetcd fails over from the member in use when a call fails; a call still waiting on a member
        we already left (frozen: its deadline runs out seconds later) must not fail the healthy one in
        use since — nor send us back to the frozen member: the member it went to is failed instead.

        With a single endpoint there is no member to move to: a call's error fails neither the endpoint
        (pyetcd would fail every call of the client until ``time_retry``) nor the watches (every watch
        would re-read) — else one slow call on a busy etcd would fail every agent sharing the client and
        make every view re-read the job: more load on the etcd that is already slow, a loop in which agents
        lose their leases. A dead etcd breaks the watch stream by itself."""
        if len(self.endpoints) == 1:
            exception = _EXCEPTIONS_BY_CODE.get(exc.code())
            if exception is None:
                raise exc
            raise exception()
        label = getattr(self._on, "label", None)
        if label is None or label == self._current_endpoint_label or exc.code() not in _FAILED_EP_CODES:
            super()._manage_grpc_errors(exc)
            return
        endpoint = self.endpoints.get(label)  # None: no longer listed (set_endpoints)
        if endpoint is not None:
            endpoint.fail()
        raise _EXCEPTIONS_BY_CODE[exc.code()]()

    def get_watcher(self) -> LiveWatcher:
        channel = self.channel  # may fail over: the label after it is the member the stream is on
        watcher = LiveWatcher(etcdrpc.WatchStub(channel), self._current_endpoint_label, timeout=self.timeout,
                              call_credentials=self.call_credentials, metadata=self.metadata)
        self.watchers = [w for w in self.watchers if not w._stopping] + [watcher]
        return watcher

    def watching(self) -> bool:
        """Whether any stream carries watches."""
        return any(w.active for w in self.watchers)

    def check_watches(self, silence: float) -> List[str]:
        """Probe the watch stream; end each stream that cannot carry events any more, so that its
        watches get their error and are made again (on another member): a stream whose member left
        a progress request unanswered for ``silence`` seconds (that member is failed over from, as
        after a call's deadline), and a stream left behind by a failover (a keep-alive or a call
        that timed out: pyetcd half-closes it, a frozen member never ends it). The silent members."""
        now, current, silent = time.monotonic(), self._stubs.get("watcher"), []
        for w in [w for w in self.watchers if w.active]:
            if w is not current:
                w.end()
            elif w.probed > w.heard and now - w.probed > silence:
                silent.append(w.label)
                if self._current_endpoint_label == w.label and w.label in self.endpoints:
                    self.endpoints[w.label].fail()
                    self._clear_old_stubs()
                w.end()
            elif w.probed <= w.heard:
                w.probe()
        return silent


def new_client(args: Dict[str, Any], user: Optional[str], password: Optional[str]) -> Client:
    """A ``pyetcd`` client (it authenticates at once when a user is given)."""
    if (user is None) != (password is None):
        raise StoreSetupError("etcd authentication needs both --etcd-user and a password "
                         "($ELASTICRUN_ETCD_PASSWORD or --etcd-password-file)")
    return Client(**args, user=user, password=password)


def renew_token(client: MultiEndpointEtcd3Client, user: str, password: Optional[str], timeout: float) -> None:
    """Authenticate again and make ``client`` use the new token for every later call (and new watches)."""
    resp = client.authstub.Authenticate(etcdrpc.AuthenticateRequest(name=user, password=password), timeout)
    client.metadata = (("token", resp.token),)
    client.call_credentials = grpc.metadata_call_credentials(EtcdTokenCallCredentials(resp.token))
    watcher = client._stubs.get("watcher")
    if watcher is not None:
        watcher._metadata = client.metadata
        watcher._credentials = client.call_credentials
        # etcd checks a new watch against the token its stream was opened with: once that token expired, it
        # refuses every new watch on the stream. The stream is opened again, with the new token; its watches
        # get their error and are made again by their owners (who read first, so no change is missed).
        watcher.end()




# Leases per LeaseKeepAlive stream, and the most streams one batch is sent over. etcd answers the
# keep-alives of one stream one after the other, each only once its apply has caught up with its log
# (up to 1 s each when it lags): a batch of 1,000 leases on one stream ran past its deadline as a
# whole. Streams are answered side by side.
KEEPALIVE_STREAM_LEASES = 64
KEEPALIVE_STREAMS_MAX = 16


def keepalives(client: MultiEndpointEtcd3Client, ids: List[int], timeout: float) -> Dict[int, int]:
    """Send one keep-alive per lease, over LeaseKeepAlive streams of up to KEEPALIVE_STREAM_LEASES leases
    (at most KEEPALIVE_STREAMS_MAX streams, side by side) with deadline ``timeout``; the TTL etcd answered
    for each (a lease without an answer is absent). A stream that times out after some answers keeps
    them (the rest failed); an endpoint that times out with no answer, or is unavailable, is failed over
    from (the library's error handling), and the error raised."""
    client.call(lambda _c: None)  # remembers the member these streams go to
    per_stream = max(KEEPALIVE_STREAM_LEASES, -(-len(ids) // KEEPALIVE_STREAMS_MAX))
    calls = [
        client.leasestub.LeaseKeepAlive(
            iter([etcdrpc.LeaseKeepAliveRequest(ID=i) for i in ids[at:at + per_stream]]), timeout,
            credentials=client.call_credentials, metadata=client.metadata,
        )
        for at in range(0, len(ids), per_stream)
    ]
    answers: Dict[int, int] = {}
    error: Optional[grpc.RpcError] = None
    for call, at in zip(calls, range(0, len(ids), per_stream)):
        want = min(per_stream, len(ids) - at)
        got = 0
        try:
            for resp in call:
                answers[int(resp.ID)] = int(resp.TTL)
                got += 1
                if got == want:
                    break
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED or error is None:
                error = err
    if error is not None and (not answers or error.code() != grpc.StatusCode.DEADLINE_EXCEEDED):
        for call in calls:
            call.cancel()
        client._manage_grpc_errors(error)  # UNAVAILABLE/DEADLINE_EXCEEDED: the member is failed over from
    return answers


__all__ = ["GRPC_OPTIONS", "TRANSIENT", "Client", "LiveWatcher", "client_args", "keepalives", "new_client",
           "renew_token"]
