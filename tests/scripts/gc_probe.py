"""Test worker: leaves reference cycles behind and records when they are destroyed.

usage: gc_probe.py OUT_PREFIX
Writes OUT_PREFIX.module and OUT_PREFIX.local with "alive" or "finalizing": whether the cycle
(one in the module namespace, one left by main()) was destroyed while the interpreter was still
whole, or only by the final collection inside interpreter shutdown (where gloo/autograd threads
can no longer take the GIL: the end-of-job hang).
"""

import sys


class Probe:
    def __init__(self, path: str) -> None:
        self.path = path
        self.cycle = self  # only the cyclic garbage collector can free it

    def __del__(self) -> None:
        with open(self.path, "w") as f:
            f.write("finalizing" if sys.is_finalizing() else "alive")


def main() -> None:
    Probe(sys.argv[1] + ".local")


MODULE_PROBE = Probe(sys.argv[1] + ".module")

if __name__ == "__main__":
    main()
