#!/usr/bin/env bash
# GPU checks and measurements, one stage per device call (each fits the 10-minute limit);
# logs land in $OUT (or ./gpu_logs).
#   scripts/gpu_session.sh tests      # every GPU-marked test (kernels at real shapes, bf16, compile)
#   scripts/gpu_session.sh train      # whole-model throughput / MFU / memory table of every variant
#   scripts/gpu_session.sh kernels    # FoX D=128, CASTLE decode latency
# carry: [".whl", ".gpu_data"]: fill .whl with ../shared/tools/device-wheels.sh.
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/env.txt"; git log --oneline -1 >> "$OUT/env.txt"
case "${1:-tests}" in
  tests)   python -m pytest -m gpu -q -rs tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -8 ;;
  train)   shift; python scripts/bench_train.py "$@" 2>&1 | tee "$OUT/bench_train.log" | tail -16 ;;
  kernels) python scripts/bench_forgetting.py --D 128 2>&1 | tee "$OUT/bench_forgetting_d128.log" | tail -12
           python scripts/bench_castle.py --decode 2>&1 | tee "$OUT/bench_castle_decode.log" | tail -10 ;;
  *)       echo "unknown stage $1: tests | train | kernels"; exit 2 ;;
esac
