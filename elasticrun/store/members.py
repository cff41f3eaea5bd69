"""etcd's cluster membership: list, add a learner, promote it, remove a member (runtime reconfiguration).

The membership calls of etcd's v3 ``Cluster`` service, on an :class:`~elasticrun.store.client.EtcdStore`
(its retries, failover and credentials). ``pyetcd`` ships protobuf classes older than etcd 3.4: no
learners (``MemberAdd{isLearner}``, ``MemberPromote``, ``Member.isLearner``). So these few messages
are written and read here in protobuf's wire format (varints and length-delimited fields), and sent
as bytes on the client's channel: nothing depends on the library's message classes.

The order of a safe addition (etcd's own recipe): :func:`add_learner` (a learner takes no part in
quorum, so a member that never starts costs the cluster nothing), start the new member with
``--initial-cluster-state existing`` and the cluster :func:`initial_cluster` names, then
:func:`promote` it — etcd refuses (:class:`LearnerNotReady`) until it has caught up with the leader.
etcd allows one learner at a time. :func:`remove` is refused (:class:`MembershipRefused`) when it would
leave the cluster without a quorum of started members; a removed member's process exits by itself.
"""

from __future__ import annotations

import urllib.request
from typing import Any, Iterator, List, Tuple, Union

import grpc

from elasticrun.errors import StoreError
from elasticrun.store.client import EtcdStore
from elasticrun.store.types import Member

_SERVICE = "/etcdserverpb.Cluster/"
_STATUS = "/etcdserverpb.Maintenance/Status"
# etcd's answers to a change it will not make (no retry helps; the caller decides): not a learner in
# sync yet, too many learners, no such member, a peer URL in use; and UNKNOWN with etcd's own reason
# (e.g. "re-configuration failed due to not enough started members": no quorum left after a removal).
_REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
             grpc.StatusCode.ALREADY_EXISTS)


class MembershipRefused(StoreError):
    """etcd refused a membership change; the message is etcd's reason."""


class LearnerNotReady(MembershipRefused):
    """The learner has not caught up with the leader yet: promote it again a moment later."""


def already_gone(err: MembershipRefused) -> bool:
    """etcd refused to remove a member it does not list (removed meanwhile, or by a retried call's first try)."""
    return "member not found" in str(err)


# -- protobuf wire format (the few messages used here) -----------------------------------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: bytes, at: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _fields(data: bytes) -> Iterator[Tuple[int, Union[int, bytes]]]:
    """(field number, value) of a message: varints as ints, length-delimited fields as bytes."""
    at = 0
    while at < len(data):
        key, at = _read_varint(data, at)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, at = _read_varint(data, at)
            yield number, value
        elif kind == 2:
            size, at = _read_varint(data, at)
            yield number, data[at:at + size]
            at += size
        elif kind in (1, 5):  # fixed 64/32 bits: no such field in these messages; skipped
            at += 8 if kind == 1 else 4
        else:
            raise StoreError(f"etcd sent a membership answer that cannot be read (wire type {kind})")


def _text(number: int, value: str) -> bytes:
    raw = value.encode()
    return _varint(number << 3 | 2) + _varint(len(raw)) + raw


def _member(data: bytes) -> Member:
    """``Member{ID=1, name=2, peerURLs=3, clientURLs=4, isLearner=5}``."""
    member_id, name, learner = 0, "", False
    peers: List[str] = []
    clients: List[str] = []
    for number, value in _fields(data):
        if number == 1 and isinstance(value, int):
            member_id = value
        elif number == 2 and isinstance(value, bytes):
            name = value.decode(errors="replace")
        elif number == 3 and isinstance(value, bytes):
            peers.append(value.decode(errors="replace"))
        elif number == 4 and isinstance(value, bytes):
            clients.append(value.decode(errors="replace"))
        elif number == 5 and isinstance(value, int):
            learner = bool(value)
    return Member(member_id, name, tuple(peers), tuple(clients), learner)


def _members(data: bytes, number: int) -> List[Member]:
    return [_member(v) for n, v in _fields(data) if n == number and isinstance(v, bytes)]


# -- calls ----------------------------------------------------------------------------------------


def _call(store: EtcdStore, path: str, request: bytes, what: str) -> bytes:
    """One unary call (``path``: ``/service/Method``) with ``store``'s retries, failover and credentials."""

    def op(c: Any) -> bytes:
        call = c.channel.unary_unary(path)
        try:
            return call(request, timeout=store.timeout, credentials=c.call_credentials, metadata=c.metadata)
        except grpc.RpcError as err:
            details = err.details() or err.code().name
            if err.code() in _REFUSALS or (err.code() is grpc.StatusCode.UNKNOWN and details.startswith("etcdserver:")):
                kind = LearnerNotReady if "in sync with leader" in details else MembershipRefused
                raise kind(f"etcd at {store.endpoints} refused to {what}: {details}") from None
            c._manage_grpc_errors(err)  # fails over from that member (as the library's own calls do); raises
            raise

    return store.call(path.rsplit("/", 1)[-1], op)


def list_members(store: EtcdStore) -> List[Member]:
    """Every member, learners and members not started yet included."""
    return _members(_call(store, _SERVICE + "MemberList", b"", "list its members"), 2)


def add_learner(store: EtcdStore, peer_url: str) -> Tuple[Member, List[Member]]:
    """Add a learner that will listen for peers at ``peer_url``: (the new member, every member)."""
    answer = _call(store, _SERVICE + "MemberAdd", _text(1, peer_url) + _varint(2 << 3) + _varint(1), "add a learner")
    new = [_member(v) for n, v in _fields(answer) if n == 2 and isinstance(v, bytes)]
    if not new:
        raise StoreError(f"etcd at {store.endpoints} added a member but did not say which")
    return new[0], _members(answer, 3)


def promote(store: EtcdStore, member_id: int) -> List[Member]:
    """Make the learner ``member_id`` a voting member (LearnerNotReady until it caught up); every member."""
    return _members(_call(store, _SERVICE + "MemberPromote", _varint(1 << 3) + _varint(member_id),
                         "promote a learner"), 2)


def remove(store: EtcdStore, member_id: int) -> List[Member]:
    """Remove member ``member_id`` (MembershipRefused when etcd keeps it, e.g. for its quorum); the rest."""
    return _members(_call(store, _SERVICE + "MemberRemove", _varint(1 << 3) + _varint(member_id), "remove a member"), 2)


def leader_id(store: EtcdStore) -> int:
    """The id of the member that leads the cluster now (0 when there is none), as the member asked says."""
    answer = _call(store, _STATUS, b"", "say its status")
    for number, value in _fields(answer):
        if number == 4 and isinstance(value, int):  # StatusResponse.leader
            return value
    return 0


def answers(client_url: str, timeout: float = 1.0) -> bool:
    """Whether the member at ``client_url`` (plain http) answers at all: ``/version`` is served by the member
    itself, with no raft round, so a busy member answers and only a dead, frozen or unreachable one does not."""
    try:
        with urllib.request.urlopen(client_url.rstrip("/") + "/version", timeout=timeout) as resp:  # noqa: S310
            return resp.status == 200
    except (OSError, ValueError):
        return False


def initial_cluster(members: List[Member], new_id: int, new_name: str) -> str:
    """etcd's ``--initial-cluster`` for the new member ``new_id`` (named ``new_name``) of ``members``: every
    member's name and peer URLs (a member not started yet is named after its id, as etcd does not care)."""
    parts = []
    for m in members:
        name = new_name if m.member_id == new_id else (m.name or f"m{m.member_id:x}")
        parts += [f"{name}={url}" for url in m.peer_urls]
    return ",".join(parts)


def endpoint_of(url: str) -> str:
    """``http://host:port`` → ``host:port`` (the form the client takes)."""
    return url.split("://", 1)[-1].rstrip("/")


__all__ = ["LearnerNotReady", "Member", "MembershipRefused", "add_learner", "already_gone", "answers", "endpoint_of",
           "initial_cluster", "leader_id", "list_members", "promote", "remove"]
