"""Does a hardware profile measured while other jobs ran still decide the next run's plan? The README's default
`snugfit train` on this machine, after its profile was measured under load.

Two spinning processes per core pair load the machine while `snugfit profile-hardware` measures it into a profile
of this benchmark's own (never the user's); then, on the quiet machine, the default run trains twice from that
profile: once as snugfit does now (the profile is flagged as measured under load, so the run measures the machine
again), and once as before (the flag stripped: the loaded figures stand). Prints each run's predicted step against
its measured median (warm-up and calibration steps left out).
Usage: .venv/bin/python bench/loaded_machine.py [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snugfit.train.metrics import read_metrics  # noqa: E402

SPIN = "import time\nend = time.time() + 600\nwhile time.time() < end: pass"


def _snugfit(*args: str, env: dict) -> None:
    subprocess.run([sys.executable, "-m", "snugfit", *args], env=env, check=True, stdout=subprocess.DEVNULL)


def _ratio(out: Path) -> tuple[float, float]:
    steps = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"][3:]
    measured = statistics.median(r["step_time_s"] for r in steps)
    return steps[0]["predicted_step_time_s"], measured


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="snugfit-loaded-"))
    env = {**os.environ, "SNUGFIT_HARDWARE_PROFILE": str(tmp / "hardware.json"),
           "SNUGFIT_CORRECTIONS": str(tmp / "corrections.json"), "PYTHONWARNINGS": "ignore"}
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        time.sleep(1)
        _snugfit("profile-hardware", env=env)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    loaded = json.loads((tmp / "hardware.json").read_text())
    print(f"profile measured under load: other work's share of the cores {loaded['other_load']:.0%}")
    time.sleep(5)  # the spinners' last slices gone
    stripped = {**loaded, "other_load": None}
    for name, profile in (("now (flagged, measured again)", loaded), ("before (loaded figures kept)", stripped)):
        (tmp / "hardware.json").write_text(json.dumps(profile))
        (tmp / "corrections.json").unlink(missing_ok=True)
        out = tmp / name.split()[0]
        _snugfit("train", "--steps", str(args.steps), "--replan", "off", "--out-dir", str(out), "--progress",
                 "false", "--plot", "false", "--eval-every", "0", "--log-every", "1", env=env)
        predicted, measured = _ratio(out)
        print(f"{name}: predicted {predicted:.3f} s, measured median {measured:.3f} s "
              f"({predicted / measured - 1:+.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
