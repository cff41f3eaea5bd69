"""The agent (one per node): under the CLI, over the rendezvous.

Owns :class:`~elasticrun.launch.config.LaunchConfig`, the agent's run loop, worker processes
(spawn, fork server, warm standby, logs, failures), etcd hosting for c10d/static, outage
handling and the node's snapshot root. May import :mod:`elasticrun.rendezvous`,
:mod:`elasticrun.store`, :mod:`elasticrun.job`, ``errors`` and ``proc``; never the CLI,
never ``checkpoint`` or ``train`` (workers import those). Imported by the CLI only.
See the package map in docs/design.md (checked by tests/test_layering.py).
"""
