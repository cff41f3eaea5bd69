"""Node health: the pre-flight check (``elasticrun check``, ``run --node-check``) and straggler scores.

The decisions are pure functions of measured figures (:mod:`~elasticrun.health.judge`,
:mod:`~elasticrun.health.straggler`), tested without processes or devices; the measuring is thin
and separate (:mod:`~elasticrun.health.probes`, :mod:`~elasticrun.health.nvml` over ctypes, and
:mod:`~elasticrun.health.torchbench`, which alone imports torch and runs in a child process so that
the agent never does). Below ``launch``, ``rendezvous``, ``train`` and ``cli``: may import ``job``,
``errors``, ``proc``, ``sizes`` (docs/design.md).
"""
