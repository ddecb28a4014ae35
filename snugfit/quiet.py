"""Libraries snugfit imports for optional features speak only when something is wrong.

transformers' modeling code imports torchao when it is installed, and torchao logs a warning for each of its
compiled kernels this machine cannot load ("Failed to load .../_C_mxfp8...so") and registers enums with torch's
pytree, which warns of a deprecation: on every `snugfit plan --model qwen2.5-7b`, whether or not NF4 is asked
for. None of it is the user's concern; snugfit's own messages keep their one-line form.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator

# the loggers those imports write to at load time (torchao's own, torch's pytree registry, transformers')
LIBRARY_LOGGERS = ("torchao", "torch.utils._pytree", "transformers")


@contextlib.contextmanager
def quiet_imports() -> Iterator[None]:
    """Around an import of an optional library: its warnings and its loggers below ERROR are dropped."""
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
