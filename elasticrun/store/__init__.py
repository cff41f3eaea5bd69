"""The one door to etcd: the client (retries, watches, leases, auth), the etcd server process.

Owns every call to the etcd library (``client``, ``connection``), the connection settings
(``settings``), lease keep-alive, one-line error explanations, etcd users and roles
(``admin``) and starting a local etcd (``server``). Knows no job: a key, a prefix or an
environment variable's name that a caller cares about is passed in. Imports ``errors``,
``proc``, ``sizes`` and ``waiting`` only. See the package map in docs/design.md.
"""
