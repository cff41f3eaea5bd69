#!/usr/bin/env bash
# GPU smoke check (device machine): wheels for the etcd client/binary in .whl/, then the CUDA/NCCL path.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
python3 -c "import torch, google.protobuf, grpc; print(torch.__version__, torch.cuda.device_count(), google.protobuf.__version__, grpc.__version__)"
nvidia-smi -L
export PYTHONUNBUFFERED=1
D=$(mktemp -d)
timeout 120 python3 -m elasticrun --standalone --nproc-per-node gpu tests/scripts/gpu_check.py $D/a 2>&1 | tail -n 15; echo "rc=${PIPESTATUS[0]}"
timeout 120 python3 -m elasticrun --standalone --nproc-per-node gpu --max-restarts 1 tests/scripts/gpu_check.py $D/b --fail-once 2>&1 | grep -v "^\[.*\]:\[rank" | tail -n 15; echo "rc=${PIPESTATUS[0]}"
python3 -m elasticrun etcd --port 23799 > $D/etcd.log 2>&1 &
sleep 2
SLEEP_S=20 timeout 100 python3 -m elasticrun --nnodes 1 --nproc-per-node auto --rdzv-endpoint 127.0.0.1:23799 --rdzv-id gpujob tests/scripts/report_env.py $D > $D/agent.log 2>&1 &
for i in $(seq 1 40); do python3 -m elasticrun status --rdzv-endpoint 127.0.0.1:23799 --rdzv-id gpujob --json > $D/status.json 2>/dev/null && grep -q '"memory_gib"' $D/status.json && break; sleep 1; done
python3 -c "import json;d=json.load(open('$D/status.json'));print(json.dumps(d, indent=1)[:2500])"
wait %2; echo "agent rc=$?"; tail -n 5 $D/agent.log
cat $D/rank0-*.json | head -c 1500
kill %1
