"""The rendezvous protocol in etcd: under the agent, over the store.

Owns the records stored in etcd and their parsers (``records``), the job/round state enums
(``states``), the restart budget (``restarts``), the watch-fed job mirror (``view``), forming
and ending rounds (``protocol``, ``leader``, ``ranks``, ``watch``, ``writer``; decided in ``plan``,
``roundend`` and ``inplace``) and the read-only status
documents of ``elasticrun status`` (``jobstatus``). May import :mod:`elasticrun.store`,
:mod:`elasticrun.job` and ``errors``; never ``launch`` or the CLI. Imported by the CLI, the
agent and (its records only) ``train``.
See the package map in docs/design.md (checked by tests/test_layering.py).
"""
