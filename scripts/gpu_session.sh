#!/usr/bin/env bash
# GPU checks and measurements, one stage per device call (each fits the 10-minute limit);
# logs land in $OUT (or ./gpu_logs).
#   scripts/gpu_session.sh tests      # every GPU-marked test (kernels at real shapes, bf16, compile)
#   scripts/gpu_session.sh train      # whole-model throughput / MFU / memory table of every variant
#   scripts/gpu_session.sh kernels    # FoX vs SDPA (FlashAttention-2 and cuDNN), CASTLE D=128 sweep, CASTLE decode latency
#   scripts/gpu_session.sh multi      # 2-4 GPUs: tree attention, sharded decoding, DDP/FSDP scaling, 2-GPU tests
#   scripts/gpu_session.sh compare    # the small-scale comparison (scripts/compare_small.sh), one run per GPU
# carry: [".whl", ".gpu_data"]: fill .whl with ../shared/tools/device-wheels.sh, .gpu_data/text with
# `python data/prepare_text.py --source ../shared/data/text/wikipedia_en_wikiextractor --out .gpu_data/text`.
# Keep each stage under the device's 10-minute limit: compiling the CASTLE models takes ~1-2 min each.
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/env.txt"; git log --oneline -1 >> "$OUT/env.txt"
case "${1:-tests}" in
  tests)   python -m pytest -m gpu -q -rs tests/test_gpu_model.py tests/test_castle_kernels.py \
             tests/test_forgetting_kernels.py tests/test_tree.py tests/test_sharded_decode.py 2>&1 \
             | tee "$OUT/pytest_gpu.log" | tail -8 ;;
  train)   shift; python scripts/bench_train.py "$@" 2>&1 | tee "$OUT/bench_train.log" | tail -16 ;;
  kernels) python -m scripts.bench_forgetting --L 2048 16384 2>&1 | tee "$OUT/bench_forgetting.log" | tail -12
           python -m scripts.bench_castle --L 2048 --D 128 --B 8 --H 16 --dtype bf16 --sweep --jobs 16 2>&1 \
             | tee "$OUT/castle_sweep_d128.log" | tail -22
           python -m scripts.bench_castle --decode 2>&1 | tee "$OUT/bench_castle_decode.log" | tail -10 ;;
  multi)   N=$(nvidia-smi -L | wc -l)
           torchrun --standalone --nproc_per_node=$N -m scripts.bench_tree --ctx 131072,1048576,4194304 2>&1 \
             | tee "$OUT/tree.log" | tail -8
           torchrun --standalone --nproc_per_node=$N scripts/bench_sharded_decode.py --attention baseline,fox,castle \
             --ctx 1048576 --check 256 --graphs 2>&1 | tee "$OUT/sharded.log" | tail -10
           python -m pytest -m gpu -q -rs tests/test_tree.py tests/test_sharded_decode.py 2>&1 | tee "$OUT/pytest_2gpu.log" | tail -4
           python scripts/bench_scaling.py --gpus $(printf "%s\n" 1 2 $N | sort -un) --steps 14 --skip 4 --out /tmp/scaling -- experiment=baseline_paper_M \
             data=text data.dir=.gpu_data/text train.micro_batch_size=16 2>&1 | tee "$OUT/scaling.log" | tail -10 ;;
  compare) bash scripts/compare_small.sh .gpu_data/text /tmp/compare 2>&1 | tee "$OUT/compare.log"
           cp /tmp/compare/*.png "$OUT/" ;;
  *)       echo "unknown stage $1: tests | train | kernels | multi | compare"; exit 2 ;;
esac
