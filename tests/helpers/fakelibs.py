"""Stand-ins for the NVIDIA driver's libraries, built with the host's C compiler for a test.

``libnvidia-ml`` answers from ``FAKE_NVML_UUIDS`` (comma-separated GPU UUIDs; unset: nvmlInit
fails), ``FAKE_NVML_NAMES`` (models) and ``FAKE_NVML_MEMORY`` (total bytes; unset: the call
fails), ``libcuda`` from ``FAKE_CUDA_PCI`` (comma-separated PCI bus ids; ``FAKE_CUDA_INIT_RC``:
what cuInit returns). Both read the variables at each call, so one build serves every test of a session.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

_COMMON = r"""
#include <stdlib.h>
#include <string.h>
static int entry(const char *var, unsigned index, char *out, unsigned len) {
    const char *all = getenv(var);
    if (!all) return -1;
    unsigned i = 0;
    const char *start = all;
    for (;;) {
        const char *end = strchr(start, ',');
        size_t n = end ? (size_t)(end - start) : strlen(start);
        if (i == index) {
            if (n + 1 > len) return -1;
            memcpy(out, start, n);
            out[n] = 0;
            return 0;
        }
        if (!end) return -1;
        start = end + 1;
        i++;
    }
}
static int count(const char *var) {
    const char *all = getenv(var);
    if (!all || !*all) return 0;
    int n = 1;
    for (; *all; all++) n += *all == ',';
    return n;
}
"""

NVML = _COMMON + r"""
int nvmlInit_v2(void) { return getenv("FAKE_NVML_UUIDS") ? 0 : 9; }
int nvmlShutdown(void) { return 0; }
int nvmlDeviceGetCount_v2(unsigned *n) { *n = (unsigned)count("FAKE_NVML_UUIDS"); return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) { *h = (void *)(size_t)(i + 1); return 0; }
int nvmlDeviceGetUUID(void *h, char *buf, unsigned len) {
    return entry("FAKE_NVML_UUIDS", (unsigned)((size_t)h - 1), buf, len) ? 999 : 0;
}
int nvmlDeviceGetName(void *h, char *buf, unsigned len) {
    return entry("FAKE_NVML_NAMES", (unsigned)((size_t)h - 1), buf, len) ? 999 : 0;
}
typedef struct { unsigned long long total, free, used; } memory_t;
int nvmlDeviceGetMemoryInfo(void *h, memory_t *m) {
    char text[32];
    if (entry("FAKE_NVML_MEMORY", (unsigned)((size_t)h - 1), text, sizeof text)) return 999;
    m->total = strtoull(text, 0, 10);
    m->free = m->total;
    m->used = 0;
    return 0;
}
"""

CUDA = _COMMON + r"""
int cuInit(unsigned flags) { const char *rc = getenv("FAKE_CUDA_INIT_RC"); return rc ? atoi(rc) : 0; }
int cuDeviceGetCount(int *n) { *n = count("FAKE_CUDA_PCI"); return 0; }
int cuDeviceGet(int *dev, int i) { *dev = i; return i < count("FAKE_CUDA_PCI") ? 0 : 101; }
int cuDeviceGetPCIBusId(char *buf, int len, int dev) {
    return entry("FAKE_CUDA_PCI", (unsigned)dev, buf, (unsigned)len) ? 101 : 0;
}
"""


def build(directory: Path, name: str, source: str) -> str:
    """Compile ``source`` into ``directory/name`` (a shared library); skip the test without a compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build a fake driver library")
    src = directory / f"{name}.c"
    src.write_text(source)
    lib = directory / name
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    return str(lib)
