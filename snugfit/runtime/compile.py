"""Compiled blocks (Plan.compile): each block's forward through torch.compile, once for all blocks.

Regional compilation, as torchtitan compiles each transformer block: the blocks run the same code, and since
dynamo treats a module's parameters as inputs of the graph, every block reuses the graph the first one made
(one forward and one backward compilation per distinct block input: LoRA's first block, whose input needs no
gradient, makes a second). What compiling changes is where the time goes, never the math beyond float order:
fused memory-bound kernels, a few launches per block instead of one dispatch per operator, and what the
partitioner saves for backward (profile.compiled predicts it).

How it layers with the other techniques of a block (runtime.activations applies it, per block, between them):
- recomputation (full or selective) is inside the compiled region: torch.compile turns the checkpoint into a
  tagged region of the joint graph that the partitioner recomputes (selective: its policy decides per operator
  as the graph is traced);
- saved-tensor hooks stay outside it (activation offload, a pipeline stage's accounting and BPipe's evictions,
  the memory tracker): they cannot be traced into a graph, and from outside they see the tensors the compiled
  graph saves, as they see eager's;
- FSDP2's unit hooks run around `block.forward`, outside the graph, as torchtitan runs them (its FSDP2 units wrap
  the compiled block): parameters are gathered before the graph runs and resharded after;
- tensor parallelism's DTensors and torchao's NF4 weights trace as tensor subclasses.

Evaluation (no gradient), and any step under a Python dispatch mode, runs the eager forward: evaluation would
otherwise compile a second, inference graph at start-up for a few evaluations. A block that cannot be traced whole
(a Hugging Face layer with a graph break, a missing C compiler) runs eager, with the reason logged once, rather
than failing the run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

log = logging.getLogger(__name__)

_failed: dict[object, str] = {}  # code of a forward that could not compile -> why (every block of that code)


class _NoInPlaceWarning(logging.Filter):
    """torch warns, once per process, that a selective policy's region must not run in-place operators: the blocks
    run none (tests/test_compile.py compares them with eager), and every rank printed it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


logging.getLogger("torch._higher_order_ops.wrap").addFilter(_NoInPlaceWarning())


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far (dynamo, the partitioner, inductor; backward included)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)


class CompiledForward:
    """A block's forward compiled on first use under autograd; eager without gradients or where it cannot
    compile."""

    def __init__(self, eager: Callable):
        self.eager = eager
        self.compiled = torch.compile(eager, fullgraph=True, dynamic=False)
        target = getattr(eager, "func", eager)  # an activation policy's functools.partial: what it calls
        self.code = getattr(getattr(target, "__func__", target), "__code__", target)

    def __call__(self, *args, **kwargs):
        # a Python dispatch mode (an operator counter, the profiler's fake tensors) sees every operator: torch runs
        # no compiled code under one
        if not torch.is_grad_enabled() or self.code in _failed or _get_current_dispatch_mode() is not None:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.BackendCompilerFailed) as err:
            reason = str(err).strip().splitlines()[0][:200]
            _failed[self.code] = reason
            log.warning("compile: a block cannot be compiled (%s); its blocks run eager", reason)
            return self.eager(*args, **kwargs)


def compile_block(block: nn.Module) -> None:
    """Compile `block.forward` as it is now (its recomputation inside), in place: parameter names stay."""
    # One graph serves every block, but dynamo recompiles when a guard fails (another dtype, shape or grad mode);
    # past its limit it would run eager without a word, so hitting the limit fails instead.
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    block.forward = CompiledForward(block.forward)
