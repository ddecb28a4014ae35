"""Check that the samples in README.md and docs/*.md are what their commands print now; --write regenerates them.

A sample is a fenced block whose first line is `$ snugfit ...`: the rest of the block is that command's output,
as it prints it. The README quotes some figures in its prose instead, beside the command that prints them: CLAIMS
lists each with the words of that output the prose repeats. docs/scale.md has its own re-run script
(docs/scale_runs.sh) and dated figures, and is left to it.

    python docs/check_samples.py            # exit 1 and a diff when a sample or a claim no longer matches
    python docs/check_samples.py --write    # rewrite the samples from the commands (claims are prose: by hand)
    python docs/check_samples.py docs/how-it-plans.md   # only these files
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SKIP = {"scale.md"}  # docs/scale_runs.sh re-runs it
SAMPLE = re.compile(r"^```[a-z]*\n(\$ snugfit [^\n]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)

# (command as the README shows it, words of its output the README's prose repeats)
CLAIMS = [
    ("snugfit plan --model llama-2-70b --cluster 2xRTX4090 --seq 2048 --global-batch 8 --lora-rank 16 "
     "--quantize-base nf4", ["ZeRO-3", "7 x ZeRO-3 + parameter offload", "15.982", "1.439"]),
    ("snugfit plan --model llama-3.1-8b --cluster 1xRTX4090 --seq 65536 --global-batch 1 --lora-rank 32 "
     "--quantize-base nf4", ["peak 20.65 GiB"]),
]


def run(command: str) -> str:
    """What `command` (a `snugfit ...` line) prints on stdout; its stderr must be empty."""
    args = shlex.split(command)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-m", "snugfit", *args[1:]], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    if proc.returncode not in (0, 2) or proc.stderr:
        raise SystemExit(f"{command}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return proc.stdout


def check_file(path: Path, write: bool) -> list[str]:
    """The problems of one file's samples (rewritten in place with write)."""
    text, problems = path.read_text(), []
    for m in reversed(list(SAMPLE.finditer(text))):
        command, shown = m.group(1)[2:], m.group(2)
        printed = run(command)
        if printed == shown:
            continue
        if write:
            text = text[:m.start(2)] + printed + text[m.end(2):]
        else:
            diff = difflib.unified_diff(shown.splitlines(), printed.splitlines(), "shown", "printed now", lineterm="")
            problems.append(f"{path.relative_to(ROOT)}: `{command}`:\n" + "\n".join(diff))
    if write:
        path.write_text(text)
    if path.name == "README.md":
        for command, words in CLAIMS:
            if command not in text:
                problems.append(f"README.md no longer shows `{command}`: update CLAIMS")
                continue
            printed = run(command)
            problems += [f"README.md quotes {w!r} from `{command}`, which no longer prints it"
                         for w in words if w not in printed]
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="markdown files (default: README.md and docs/*.md)")
    ap.add_argument("--write", action="store_true", help="rewrite the samples from their commands")
    args = ap.parse_args(argv)
    files = [p.resolve() for p in args.files] or [p for p in FILES if p.name not in SKIP]
    problems = [p for path in files for p in check_file(path, args.write)]
    print("\n\n".join(problems) if problems else f"{len(files)} files: every sample is what its command prints")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
