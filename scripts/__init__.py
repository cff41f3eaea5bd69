"""Tools around elasticrun that are not part of the package: benchmarks (``bench/``), the chaos soak
(``chaos/``, ``python -m scripts.chaos``) and the performance page's report (``perf/``)."""
