#!/usr/bin/env bash
# GPU checks and measurements, one stage per device call (each fits the 10-minute limit);
# logs land in $OUT (or ./gpu_logs).
#   bash scripts/gpu_session.sh tests                # the GPU-marked tests of the CASTLE kernels and the whole model,
#                                                    # then compute-sanitizer's memcheck of the CASTLE kernels
#   bash scripts/gpu_session.sh tests2               # the other GPU-marked tests: FoX/SWA kernels, fused, recurrent, tree
#   bash scripts/gpu_session.sh train --models A B   # whole-model throughput / MFU / memory (scripts.bench_train arguments)
#   bash scripts/gpu_session.sh fused                # Baseline-S, fused kernels off / on (default; loss chunks of 8192 and 4096 tokens) vs plain PyTorch
#   [FUSED_SPECS="norm all"] bash scripts/gpu_session.sh fusedeach   # Baseline-S with each fused option alone, one
#                                                    # process each; a stall dumps its Python stacks (FUSED_TIMEOUT s)
#   bash scripts/gpu_session.sh autotune             # Baseline-S compiled with max-autotune (Triton matmul templates) vs plain PyTorch
#   bash scripts/gpu_session.sh mfu                  # Baseline-M, Transformer (LLaMA) 360M: MFU with the default (fused) kernels
#   [PROFILE_MODELS="A B"] bash scripts/gpu_session.sh profile   # where each model's step goes (CUDA kernel table)
#   [RATIO_MODELS="transformer_pro_125M fox_pro_125M"] bash scripts/gpu_session.sh ratios   # a variant against its
#                                                    # baseline with the fused defaults (default: Baseline-M, CASTLE-M)
#   bash scripts/gpu_session.sh memory               # the memory plan next to measured peaks (four configurations)
#   bash scripts/gpu_session.sh tiles                # FoX: every autotune config's GPU test, then the times vs cuDNN (tuner's picks)
#   bash scripts/gpu_session.sh kernels              # FoX vs its peers, SWA vs FlexAttention, CASTLE D=128 sweep, decode
#   bash scripts/gpu_session.sh acp                  # FoX's pruning (ACP): its GPU tests, then the kernels at four gate biases
#   bash scripts/gpu_session.sh multi                # 2-4 GPUs: tree attention, sharded decoding, 2-GPU tests, DDP/FSDP scaling
#   bash scripts/gpu_session.sh scale                # 2-4 GPUs: full vs dcp checkpoint saves of Baseline-XL
#   bash scripts/gpu_session.sh fsdp                 # 2-4 GPUs: CASTLE-XL, FoX (Pro) 760M under FSDP2 + checkpointing
#   bash scripts/gpu_session.sh ac                   # 4 GPUs: the checkpointing table (largest micro-batch in 80 GB)
#   bash scripts/gpu_session.sh window               # the sliding-window and CUDA-graph decoding GPU tests
#   [FP8_OVERRIDES="model.mlp_multiple_of=16"] bash scripts/gpu_session.sh fp8   # 1-2 GPUs: Baseline-M 500 steps,
#                                                    # bf16 vs train.fp8=true, side by side
#   [XS_MODELS="A B"] bash scripts/gpu_session.sh xs # tokens/s of the compare_XS variants (SET=ablations), one at a time
#   bash scripts/gpu_session.sh decode               # CUDA-graph decoding: a profile of each mode, then eager vs graph vs transformers
#   bash scripts/gpu_session.sh decodefused          # the single-launch LLaMA step alone, then every mode at batch 1 and 4
#   bash scripts/gpu_session.sh decodetests          # FoX (Pro) and CASTLE decode speed, CUDA-graph decoding's GPU tests
#   bash scripts/gpu_session.sh decodecapacity       # each variant's graph step below a 32K cache's capacity
#   [SET=ablations] bash scripts/gpu_session.sh compare   # the small-scale comparison (scripts/compare_small.sh)
#   bash scripts/gpu_session.sh parallel fused "train --models A B"   # one single-GPU stage per GPU from
#                                                    # FIRST_GPU (default 0), side by side, each cut at STAGE_TIMEOUT s
#                                                    # (default 540); logs in $OUT/gpuN-STAGE/, all of them in
#                                                    # $OUT/logs.tgz (the device returns few files)
# docs/results.md holds the numbers these stages measured.
# carry: [".whl", ".gpu_data"]: fill .whl with ../shared/tools/device-wheels.sh plus
# `pip download --no-deps -d .whl flash-linear-attention==0.6.0 einops` (the recurrent layers),
# `pip install --no-deps --target .whl/liger liger-kernel==0.8.5`, `pip download --no-deps -d .whl torchao==0.18.0`
# (stage fp8), zarr's wheels for python 3.12 (`pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl zarr numcodecs donfig google-crc32c msgspec`:
# data/loader.py imports zarr) and `cp ../shared/bench/plain_llama_step.py .whl/` (stage fused); .gpu_data/text with
# `python -m data.prepare_text --source ../shared/data/text/wikipedia_en_wikiextractor --out .gpu_data/text`,
# its train shard compressed to fit the 64 MiB carry (`xz -T2 .gpu_data/text/train_000000.bin`; unpacked here).
# FlashAttention-4 (train.sdpa_backend=fa4, tests/test_fa4.py): `pip download flash-attn-4` and its dependencies
# for python 3.12 (not torch, not cuda-bindings: the image has both); its nvidia-cutlass-dsl-libs-cu12 wheel (92 MB)
# exceeds one carry, so unzip it, tar | xz it, split the archive in two, and carry the halves in two back-to-back
# calls to one warm machine (the first copies its half to /tmp); then unpack into a --target dir and put it and its
# nvidia_cutlass_dsl/dsl_packages on PYTHONPATH (a .pth file there is not read).
# Keep each stage under the device's 10-minute limit: compiling takes 1.5-5 minutes per model (the CASTLE M
# models the longest), so give `train` two to four models per call.
set -uo pipefail
OUT=${OUT:-gpu_logs}; mkdir -p "$OUT"
# stages may run side by side on separate GPUs (CUDA_VISIBLE_DEVICES): the wheels are installed once
[ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
export PYTHONPATH=/tmp/site:.whl/liger
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/env.txt"; git log --oneline -1 >> "$OUT/env.txt"
BW=3350; nvidia-smi -L | grep -q H200 && BW=4800   # the decode stages' bound: this card's HBM bandwidth, GB/s
for f in .gpu_data/*/*.xz; do [ -f "$f" ] && [ ! -f "${f%.xz}" ] && xz -dk -T8 "$f"; done
case "${1:-tests}" in
  setup)   ;;   # the wheels and the data only, before stages run side by side
  parallel) shift; i=${FIRST_GPU:-0}; names=()   # a stage with arguments is one quoted word: "train --models A B"
           for stage in "$@"; do
             name=gpu$i-${stage%% *}; names+=("$name")
             CUDA_VISIBLE_DEVICES=$i OUT="$OUT/$name" timeout ${STAGE_TIMEOUT:-540} bash "$0" $stage \
               > "$OUT/$name.txt" 2>&1 &
             i=$((i + 1))
           done; wait
           for name in "${names[@]}"; do echo "== $name"; tail -n 12 "$OUT/$name.txt"; done
           tar czf "$OUT/logs.tgz" -C "$OUT" "${names[@]}" "${names[@]/%/.txt}" ;;
  tests)   python -m pytest -m gpu -q -rs tests/test_gpu_model.py tests/test_castle_kernels.py tests/test_castle_decode.py 2>&1 \
             | tee "$OUT/pytest_gpu.log" | tail -8
           "$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)" --tool memcheck \
             --error-exitcode 1 python -m scripts.sanitize_castle 2>&1 \
             | tee "$OUT/sanitize_castle.log" | tail -4 ;;
  tests2)  python -m pytest -m gpu -q -rs tests/test_forgetting_kernels.py tests/test_swa.py tests/test_recurrent.py \
             tests/test_tree.py tests/test_sharded_decode.py tests/test_fp8.py 2>&1 | tee "$OUT/pytest_gpu2.log" | tail -8
           python -m pytest -q -rs tests/test_fused.py 2>&1 | tee "$OUT/pytest_fused.log" | tail -4 ;;
  train)   shift; python -m scripts.bench_train "$@" 2>&1 | tee "$OUT/bench_train.log" | tail -16 ;;
  fused)   python -m scripts.bench_train --models baseline_paper_S baseline_paper_S:model.fused_loss_chunk=4096 --fused none default \
             --steps 15 --plain .whl/plain_llama_step.py 2>&1 | tee "$OUT/bench_fused.log" | tail -10 ;;
  fusedeach) for spec in ${FUSED_SPECS:-loss=chunked norm swiglu=triton all}; do   # one process per option; one that
             # runs past FUSED_TIMEOUT s dumps every thread's Python stack (faulthandler on SIGABRT) into its log
             PYTHONFAULTHANDLER=1 timeout -s ABRT ${FUSED_TIMEOUT:-200} python -m scripts.bench_train \
               --models baseline_paper_S --fused $spec --steps 10 > "$OUT/fused_${spec//[=,]/_}.log" 2>&1
             tail -n 3 "$OUT/fused_${spec//[=,]/_}.log"
           done ;;
  autotune) python -m scripts.bench_train --models baseline_paper_S \
             --compile-mode max-autotune-no-cudagraphs --steps 15 --plain .whl/plain_llama_step.py 2>&1 \
             | tee "$OUT/bench_autotune.log" | tail -8 ;;
  mfu)     python -m scripts.bench_train --models baseline_paper_M transformer_llama_360M --steps 10 2>&1 \
             | tee "$OUT/bench_mfu.log" | tail -8 ;;
  profile) python -m scripts.bench_train --models ${PROFILE_MODELS:-transformer_pro_125M fox_pro_125M} --steps 8 \
             --profile 40 2>&1 | tee "$OUT/bench_profile.log" | tail -100 ;;
  ratios)  python -m scripts.bench_train --models ${RATIO_MODELS:-baseline_paper_M castle_paper_M} --steps 10 2>&1 \
             | tee "$OUT/bench_ratios.log" | tail -8 ;;
  memory)  for args in "baseline_paper_S castle_paper_M --batch 8" "fox_pro_360M --batch 1" "baseline_paper_XL --batch 8"; do
             python -m scripts.bench_memory --models $args --modes none full --steps 2 --warmup 1 2>&1 \
               | tee -a "$OUT/bench_memory.log" | tail -6
           done ;;
  tiles)   python -m pytest -m gpu -q -rs tests/test_forgetting_kernels.py -k every_tuned_config 2>&1 \
             | tee "$OUT/pytest_tiles.log" | tail -4
           python -m scripts.bench_forgetting --D 64 128 --show-tuning 2>&1 | tee "$OUT/bench_forgetting.log" | tail -30 ;;
  acp)     python -m pytest -m gpu -q -rs tests/test_forgetting_kernels.py tests/test_gpu_model.py -k "acp or real_shape" \
             2>&1 | tee "$OUT/pytest_acp.log" | tail -4
           python -m scripts.bench_forgetting --D 64 --L 16384 --prune-log-eps -10 --gate-bias 0 4 6 8 2>&1 \
             | tee "$OUT/bench_acp.log" | grep -E "^\||keeps" ;;
  kernels) python -m scripts.bench_forgetting --L 2048 16384 2>&1 | tee "$OUT/bench_forgetting.log" | tail -12
           timeout 300 python -m scripts.bench_forgetting --window 2048 --L 4096 16384 --D 64 128 2>&1 \
             | tee "$OUT/bench_swa.log" | tail -16
           python -m scripts.bench_castle --L 2048 --D 128 --B 8 --H 16 --dtype bf16 --sweep --jobs 16 2>&1 \
             | tee "$OUT/castle_sweep_d128.log" | tail -22
           python -m scripts.bench_castle --decode 2>&1 | tee "$OUT/bench_castle_decode.log" | tail -10 ;;
  multi)   N=$(nvidia-smi -L | wc -l)
           torchrun --standalone --nproc_per_node=$N -m scripts.bench_tree --ctx 131072,1048576,4194304 2>&1 \
             | tee "$OUT/tree.log" | tail -8
           torchrun --standalone --nproc_per_node=$N -m scripts.bench_sharded_decode --attention baseline,fox,castle \
             --ctx 1048576 --check 256 --graphs 2>&1 | tee "$OUT/sharded.log" | tail -10
           python -m pytest -m gpu -q -rs tests/test_tree.py tests/test_sharded_decode.py 2>&1 | tee "$OUT/pytest_2gpu.log" | tail -4
           python -m scripts.bench_scaling --gpus $(printf "%s\n" 1 2 $N | sort -un) --steps 14 --skip 4 --out /tmp/scaling -- experiment=baseline_paper_M \
             data=text data.dir=.gpu_data/text train.micro_batch_size=16 2>&1 | tee "$OUT/scaling.log" | tail -10 ;;
  scale)   N=$(nvidia-smi -L | wc -l)
           for fmt in ${FORMATS:-full dcp dcp_async}; do   # eager: a save does not depend on compile
             timeout ${SAVE_TIMEOUT:-200} torchrun --standalone --nproc_per_node=$N train.py experiment=baseline_paper_XL data=text \
               data.dir=.gpu_data/text train.parallel=fsdp train.compile=false train.micro_batch_size=4 \
               train.global_batch_tokens=null train.max_steps=2 train.ckpt_interval=1 train.keep_last=3 \
               train.eval_interval=1000 train.eval_tokens=32768 train.sample_tokens=0 train.out_dir=/tmp/ckpt_bench/$fmt \
               train.ckpt_format=${fmt%_async} train.ckpt_async=$([ $fmt = dcp_async ] && echo true || echo false) \
               > "$OUT/ckpt_$fmt.log" 2>&1
           done
           grep -H ckpt_ /tmp/ckpt_bench/*/metrics.jsonl | tee "$OUT/ckpt_bench.txt" ;;
  fsdp)    N=$(nvidia-smi -L | wc -l)   # the XL and 760M recipes' micro-batches, FSDP2 + selective checkpointing + compile;
           # CASTLE-XL's two dcp saves (steps 4 and 8) are timed too
           for exp in castle_paper_XL fox_pro_760M; do
             timeout 270 torchrun --standalone --nproc_per_node=$N train.py experiment=$exp data=text \
               data.dir=.gpu_data/text train.parallel=fsdp train.activation_checkpointing=selective train.max_steps=8 \
               train.log_interval=2 train.global_batch_tokens=null train.eval_interval=1000 train.eval_tokens=32768 \
               train.ckpt_format=dcp train.ckpt_interval=$([ $exp = castle_paper_XL ] && echo 4 || echo 1000) \
               train.sample_tokens=0 train.out_dir=/tmp/fsdp_$exp > "$OUT/fsdp_$exp.log" 2>&1
             grep -a "memory plan\|^done" "$OUT/fsdp_$exp.log"; cp /tmp/fsdp_$exp/metrics.jsonl "$OUT/fsdp_$exp.jsonl"
           done ;;
  ac)      N=$(nvidia-smi -L | wc -l)   # one model per GPU, side by side: the largest micro-batch in 80 GB per mode
           i=0
           for args in "baseline_paper_XL" "fox_pro_760M --max-batch 16" "castle_paper_XL --modes none full" \
                       "castle_paper_XL --modes selective"; do
             CUDA_VISIBLE_DEVICES=$((i % N)) timeout ${AC_TIMEOUT:-570} python -m scripts.bench_memory --models $args \
               --steps 3 --warmup 2 --memory-gib 79.1 > "$OUT/ac_$i.log" 2>&1 &
             i=$((i + 1))
           done; wait; tail -n 8 "$OUT"/ac_*.log ;;
  window)  timeout ${WINDOW_TIMEOUT:-240} python -m pytest -m gpu -q -rs tests/test_forgetting_kernels.py tests/test_swa.py \
             tests/test_decode_graph.py -k "window or swa or graph" 2>&1 | tee "$OUT/pytest_window.log" | tail -6 ;;
  fp8)     N=$(nvidia-smi -L | wc -l)   # bf16 on GPU FIRST_GPU, fp8 on the next (on one GPU, both share it: the
           # loss curves are the point, not the speed); 500 steps of 32768 tokens (16M)
           for fp8 in false true; do
             CUDA_VISIBLE_DEVICES=$(((${FIRST_GPU:-0} + $([ $fp8 = true ] && echo 1 || echo 0)) % N)) python train.py experiment=baseline_paper_M \
               data=text data.dir=.gpu_data/text train.max_steps=500 train.global_batch_tokens=32768 \
               optim.warmup_steps=50 train.eval_interval=100 train.eval_tokens=262144 train.ckpt_interval=1000 \
               train.sample_tokens=0 train.fp8=$fp8 train.out_dir=/tmp/fp8_$fp8 ${FP8_OVERRIDES:-} > "$OUT/fp8_$fp8.log" 2>&1 &
           done; wait
           grep -a "^done\|fp8 matmuls" "$OUT"/fp8_*.log; cp /tmp/fp8_false/metrics.jsonl "$OUT/bf16_metrics.jsonl"
           cp /tmp/fp8_true/metrics.jsonl "$OUT/fp8_metrics.jsonl"
           python -m scripts.plot_runs /tmp/fp8_false /tmp/fp8_true --out "$OUT/fp8_vs_bf16.png" ;;
  xs)      python -m scripts.bench_train --steps 10 --models ${XS_MODELS:-compare_XS compare_XS:model=fox_pro \
             compare_XS:model=fox_pro,model.fgate=bias_only compare_XS:model=fox_pro,model.fgate=fixed,model.fgate_tmin=2,model.fgate_tmax=2048 \
             compare_XS:model.attention_window=256 compare_XS:model=castle \
             compare_XS:model=castle,model.castle_causal_keys=false,model.castle_match_heads=false,model.n_head=4 \
             compare_XS:model=castle,model.castle_silu=false hgrn2_XS deltanet_XS} 2>&1 | tee "$OUT/bench_xs.log" | tail -14 ;;
  decodefused)   # the single-launch LLaMA step: the kernel alone, then against the graphed and compiled steps
           python -m scripts.bench_llama_step --ctx 4096 32768 --bandwidth-gbs $BW 2>&1 | tee "$OUT/llama_step.log"
           python -m scripts.bench_decode --batch 1 4 --ctx 4096 32768 --compiled --fused --bandwidth-gbs $BW 2>&1 \
             | tee "$OUT/decode_fused.log" | grep "|" ;;
  decodecapacity)   # each variant's graph step at a 4K context and a full 32K cache, in a 32K cache (sample.py sizes
                    # it for the whole generation), with each mode's startup cost
           for m in transformer_llama_360M fox_pro_360M castle_paper_M; do
             timeout 280 python -m scripts.bench_decode --model $m --batch 1 --ctx 4096 32768 --capacity 32768 --n 32 \
               --bandwidth-gbs $BW 2>&1 | tee -a "$OUT/bench_decode_capacity.log" | grep "|"
           done ;;
  decode)  python -m scripts.bench_decode --batch 1 --ctx 4096 --compiled --autotuned --profile --bandwidth-gbs $BW 2>&1 \
             | tee "$OUT/decode_profile.log" | tail -40
           python -m scripts.bench_decode --model transformer_llama_360M --export-hf /tmp/hf360 > /dev/null 2>&1
           python -m scripts.bench_decode --hf /tmp/hf360 --compiled --bandwidth-gbs $BW 2>&1 | tee "$OUT/bench_decode.log" | tail -18 ;;
  decodetests)   # the other variants' compiled steps, then the GPU tests (fla autotunes for minutes: the recurrent ones last)
           for m in fox_pro_360M castle_paper_M; do
             python -m scripts.bench_decode --model $m --batch 1 --ctx 4096 --compiled --bandwidth-gbs $BW 2>&1 \
               | tee -a "$OUT/bench_decode_variants.log" | tail -5
           done
           python -m pytest -m gpu -q -rs tests/test_decode_graph.py tests/test_castle_decode.py \
             -k "not (mamba2 or hgrn2 or deltanet)" 2>&1 \
             | tee "$OUT/pytest_decode.log" | tail -4
           python -m pytest -m gpu -q -rs tests/test_decode_graph.py -k "mamba2 or hgrn2 or deltanet" 2>&1 \
             | tee "$OUT/pytest_decode_recurrent.log" | tail -4 ;;
  compare) bash scripts/compare_small.sh .gpu_data/text /tmp/compare 2>&1 | tee "$OUT/compare.log"
           cp /tmp/compare/*.png "$OUT/" ;;
  *)       echo "unknown stage $1: setup | parallel STAGE... | tests | tests2 | train | fused | fusedeach | autotune | mfu | memory | tiles | kernels | multi | scale | fsdp | ac | window | fp8 | xs | decode | decodetests | compare | ratios | profile"; exit 2 ;;
esac
