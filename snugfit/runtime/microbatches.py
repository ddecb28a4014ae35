"""A rank's batch as the step runs it: its microbatches (inputs, targets), and what each one's mean loss is
divided by so that the step's loss is the mean over every target token of the global batch."""

from __future__ import annotations

import torch
import torch.distributed as dist

from snugfit.data.instruct import IGNORE
from snugfit.plan import Plan, PlanError


def split_batch(batch: torch.Tensor, plan: Plan) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's batch -> [(inputs, targets)] per microbatch.

    2-D (rows, seq+1): a token stream, targets are the inputs shifted by one.
    3-D (rows, 2, seq+1): instruction data, row 0 tokens and row 1 targets
    (-100 where no loss is taken, e.g. the prompt), shifted the same way.
    """
    rows, cols = plan.num_microbatches * plan.micro_batch_size, plan.seq_len + 1
    expected = (rows, cols) if batch.dim() != 3 else (rows, 2, cols)
    if tuple(batch.shape) != expected:
        raise PlanError(
            f"batch of shape {tuple(batch.shape)} does not fit the plan: each rank needs "
            f"(num_microbatches x micro_batch_size, seq_len + 1) = ({rows}, {cols}), "
            f"or ({rows}, 2, {cols}) for (tokens, targets) pairs"
        )
    tokens, labels = (batch, batch) if batch.dim() == 2 else (batch[:, 0], batch[:, 1])
    inputs, targets = tokens[:, :-1], labels[:, 1:]
    return list(zip(inputs.split(plan.micro_batch_size), targets.split(plan.micro_batch_size)))


def loss_divisors(batch: torch.Tensor, plan: Plan, dp_group=None, device: torch.device | None = None) -> list[float]:
    """What each microbatch's mean loss is divided by, so that the step loss is the mean over every target token
    of the global batch, however the tokens fall into microbatches and ranks.

    Summed over microbatches and averaged over dp ranks (as FSDP2 averages gradients),
    mean_i / d_i with d_i = (targets in the global batch) / (dp x targets in microbatch i)
    is (sum of token losses) / (targets in the global batch). Every position of a token
    stream is a target, so there d_i is exactly num_microbatches, as it always was, and
    nothing is counted; instruction data (prompts and padding masked) gathers its count
    over dp. A microbatch without targets has no mean (NaN): the step is skipped.
    """
    m = plan.num_microbatches
    if batch.dim() == 2:
        return [float(m)] * m
    counts = (batch[:, 1, 1:] != IGNORE).reshape(m, -1).sum(1)
    total = counts.sum().to(device)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    return [total.item() / (plan.dp * max(c, 1)) for c in counts.tolist()]
