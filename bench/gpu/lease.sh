#!/usr/bin/env bash
# One call on a leased GPU machine (a few minutes; see bench/gpu/README.md): the acceptance suite, speed at equal
# plans against a plain loop, eager and compiled (bench/speed.py), where a replicated step's time goes
# (diagnose.py; both print to diagnose.log), the README's default `snugfit train` on the GPU with a checkpoint,
# then `snugfit profile-hardware --toml` and a plan for that TOML. Each part has its own time limit, so one that
# hangs does not cost the others; what it prints lands under $OUT in 8 files (the most that come back).
# torchao (NF4 rows) travels as a wheel in .whl/ where the machine lacks it.
set -u
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XDG_CACHE_HOME=/tmp/snugfit-cache
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
date -u
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit,driver_version --format=csv
python3 -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'

timeout "${ACCEPTANCE_S:-400}" python3 bench/gpu/run.py "$@" > "$OUT/acceptance.log" 2>&1
echo "acceptance: exit $?"; tail -n 40 "$OUT/acceptance.log"

OUT=/tmp/speed timeout "${SPEED_S:-150}" python3 bench/speed.py --model 1b-shaped --rounds 3 --steps 3 \
    > "$OUT/diagnose.log" 2>&1
echo "speed: exit $?"; tail -n 8 "$OUT/diagnose.log"

timeout "${DIAGNOSE_S:-90}" python3 bench/gpu/diagnose.py >> "$OUT/diagnose.log" 2>&1
echo "diagnose: exit $?"; grep -E "^(shape|tiny):" "$OUT/diagnose.log"; tail -n 3 "$OUT/diagnose.log"

rm -rf /tmp/snugfit-run
timeout "${TRAIN_S:-120}" python3 -m snugfit train --steps 40 --checkpoint-every 20 --out-dir /tmp/snugfit-run \
    > "$OUT/train.log" 2>&1
echo "train: exit $?"; tr '\r' '\n' < "$OUT/train.log" | grep -v "^train:" | tail -n 12

timeout "${PROFILE_S:-90}" python3 -m snugfit profile-hardware --toml "$OUT/local.toml" > "$OUT/profile.log" 2>&1
echo "profile-hardware: exit $?"; tail -n 5 "$OUT/profile.log"
timeout 60 python3 -m snugfit plan --cluster "$OUT/local.toml" --model llama-3-8b --seq 4096 --global-batch 8 \
    > /tmp/plan.log 2>&1
echo "plan on that TOML: exit $?" | tee -a "$OUT/profile.log"; head -n 12 /tmp/plan.log | tee -a "$OUT/profile.log"
