#!/usr/bin/env bash
# One call on a leased GPU machine (a few minutes; see bench/gpu/README.md): the acceptance suite, then the
# README's default `snugfit train` on the GPU with a checkpoint, then `snugfit profile-hardware --toml` and a plan
# for that TOML. Each part has its own time limit, so one that hangs does not cost the others; everything it
# prints lands under $OUT (at most 8 files come back from such a machine).
# torchao (NF4 rows) travels as a wheel in .whl/ where the machine lacks it.
set -u
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/snugfit-cache
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
{
    date -u; git log -1 --format='commit %H' 2>/dev/null
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv
    python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

timeout "${ACCEPTANCE_S:-330}" python3 bench/gpu/run.py "$@" > "$OUT/acceptance.log" 2>&1
echo "acceptance: exit $?"; tail -n 40 "$OUT/acceptance.log"

rm -rf /tmp/snugfit-run
timeout "${TRAIN_S:-120}" python3 -m snugfit train --steps 40 --checkpoint-every 20 --out-dir /tmp/snugfit-run \
    > "$OUT/train.log" 2>&1
echo "train: exit $?"; tail -n 15 "$OUT/train.log"

timeout "${PROFILE_S:-90}" python3 -m snugfit profile-hardware --toml "$OUT/local.toml" > "$OUT/profile.log" 2>&1
echo "profile-hardware: exit $?"; tail -n 5 "$OUT/profile.log"
timeout 60 python3 -m snugfit plan --cluster "$OUT/local.toml" --model llama-3-8b --seq 4096 --global-batch 8 \
    > "$OUT/plan.log" 2>&1
echo "plan on that TOML: exit $?"; head -n 12 "$OUT/plan.log"
