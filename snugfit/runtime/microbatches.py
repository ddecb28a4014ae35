"""A rank's batch as the step runs it: its microbatches (inputs, targets, document ids), and what each one's mean
loss is divided by so that the step's loss is the mean over every target token of the global batch. Under context
parallelism each rank of a cp group takes its chunk of every sequence, inputs and targets shifted before the split;
the document ids stay whole, as attention sees the whole sequence (runtime.context_parallel)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from snugfit.data.instruct import IGNORE
from snugfit.data.packing import DOCS
from snugfit.plan import Plan, PlanError
from snugfit.runtime.context_parallel import sequence_part


class Microbatch(NamedTuple):
    """One microbatch as the model takes it: model(inputs, targets, docs)."""

    inputs: torch.Tensor  # (rows, seq/cp): this cp rank's chunk
    targets: torch.Tensor  # the same chunk of the next tokens (-100 where no loss is taken)
    docs: torch.Tensor | None  # (rows, seq): packed examples' document ids over the whole sequence; None unpacked


def split_batch(batch: torch.Tensor, plan: Plan, cp_rank: int = 0) -> list[Microbatch]:
    """This rank's batch -> a `Microbatch` each (this cp rank's chunk of each sequence).

    2-D (rows, seq+1): a token stream, targets are the inputs shifted by one.
    3-D (rows, 2, seq+1): instruction data, row 0 tokens and row 1 targets
    (-100 where no loss is taken, e.g. the prompt), shifted the same way;
    (rows, 3, seq+1): packed examples, row 2 their document ids (data.packing).
    """
    rows, cols = plan.num_microbatches * plan.micro_batch_size, plan.seq_len + 1
    expected = (rows, cols) if batch.dim() != 3 else (rows, batch.shape[1], cols)
    if tuple(batch.shape) != expected or batch.dim() == 3 and batch.shape[1] not in (2, 3):
        raise PlanError(
            f"batch of shape {tuple(batch.shape)} does not fit the plan: each rank needs "
            f"(num_microbatches x micro_batch_size, seq_len + 1) = ({rows}, {cols}), "
            f"or ({rows}, 2, {cols}) for (tokens, targets) pairs, ({rows}, 3, {cols}) packed"
        )
    tokens, labels = (batch, batch) if batch.dim() == 2 else (batch[:, 0], batch[:, 1])
    inputs, targets = (sequence_part(t, plan.cp, cp_rank) for t in (tokens[:, :-1], labels[:, 1:]))
    size = plan.micro_batch_size
    packed = batch.dim() == 3 and batch.shape[1] == 3
    docs = batch[:, DOCS, :-1].split(size) if packed else [None] * plan.num_microbatches
    return [Microbatch(i, _one_target(t) if plan.cp > 1 else t, d)
            for i, t, d in zip(inputs.split(size), targets.split(size), docs)]


def _one_target(targets: torch.Tensor) -> torch.Tensor:
    """A cp rank's chunk may hold no target where the sequences' others do (a long prompt): its mean would be NaN,
    yet the rank must run forward and backward for its peers' all-to-alls. It scores one dummy target instead,
    and `loss_divisors` divides that loss by infinity: zero loss, zero gradient."""
    if (targets != IGNORE).any():
        return targets
    targets = targets.clone()
    targets[0, 0] = 0
    return targets


def loss_divisors(batch: torch.Tensor, plan: Plan, dp_group=None, device: torch.device | None = None,
                  cp_rank: int = 0) -> list[float]:
    """What each microbatch's mean loss is divided by, so that the step loss is the mean over every target token
    of the global batch, however the tokens fall into microbatches and ranks.

    Summed over microbatches and averaged over dp ranks (as FSDP2 averages gradients),
    mean_i / d_i with d_i = (targets in the global batch) / (dp x targets in microbatch i)
    is (sum of token losses) / (targets in the global batch). Every position of a token
    stream is a target, so there d_i is exactly num_microbatches, as it always was, and
    nothing is counted; instruction data (prompts and padding masked) gathers its count
    over dp. A microbatch without targets has no mean (NaN): the step is skipped.

    Context parallelism: dp_group spans dp x cp, and each cp rank's microbatch is its chunk of the sequences, so
    d_i = (targets in the global batch) / (dp x cp x this rank's targets in microbatch i).
    """
    m = plan.num_microbatches
    if batch.dim() == 2:
        return [float(m)] * m
    counts = (sequence_part(batch[:, 1, 1:], plan.cp, cp_rank) != IGNORE).reshape(m, -1).sum(1)
    total = counts.sum().to(device)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    share = plan.dp * plan.cp
    # a cp chunk without targets scores a dummy one (`_one_target`) that must count nothing
    return [total.item() / (share * max(c, 1)) if c or plan.cp == 1 else math.inf for c in counts.tolist()]
