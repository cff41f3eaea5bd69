"""The node check's thresholds: defaults, and the ``elasticrun check`` / ``run`` flags that override them."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Dict, Mapping

from elasticrun.errors import ConfigError

GIB = 1 << 30


@dataclass(frozen=True)
class Thresholds:
    """What a healthy node must measure. Each field is one flag (``--min-cpu-gflops`` ...), see docs/reliability.md."""

    min_cpu_gflops: float = 2.0  # single-thread float32 256×256 matmul; a healthy x86/ARM core does 15-60
    min_disk_free_gib: float = 1.0  # free space where checkpoints go
    min_disk_write_mbps: float = 20.0  # fsync'd sequential write, MB/s (10^6 bytes)
    min_shm_free_gib: float = 0.25  # free /dev/shm (the memory tier, NCCL's shared-memory transport)
    min_shm_write_mbps: float = 50.0
    max_etcd_rtt_ms: float = 100.0  # one read of the job's etcd, round trip
    max_gpu_temp_c: float = 87.0
    max_gpu_ecc_uncorrected: float = 0.0  # volatile (since the driver loaded) uncorrected ECC errors
    max_gpu_retired_pages: float = 0.0  # pages retired for double-bit errors (or rows remapped for them)
    min_gpu_free_fraction: float = 0.9  # free / total memory: another process holding a GPU shows here
    min_gpu_matmul_ratio: float = 0.7  # bf16 matmul speed vs the model's expected figure (and vs the node's best GPU)
    min_gloo_gbps: float = 0.005  # loopback all-reduce bus bandwidth between 2 CPU processes
    min_nccl_gbps: float = 5.0  # all-reduce bus bandwidth across the node's GPUs

    @staticmethod
    def flag(name: str) -> str:
        """The command-line flag of field ``name``: ``min_cpu_gflops`` -> ``--min-cpu-gflops``."""
        return "--" + name.replace("_", "-")

    def with_overrides(self, values: Mapping[str, object]) -> Thresholds:
        """A copy with ``values`` (field name -> number or text); ConfigError (one line naming the flag)
        on a value that is not a number, negative, or a fraction above 1."""
        known = {f.name for f in fields(self)}
        changed: Dict[str, float] = {}
        for name, raw in values.items():
            if raw is None:
                continue
            if name not in known:
                raise ConfigError(f"unknown threshold {name!r}")
            try:
                value = float(raw)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise ConfigError(f"{self.flag(name)} {raw!r} is not a number") from None
            if not value >= 0 or value == float("inf"):
                raise ConfigError(f"{self.flag(name)} {raw!r} must be a number >= 0")
            if (name.endswith("_fraction") or name.endswith("_ratio")) and value > 1:
                raise ConfigError(f"{self.flag(name)} {raw!r} is a fraction: give a number from 0 to 1")
            changed[name] = value
        return replace(self, **changed)

    def parse_list(self, text: str, flag: str = "--node-check-thresholds") -> Thresholds:
        """A copy with ``text`` applied: ``NAME=N,...`` with the names of ``elasticrun check``'s flags
        (``min-cpu-gflops=20``); ConfigError (one line naming ``flag``) on anything else."""
        known = {f.name for f in fields(self)}
        values: Dict[str, object] = {}
        for item in (part.strip() for part in text.split(",")):
            if not item:
                continue
            name, sep, value = item.partition("=")
            key = name.strip().lstrip("-").replace("-", "_")
            if not sep or key not in known:
                names = ", ".join(sorted(n.replace("_", "-") for n in known))
                raise ConfigError(f"{flag} {item!r}: expected NAME=N with NAME one of {names}")
            values[key] = value.strip()
        try:
            return self.with_overrides(values)
        except ConfigError as err:
            raise ConfigError(f"{flag}: {err}") from None

    def to_dict(self) -> Dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


__all__ = ["GIB", "Thresholds"]
