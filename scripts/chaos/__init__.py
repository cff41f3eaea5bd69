"""The seeded chaos soak: ``python -m scripts.chaos --minutes 1 --seed 1`` from the repository root.

``__main__`` is the command line; ``soak`` runs the job under faults (``faults``: what a fault is and the
schedule; ``kinds`` and ``hostile``: the kinds) on the machinery of ``env``; ``audit`` judges the workers' logs
and ``report`` sums it up. ``worker.py`` is started by path by the agents (it wraps examples/train.py).
"""
