#!/usr/bin/env bash
# One device call that checks and measures everything GPU-side; logs land in $OUT (or ./gpu_logs).
#   carry: [".whl", ".gpu_data"]  (fill .whl with ../shared/tools/device-wheels.sh, .gpu_data/text with
#   python data/prepare_text.py --source ../shared/data/text/wikipedia_en_wikiextractor --out .gpu_data/text)
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/env.txt"; git log --oneline -1 >> "$OUT/env.txt"
python -m pytest -m gpu -q -rs tests 2>&1 | tee "$OUT/pytest_gpu.log" | tail -5
python scripts/bench_train.py "$@" 2>&1 | tee "$OUT/bench_train.log" | tail -16
