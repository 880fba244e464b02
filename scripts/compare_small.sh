#!/usr/bin/env bash
# The small-scale comparison of docs/results.md: Baseline (two seeds), CASTLE, CASTLE-SWL, Transformer (Pro)
# and FoX (Pro) at ~30M parameters on the same 11.8M Wikipedia tokens in the same order
# (configs/experiment/compare_XS.yaml), then the per-token loss L(i) to 4x the training context and
# the plots. Runs as many variants at once as there are GPUs (one per GPU).
#   python -m data.prepare_text --source ../shared/data/text/wikipedia_en_wikiextractor --out .gpu_data/text
#   bash scripts/compare_small.sh [DATA_DIR=.gpu_data/text] [OUT=runs/compare]
#   EXTRA="train.max_steps=3 train.seq_len=64" bash scripts/compare_small.sh ...   # a quick smoke run
set -euo pipefail
DATA=${1:-.gpu_data/text}; OUT=${2:-runs/compare}; mkdir -p "$OUT"
NGPU=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
RUNS=("baseline model=llama" "baseline_seed2 model=llama train.seed=2" "castle model=castle"
      "castle_swl model=castle_swl" "transformer_pro model=transformer_pro" "fox_pro model=fox_pro")

run() {  # gpu name overrides...
  local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu python train.py experiment=compare_XS data.dir="$DATA" train.out_dir="$OUT/$name" \
      train.resume=never train.if_exists=archive "$@" ${EXTRA:-} > "$OUT/$name.log" 2>&1 &&
  CUDA_VISIBLE_DEVICES=$gpu python eval.py ckpt="$OUT/$name" eval.tasks=[long_context] >> "$OUT/$name.log" 2>&1 ||
  { echo "$name FAILED: see $OUT/$name.log"; return 1; }
  echo "$name: $(grep -a '^done' "$OUT/$name.log" | tail -1)"
}

for i in "${!RUNS[@]}"; do
  run $((i % NGPU)) ${RUNS[$i]} &
  if (( (i + 1) % NGPU == 0 )); then wait; fi
done
wait
DIRS=$(for r in "${RUNS[@]}"; do echo -n "$OUT/${r%% *} "; done)
python -m scripts.plot_runs $DIRS --out "$OUT/loss_curves.png"
python -m scripts.plot_long_context $DIRS --out "$OUT/per_token_loss.png"
