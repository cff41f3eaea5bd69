"""Cutting the sockets a round's groups opened (sockets.py): real sockets of this process, no torch."""

from __future__ import annotations

import socket

from elasticrun.sockets import OpenedSockets, socket_fds


def _pair():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    return server, client, peer


def test_only_the_sockets_opened_inside_watch_are_cut_and_the_peer_sees_the_end() -> None:
    before_server, before_client, before_peer = _pair()  # opened earlier: must survive the cut
    opened = OpenedSockets()
    with opened.watch():
        server, client, peer = _pair()
    assert client.fileno() in opened.opened and before_client.fileno() not in opened.opened
    peer.settimeout(5)
    assert opened.cut() >= 1
    assert peer.recv(1) == b"", "the peer's pending read ends at once"
    before_peer.sendall(b"x")
    assert before_client.recv(1) == b"x", "a socket opened before the watch still works"
    assert opened.opened == {}, "forgotten once cut"
    late = socket.create_connection(server.getsockname(), timeout=5)  # a listener is never shut down
    late.close()
    for s in (before_server, before_client, before_peer, server, client, peer):
        s.close()


def test_a_descriptor_closed_and_reused_is_left_alone() -> None:
    opened = OpenedSockets()
    with opened.watch():
        server, client, peer = _pair()
    fd = client.fileno()
    client.close()
    other_server, other_client, other_peer = _pair()  # may reuse the number, under another inode
    opened.cut()
    other_peer.sendall(b"y")
    assert other_client.recv(1) == b"y", (fd, other_client.fileno())
    for s in (server, peer, other_server, other_client, other_peer):
        s.close()


def test_without_proc_nothing_is_recorded(tmp_path) -> None:
    assert socket_fds(str(tmp_path / "absent")) == {}
    opened = OpenedSockets(str(tmp_path / "absent"))
    with opened.watch():
        s = socket.socket()
    assert opened.opened == {} and opened.cut() == 0
    s.close()
