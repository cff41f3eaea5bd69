"""Turning gRPC errors from etcd into one line that says what is wrong and what to do."""

from __future__ import annotations

from typing import Optional, Type

import grpc

from elasticrun.errors import LeaseGoneError, StoreError, StoreSetupError

START_HINT = "is it running? start one with `elasticrun etcd`"
AUTH_FAILED = "authentication failed"
NOSPACE_DETAIL = "database space exceeded"  # etcdserver: mvcc: database space exceeded
_TRANSIENT_WORDS = {"ConnectionFailedError": "connection failed", "ConnectionTimeoutError": "connection timed out"}


def tls_failure(details: str) -> str:
    """The TLS problem in a gRPC error's details ('' if none): a bad certificate is no outage."""
    for marker in ("CERTIFICATE_VERIFY_FAILED", "BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "UNKNOWN_CA",
                   "WRONG_VERSION_NUMBER"):
        if marker in details:
            return marker
    return ""


def out_of_space(err: BaseException) -> bool:
    """True when etcd refused a write because its database is full (the ``NOSPACE`` alarm is on)."""
    if not isinstance(err, grpc.RpcError) or not hasattr(err, "code"):
        return False
    details = err.details() or ""
    return NOSPACE_DETAIL in details or (err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "NOSPACE" in details)


def overloaded(err: BaseException) -> bool:
    """True when etcd turned a request away because it is behind (its apply lags its log by thousands of
    entries: ``too many requests``); it did nothing with it, so the request may be sent again later."""
    return isinstance(err, grpc.RpcError) and "too many requests" in (getattr(err, "details", lambda: "")() or "")


def error_class(err: BaseException) -> Type[StoreError]:
    """What to raise for ``err``: StoreSetupError when etcd refused our TLS or credentials (no retry helps),
    LeaseGoneError when the lease a request named is gone (expired or revoked), else StoreError."""
    if isinstance(err, grpc.RpcError) and "requested lease not found" in (getattr(err, "details", lambda: "")() or ""):
        return LeaseGoneError
    return StoreSetupError if refused(err) else StoreError


def nospace_message(endpoints: str) -> str:
    """What an operator runs when etcd at ``endpoints`` is full (one line)."""
    ep = endpoints.split(",")[0]
    return (
        f"etcd at {endpoints} is out of space (NOSPACE alarm: its database reached --quota-backend-bytes) and "
        f"refuses every write: free it with `etcdctl --endpoints {ep} compact <revision>` (the revision from "
        f"`etcdctl --endpoints {ep} endpoint status -w json`), `etcdctl --endpoints {endpoints} defrag` and "
        f"`etcdctl --endpoints {ep} alarm disarm`, or restart it with a larger --quota-backend-bytes; run etcd with "
        "--auto-compaction-retention so it does not fill again (docs/reliability.md)"
    )


def token_rejected(err: BaseException) -> bool:
    """True when etcd refused our auth token (expired after --auth-token-ttl, or etcd restarted)."""
    if not isinstance(err, grpc.RpcError) or not hasattr(err, "code"):
        return False
    details = (err.details() or "").lower()
    return "invalid auth token" in details or "auth store is old" in details or (
        err.code() == grpc.StatusCode.UNAUTHENTICATED and AUTH_FAILED not in details
    )


def refused(err: BaseException) -> bool:
    """True when etcd refused our TLS, credentials or permissions: a setup error no retry fixes."""
    if not isinstance(err, grpc.RpcError) or not hasattr(err, "code"):
        return False
    details = err.details() or ""
    return bool(tls_failure(details)) or err.code() in (
        grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED
    ) or AUTH_FAILED in details or "permission denied" in details or "user name is empty" in details


def explain(err: BaseException, endpoints: str, user: Optional[str], *, transient: bool = False) -> str:
    """One line for ``err`` (``transient``: the library's connection error), for user ``user`` (None: none)."""
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        code, details = err.code(), (err.details() or "")
        if out_of_space(err):
            return nospace_message(endpoints)
        if tls_failure(details):
            return (
                f"TLS with etcd at {endpoints} failed ({tls_failure(details)}): check --etcd-cacert (the CA "
                "of etcd's certificate) and --etcd-cert/--etcd-key (when etcd requires client certificates)"
            )
        if user is not None and AUTH_FAILED in details:
            return f"etcd at {endpoints} rejected user {user!r}: wrong user name or password"
        if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in details:
            if user is None:
                return (
                    f"etcd at {endpoints} denied access to a client without --etcd-user ({details}; with "
                    "client certificates, the certificate's common name is the user): pass --etcd-user and a "
                    "password, or a certificate of a user whose role grants the job's prefix"
                )
            return (
                f"etcd at {endpoints} denied user {user!r} access ({details}): the user's role "
                "must grant read/write on the job's prefix /elasticrun/<job_id>/ (see docs/security.md)"
            )
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED) or (
            "user name is empty" in details or "authentication" in details.lower()
        ):
            return (
                f"etcd at {endpoints} requires authentication ({details}): pass --etcd-user, a "
                "password ($ELASTICRUN_ETCD_PASSWORD or --etcd-password-file) and --etcd-cacert"
            )
        return f"etcd at {endpoints} refused the request: {code.name}: {details}"
    if transient:
        reason = _TRANSIENT_WORDS.get(err.__class__.__name__, err.__class__.__name__)
        return f"cannot reach etcd at {endpoints} ({reason}); {START_HINT}"
    return f"etcd at {endpoints} failed: {err!r}"


__all__ = ["AUTH_FAILED", "NOSPACE_DETAIL", "START_HINT", "explain", "nospace_message", "out_of_space", "refused",
           "tls_failure", "token_rejected"]
