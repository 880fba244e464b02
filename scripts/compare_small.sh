#!/usr/bin/env bash
# The small-scale comparisons of docs/results.md at ~30M parameters on the same 11.8M Wikipedia tokens in the
# same order (configs/experiment/compare_XS.yaml), then the per-token loss L(i) to 4x the training context
# and the plots. Runs PER_GPU variants at once on each GPU (default 1; the XS runs are small, so several
# share a GPU well, but their tokens/s then measure the sharing: time them with scripts.bench_train).
#   SET=main       Baseline (two seeds: the noise level), CASTLE, CASTLE-SWL, Transformer (Pro), FoX (Pro)
#   SET=ablations  the papers' controls (issue 48): Baseline (two seeds), FoX (Pro) with its three forget gates
#                  (FoX arXiv:2503.02130 §4.5), Transformer-SWA (W = 256, 1/8 of the context as in §F.4),
#                  CASTLE (3 heads: at XS also CASTLE-16, half the baseline's heads), without causal keys
#                  (4 heads: the baseline's parameters) and without SiLU
#                  (arXiv:2509.07301 Tables 5, 10), and the recurrent baselines HGRN2 and DeltaNet through fla
#                  (Mamba-2 and Gated DeltaNet train only where fla's gated backward runs: not on Hopper GPUs
#                  with Triton < 3.7.1, see model/recurrent.py; add them there with model=mamba2_XS-like overrides)
#   python -m data.prepare_text --source ../shared/data/text/wikipedia_en_wikiextractor --out .gpu_data/text
#   [SET=main|ablations] bash scripts/compare_small.sh [DATA_DIR=.gpu_data/text] [OUT=runs/compare]
#   EXTRA="train.max_steps=3 train.seq_len=64" bash scripts/compare_small.sh ...   # a quick smoke run
#   ONLY="mamba2 hgrn2" PER_GPU=3 bash scripts/compare_small.sh ...   # some of the set's runs, three per GPU
set -euo pipefail
DATA=${1:-.gpu_data/text}; OUT=${2:-runs/compare}; mkdir -p "$OUT"
NGPU=$(python -c "import torch; print(max(1, torch.cuda.device_count()))")
BASELINES=("baseline model=llama" "baseline_seed2 model=llama train.seed=2")
case ${SET:-main} in
  main) RUNS=("${BASELINES[@]}" "castle model=castle" "castle_swl model=castle_swl"
              "transformer_pro model=transformer_pro" "fox_pro model=fox_pro") ;;
  ablations) RUNS=("${BASELINES[@]}" "fox_pro model=fox_pro" "fox_pro_bias_only model=fox_pro model.fgate=bias_only"
                   "fox_pro_fixed model=fox_pro model.fgate=fixed model.fgate_tmin=2 model.fgate_tmax=2048"
                   "transformer_swa model=llama model.attention_window=256" "castle model=castle"
                   "castle_no_causal_keys model=castle model.castle_causal_keys=false model.castle_match_heads=false model.n_head=4"
                   "castle_no_silu model=castle model.castle_silu=false"
                   "hgrn2 model=hgrn2 model.n_head=3 model.head_dim=128"
                   "deltanet model=deltanet model.n_head=3 model.head_dim=128") ;;
  *) echo "SET=$SET: choose main or ablations" >&2; exit 2 ;;
esac

if [ -n "${ONLY:-}" ]; then
  KEEP=(); for r in "${RUNS[@]}"; do [[ " $ONLY " == *" ${r%% *} "* ]] && KEEP+=("$r"); done
  (( ${#KEEP[@]} )) || { echo "ONLY=$ONLY names none of SET=${SET:-main}'s runs: ${RUNS[*]%% *}" >&2; exit 2; }
  RUNS=("${KEEP[@]}")
fi
SLOTS=$((NGPU * ${PER_GPU:-1}))
IFS=, read -ra GPUS <<< "${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((NGPU - 1)))}"   # run i on GPUS[i % NGPU]

run() {  # gpu name overrides...
  local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu python train.py experiment=compare_XS data.dir="$DATA" train.out_dir="$OUT/$name" \
      train.resume=never train.if_exists=archive "$@" ${EXTRA:-} > "$OUT/$name.log" 2>&1 &&
  CUDA_VISIBLE_DEVICES=$gpu python eval.py ckpt="$OUT/$name" eval.tasks=[long_context] >> "$OUT/$name.log" 2>&1 ||
  { echo "$name FAILED: see $OUT/$name.log"; return 1; }
  echo "$name: $(grep -a '^done' "$OUT/$name.log" | tail -1)"
}

for i in "${!RUNS[@]}"; do
  run "${GPUS[i % NGPU]}" ${RUNS[$i]} &
  if (( (i + 1) % SLOTS == 0 )); then wait; fi
done
wait
DIRS=$(for r in "${RUNS[@]}"; do echo -n "$OUT/${r%% *} "; done)
python -m scripts.plot_runs $DIRS --out "$OUT/loss_curves.png"
python -m scripts.plot_long_context $DIRS --out "$OUT/per_token_loss.png"
