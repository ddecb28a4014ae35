#!/bin/bash
# Re-run every `snugfit plan` quoted in docs/scale.md (about 3 minutes on 2 cores; profiles are cached).
# Usage: bash docs/scale_runs.sh > scale_out.txt   (per-rank rows beyond rank 0 are dropped)
# Every command gives the whole plan (--pp, --micro-batch, --zero, --recompute), so `snugfit plan` evaluates it as
# written instead of searching; a plan that does not fit is still evaluated and reported.
cd "$(dirname "$0")/.." || exit 1
plan() { echo "=== snugfit plan $*"; .venv/bin/python -m snugfit plan "$@" 2>&1 | grep -v '^ *[1-9][0-9]* '; echo; }
BF="--dtype bfloat16 --reduce-dtype float32"
plan --model llama-3.1-8b --cluster 8xH100-SXM-HBM2e --seq 8192 --micro-batch 2 --dp 8 --pp 1 --zero 3 --recompute selective_half $BF
plan --model llama-3.1-8b --cluster 8xH100-SXM-HBM2e --seq 8192 --micro-batch 2 --dp 8 --pp 1 --zero 3 --recompute selective_half $BF \
  --compile
plan --model llama-3-8b --cluster 8x8xA100-80GB --seq 8192 --micro-batch 1 --dp 64 --pp 1 --zero 3 --recompute selective_half $BF
plan --model docs/configs/mpt-7b.json --cluster 8xH100 --seq 2048 --micro-batch 6 --global-batch 48 --dp 8 --pp 1 --zero 3 \
  --recompute none $BF
plan --model docs/configs/mpt-7b.json --cluster 8xH100 --seq 8192 --micro-batch 8 --num-microbatches 2 --dp 8 --pp 1 \
  --zero 3 --recompute full $BF
for z in 0 1 2 3; do
  plan --model docs/configs/zero-7.5b.json --cluster 8x8xV100-32GB --seq 1024 --micro-batch 1 --dp 64 --pp 1 --zero $z --recompute none \
    --dtype float16 --reduce-dtype float16
done
GPT3="--model docs/configs/gpt3-175b.json --cluster 128x8xA100-80GB --seq 2048 --micro-batch 1 --recompute full"
GPT3="$GPT3 --dtype bfloat16 --reduce-dtype bfloat16"
plan $GPT3 --pp 8 --dp 128 --num-microbatches 8 --zero 3
plan $GPT3 --pp 16 --dp 64 --num-microbatches 16 --zero 1
plan $GPT3 --pp 1 --dp 1024 --zero 3
# with tensor parallelism: OPT's layout (FSDP + tp 8), and what the search picks (OPT's vocabulary, head untied)
OPT="--model docs/configs/opt-175b-untied.json --cluster 128x8xA100-80GB --seq 2048 --dtype bfloat16 --reduce-dtype bfloat16"
plan $OPT --tp 8 --pp 1 --dp 128 --zero 3 --micro-batch 8 --num-microbatches 1 --recompute full
plan $OPT --global-batch 1024 --compile false  # eager, as OPT ran; a search would weigh compiling too
for sr in "1f1b keep" "bpipe keep" "1f1b recompute"; do
  set -- $sr
  plan --model gpt2-xl --cluster 4xRTX4090 --seq 1024 --micro-batch 4 --pp 4 --num-microbatches 8 --zero 0 \
    --dtype bfloat16 --reduce-dtype bfloat16 --memory-budget 16GiB --schedule "$1" --recompute "$2"
done
