"""The longest context `snugfit plan` fits: Llama-3.1-8B, batch 1, the plan searched (context parallelism, tiled MLP,
recomputation, host checkpoints, the chunked loss: whatever the search weighs), in one of two cases:

    qlora  QLoRA (r32, all linear layers) on one card of each kind named (`--cards`)
    full   a full fine-tune on 8 x H100-80GB with 2 TiB of host memory (`--cards` ignored)

Bisects the sequence length (multiples of 1024 tokens, to within `--precision`) by asking `snugfit plan` whether a
plan fits, on each card named. Each answer profiles the model at that length on fake tensors, so a card takes a few
minutes on a loaded CPU machine.

    PYTHONPATH=. python bench/longest_context.py --cards RTX4080 RTX4090 A100-40GB-SXM H100-SXM
    PYTHONPATH=. python bench/longest_context.py --case full --lo 1048576 --hi 8388608
"""

from __future__ import annotations

import argparse
import subprocess
import sys

STEP = 1024


# case -> (the cluster for a card's name, the fine-tuning options)
CASES = {
    "qlora": (lambda card: f"1x{card}", ["--lora-rank", "32", "--lora-targets", "all-linear", "--quantize-base", "nf4"]),
    "full": (lambda card: "8xH100-80GB", ["--host-ram", "2TiB"]),
}


def fits(case: str, card: str, seq: int, extra: list[str]) -> bool:
    cluster, tuning = CASES[case]
    cmd = [sys.executable, "-m", "snugfit", "plan", "--model", "llama-3.1-8b", "--cluster", cluster(card),
           "--seq", str(seq), "--global-batch", "1", *tuning, *extra]
    return subprocess.run(cmd, capture_output=True, text=True).returncode == 0


def longest(case: str, card: str, lo: int, hi: int, precision: float, extra: list[str]) -> int:
    """The longest multiple of STEP in [lo, hi) that fits (lo assumed to; 0 if it does not)."""
    if not fits(case, card, lo, extra):
        return 0
    while hi / lo > 1 + precision and hi - lo > STEP:
        mid = int((lo * hi) ** 0.5) // STEP * STEP
        if mid <= lo:
            break
        lo, hi = (mid, hi) if fits(case, card, mid, extra) else (lo, mid)
        print(f"  {card}: {lo} fits, {hi} does not", flush=True)
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cards", nargs="+", default=["RTX4080", "RTX4090", "A100-40GB-SXM", "H100-SXM"])
    ap.add_argument("--case", choices=sorted(CASES), default="qlora")
    ap.add_argument("--lo", type=int, default=16 * STEP)
    ap.add_argument("--hi", type=int, default=1024 * STEP)
    ap.add_argument("--precision", type=float, default=0.02)
    ap.add_argument("extra", nargs="*", help="more `snugfit plan` options (after --)")
    args = ap.parse_args()
    for card in args.cards if args.case == "qlora" else ["8xH100-80GB"]:
        n = longest(args.case, card, args.lo, args.hi, args.precision, args.extra)
        print(f"{card}: longest context that fits {n} tokens ({n / 1000:.1f}k)", flush=True)


if __name__ == "__main__":
    main()
