"""The command line (``elasticrun run|status|ckpt|etcd``): the top layer.

Owns parsing flags, rendering (rich tables, ``--json``) and one-line errors for users; the
work itself is done below. May import :mod:`elasticrun.launch`, :mod:`elasticrun.rendezvous`,
:mod:`elasticrun.checkpoint`, :mod:`elasticrun.store`, :mod:`elasticrun.job` and the bottom
modules (``errors``, ``proc``). Nothing imports it (but ``python -m elasticrun``).
See the package map in docs/design.md (checked by tests/test_layering.py).
"""
