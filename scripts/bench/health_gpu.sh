#!/usr/bin/env bash
# GPU node check on the device machine: `elasticrun check` (NVML, matmul per GPU, all-reduce) and its GPU test.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi -L
time timeout 200 python3 -m elasticrun check --ckpt-dir /tmp/ck; echo "rc=$?"
timeout 200 python3 -m pytest -q -x tests/test_health_gpu.py -p no:cacheprovider -s 2>&1 | tail -n 60
