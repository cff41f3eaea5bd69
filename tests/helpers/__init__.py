"""Test helpers shared by several test modules (import as ``helpers.<module>``; tests/ is on sys.path).

- ``helpers.procs``: condition waits with deadlines, agents as real processes (re-exported by conftest);
- ``helpers.launch``: launcher-test helpers (``launch_helpers`` is its old name, kept importable);
- ``helpers.ckpt``: checkpoint-test helpers (``ckpt_helpers`` is its old name, kept importable);
- ``helpers.tls``: certificates made with ``cryptography`` and a secured etcd (TLS, auth, job users);
- ``helpers.fake_store``: an in-memory stand-in for the etcd client, for protocol unit tests.
"""
