"""Host memory a rank frees goes back to the system, so sharding lowers a rank's resident peak over a whole run.

glibc's malloc serves an allocation above its mmap threshold with its own mapping, which free() unmaps. But the
threshold rises to the size of each such block freed, up to 32 MiB, and from then on a ZeRO-3 rank's gathered
weights (a block's tensors of a few to tens of MiB, gathered and freed block after block, by the main thread in
forward and by autograd's in backward) come from malloc's heaps, which keep what is freed for later and
fragment. Measured on the built-in decoder at dim 1536, 8 blocks (226M parameters, LoRA), one step at batch
4 x 64, the whole run (start-up, evaluations, step, final checkpoint): each of 4 ZeRO-3 ranks peaked at
1466-1749 MiB resident, above the 1556 MiB of one rank holding the whole model; with the threshold fixed at
1 MiB, 982-988 MiB, against 1446 MiB for the one rank.

The price is time on CPU ranks: each block above the threshold is mapped afresh, and the kernel zeroes and maps
its pages as they are first written (1-1.5 us a 4 KiB page here). The README's default model steps 1.46x slower
for it (299 against 205 ms, a plain loop at batch 16 x 128, whose 1.5 and 4 MiB activations fault in every step).
At 8 MiB it stepped as fast as without the fixed threshold, but the ZeRO-3 ranks above grew 1.04-1.15x what the
one rank grew: FSDP2 copies a gathered block out into one tensor per parameter, 2-6 MiB each at that width. The
time model charges CPU ranks for the pages (profile.record.OpCost.fresh_bytes, GPU.page_in_bytes_per_s).
"""

from __future__ import annotations

import ctypes
import os
import sys

from snugfit.hardware.catalogue import MMAP_THRESHOLD_BYTES  # smaller blocks stay on malloc's fast path

M_MMAP_THRESHOLD = -3  # <malloc.h>


def return_freed_host_memory() -> bool:
    """Fix glibc's mmap threshold for this process (which also stops it rising): blocks above it are unmapped
    when freed. A user's own MALLOC_MMAP_THRESHOLD_ wins; elsewhere than glibc, nothing to do. True when set."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
