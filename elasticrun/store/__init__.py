"""The one door to etcd: the client (retries, watches, leases, auth), the etcd server process.

Owns every call to the etcd library (``client``, ``connection``), lease keep-alive, one-line
error explanations, etcd users/roles for jobs (``admin``) and starting a local etcd
(``server``). May import :mod:`elasticrun.job` (key layout, env names), ``errors`` and
``proc``; nothing above. ``job``'s ``EtcdSettings.connect`` opens a client (the one declared
exception in tests/test_layering.py). See the package map in docs/design.md.
"""
