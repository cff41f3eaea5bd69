"""Test helpers shared by several test modules (import as ``helpers.<module>``; tests/ is on sys.path).

- ``helpers.procs``: condition waits with deadlines, agents as real processes;
- ``helpers.launch``: launcher-test helpers;
- ``helpers.cli``: the ``elasticrun`` command run in the test's own process (exit code, output);
- ``helpers.ckpt``: checkpoint-test helpers;
- ``helpers.elastic``: real elastic jobs of ``tests/scripts/train_loop.py`` (agent lines, step log, pids);
- ``helpers.rdzv``: the rendezvous protocol driven on the in-memory store;
- ``helpers.tls``: certificates made with ``cryptography`` and a secured etcd (TLS, auth, job users);
- ``helpers.fake_store``: an in-memory stand-in for the etcd client, for protocol unit tests.
"""
