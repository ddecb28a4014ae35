"""Pipeline-parallel plans: this rank's stages cut from the model, and the step runners that drive them.

Ranks sit on the plan's pp x dp x tp grid (`ParallelDims`, `plan.RankLayout`). Stage k runs on pipeline rank
`plan.stage_rank(k)` (looped, or folded back in a V: plan.schedules), more than one per rank where the schedule
has virtual stages.

Each rank keeps one pruned model holding everything its stages run (blocks it does not run are deleted from the
ModuleDict, embedding/head set to None), so parameter names, optimizer state and checkpoints are those of the
full model under any split. `StageModule`s are views over it, one per stage; runtime.build parallelizes each as
a model part of its own (runtime.apply.parallelize: tensor parallelism, activation policies, FSDP2 with the
stage as the root unit of its embedding/final norm/head).

The runners (`step_runner.StepRunner`, one per runner the schedules registry names):
- `TorchSchedule`: the plan's action program (plan.schedules, the one the time model simulates) handed to
  torch.distributed.pipelining's `_PipelineScheduleRuntime`: 1F1B, interleaved, zero bubble (I and W), V.
- `runtime.bpipe.BPipe`: the program with BPipe's evictions, run by hand (torch's runtime has no evict/load).

Both reduce gradients over dp on the last microbatch's backward only, or on every one (plan.grad_reduce
"microbatch": sharding.requires_gradient_sync). Every stage forward runs under `StageActivations.microbatch`, so
each rank measures its peak activation bytes and resident microbatches per step (`stage_stats`), whichever
schedule runs it. On traced steps (`StepContext.trace` set) every action is recorded as a span numbered as the
time model's simulation numbers it (`report.timeline` draws the two side by side).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._backward import stage_backward, stage_backward_input, stage_backward_weight
from torch.distributed.pipelining.schedules import (
    RESHARD, UNSHARD, _Action, _ComputationType, _PipelineScheduleRuntime,
)
from torch.distributed.tensor import DTensor, Shard

from snugfit.model.decoder import Documents, cross_entropy
from snugfit.model.moe import unrecorded
from snugfit.plan import Plan
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.memory import local
from snugfit.runtime.mesh import ParallelDims
from snugfit.runtime.microbatches import Microbatch
from snugfit.runtime.p2p import PipelineError, StageComms
from snugfit.runtime.sharding import DTYPES, requires_gradient_sync
from snugfit.runtime.stage_activations import StageActivations
from snugfit.runtime.step_runner import StepContext
from snugfit.runtime.tensor_parallel import vocab_parallel_loss
from snugfit.runtime.tied_embeddings import ties, untie_head


class StageModule(nn.Module):
    """One pipeline stage: [embedding] -> its blocks -> [final norm + head], sharing the rank's model."""

    def __init__(self, model: nn.Module, blocks: range, first: bool, last: bool, index: int,
                 tp_mesh: DeviceMesh | None = None):
        super().__init__()
        self.__dict__["tp_mesh"] = tp_mesh  # stages exchange plain tensors: this rank's sequence slice
        self.index = index
        self.embed = model.embed if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[str(i)] for i in blocks})  # named as in the model
        self.norm = model.norm if last else None
        self.head = model.head if last else None
        self.__dict__["model"] = model  # not a submodule: parameters belong to the model
        self.__dict__["acts"] = None  # the runner's StageActivations
        self.microbatch = 0  # forwards since the step began; the schedules run them in order
        self.untracked = 0  # forwards still to come that are no microbatch (shape inference)

    @property
    def cp_rank(self) -> int:
        """The model's (its `placed` reads it): runtime.context_parallel.apply_cp sets it on the stage."""
        return self.model.cp_rank

    @cp_rank.setter
    def cp_rank(self, rank: int) -> None:
        self.model.cp_rank = rank

    def forward(self, x: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        """docs: packed examples' document ids over the whole sequence (runtime.microbatches), given to every stage
        (a keyword argument of the schedule's step, which pipelining splits by microbatch as it does the inputs)."""
        grad = torch.is_grad_enabled()
        tracked = grad and not self.untracked
        if tracked:
            key, self.microbatch = (self.index, self.microbatch), self.microbatch + 1
        elif grad:
            self.untracked -= 1
        with self.acts.microbatch(key) if tracked else unrecorded(self):
            docs = Documents(docs) if docs is not None else None
            start, rope = self.model.placed(x.shape[1], docs)  # this cp rank's part of each sequence
            h = self.embed(x, start) if self.embed is not None else x
            if self.embed is None and self.tp_mesh is not None:
                h = DTensor.from_local(h, self.tp_mesh, [Shard(1)])
            for block in self.blocks.values():
                h = block(h, rope, docs)
            if self.head is not None:
                return self.head(self.norm(h))
            return h.to_local() if isinstance(h, DTensor) else h


def stage_parts(model: nn.Module, plan: Plan, dims: ParallelDims) -> list[StageModule]:
    """Delete from `model` what this pipeline rank does not run; return its stages, in stage order."""
    stages = plan.stages_of(dims.pp_rank)
    ranges = plan.stage_ranges()
    keep = {str(i) for k in stages for i in ranges[k]}
    for name in [n for n in model.blocks if n not in keep]:
        del model.blocks[name]
    last = len(ranges) - 1
    if 0 in stages and last in stages and ties(model):  # a V: the first and last stage are FSDP2 roots apart
        untie_head(model)
    parts = [StageModule(model, ranges[k], k == 0, k == last, k, dims.tp_mesh if plan.tp > 1 else None)
             for k in stages]
    if 0 not in stages:
        model.embed = None
    if last not in stages:
        model.norm = model.head = None
    return parts


class PipelineRunner:
    """What every pipeline runner does around its schedule: the stages' activation accounting, each
    microbatch's share of the loss, the step's loss summed over the stages, forward-only evaluation."""

    def __init__(self, model: nn.Module, stages: list[StageModule], plan: Plan, dims: ParallelDims, env: DistEnv,
                 evict_group: bool = False):
        self.model, self.stages, self.plan, self.device = model, stages, plan, env.device
        self.pp_rank = dims.pp_rank
        self.pp_group, self.evict_group = dims.pipeline_groups(env.timeout_s, bpipe=evict_group)
        self.stage_group, self.units = self.pp_group, tuple(stages)
        self.acts = StageActivations([model])
        for s in stages:
            s.acts = self.acts
        # what stages send each other: this tp and cp rank's part of the sequence
        self.hidden = torch.empty(plan.micro_batch_size, plan.seq_len // (plan.tp * plan.cp), model.cfg.dim,
                                  device=env.device, dtype=DTYPES[plan.compute_dtype])
        self.comms = StageComms(self.pp_group, self.pp_rank, plan.pp, env.timeout_s)
        self.n_stages = len(plan.stage_ranges())
        self.is_last = stages[-1].index == self.n_stages - 1
        self.ctx: StepContext | None = None  # the current step's (its trace, memory tracker, loss scale)
        self.divisors: list[float] = []  # this step's, per microbatch (`microbatches.loss_divisors`)

    def train(self, ctx: StepContext, micro: list[Microbatch],
              divisors: list[float]) -> torch.Tensor:
        self.ctx, self.divisors = ctx, divisors
        self.acts.tracker = ctx.memory
        # BPipe evicts what it records; others record only on the steps whose memory is counted
        self.acts.recording = ctx.memory is not None or self.plan.schedule_entry.evicts
        feed = self.feed(micro)
        # the step's input: never counted
        self.acts.reset(external=(*(t for mb in micro for t in mb if t is not None), *feed))
        ctx.wait_updates()  # the root unit waits in a model forward hook, and stages never call the model
        for s in self.stages:
            s.microbatch = 0
        try:
            losses = self.run(micro, feed)
        except PipelineError:
            raise
        except Exception as err:  # torch.distributed.pipelining's own transfers: name the stage
            raise PipelineError(f"pipeline stages {[s.index for s in self.stages]} (rank {dist.get_rank()}) "
                                f"{self.plan.schedule} step failed: {err}") from err
        loss = torch.stack(losses).detach().sum().float() if losses else torch.zeros((), device=self.device)
        loss /= ctx.loss_scale  # the schedules backpropagate the scaled loss (float16)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage has it
        return loss

    def feed(self, micro: list[Microbatch]) -> tuple[torch.Tensor, ...]:
        """Tensors made from the step's input for the schedule (never counted as activations)."""
        return ()

    def run(self, micro: list[Microbatch], feed: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Forward and backward of every microbatch through this rank's stages; the last stage's losses."""
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This microbatch's share of the step loss (times the float16 loss scale), counted as the last stage's
        activations of that microbatch."""
        last = self.stages[-1]
        with self.acts.microbatch((last.index, last.microbatch - 1)):
            return local(cross_entropy(logits, targets)) * (self.ctx.loss_scale / self.divisors[last.microbatch - 1])

    @torch.no_grad()
    def eval(self, ctx: StepContext, micro: list[Microbatch],
             divisors: list[float]) -> torch.Tensor:
        """Forward only, microbatch by microbatch through every stage in order (blocking transfers suffice; a
        stage whose neighbour is on this rank hands it its output directly)."""
        ctx.wait_updates()
        total = torch.zeros((), device=self.device)
        rank_of = self.plan.stage_rank
        for mb, (tokens, targets, docs) in enumerate(micro):
            y = None
            for stage in self.stages:
                k = stage.index
                if k == 0:
                    x = tokens
                elif rank_of(k - 1) == self.pp_rank:
                    x = y
                else:
                    x = self.comms.recv(torch.empty_like(self.hidden), rank_of(k - 1), 0, f"eval recv mb {mb}")
                y = stage(x, docs)
                if k == self.n_stages - 1:
                    with vocab_parallel_loss(self.plan):
                        total += local(cross_entropy(y, targets)).float() / divisors[mb]
                elif rank_of(k + 1) != self.pp_rank:
                    self.comms.send(y, rank_of(k + 1), 0, f"eval send mb {mb}")
            self.comms.finish_sends()
        dist.all_reduce(total, group=self.pp_group)
        return total

    def stage_stats(self) -> dict:
        """What this rank's stages held in the last step: peak activation bytes and resident microbatches."""
        a = self.acts
        return {"pp_rank": self.pp_rank, "stages": [s.index for s in self.stages],
                "peak_activation_bytes": a.peak_bytes, "peak_microbatches": a.peak_microbatches,
                "evictions": a.evictions, "accepted": a.accepts, "peak_own_bytes": a.peak_own_bytes,
                "largest_accepted_bytes": a.largest_accepted_bytes}

    def span(self, kind: str, mb: int, stage: int) -> AbstractContextManager:
        """Time one action into the trace, on traced steps."""
        return self.ctx.span(kind, mb, stage) if self.ctx is not None else nullcontext()


class TorchSchedule(PipelineRunner):
    """The plan's action program (plan.schedules) run by torch.distributed.pipelining's _PipelineScheduleRuntime,
    the runtime its own multi-stage schedules use, with the program as they would hand it (compute actions; the
    runtime adds the transfers and the gradient reduction after each stage's last backward).

    Losses come out of `loss` already scaled to their share of the step, so the schedule rescales no gradients
    (its rescaling would miss gradients that host offload has already moved off the device). Torch's lowering
    also adds UNSHARD/RESHARD of whole stages for FSDP (every unit gathered at once); here they gather nothing:
    each block is its own FSDP2 unit and gathers as it runs (a ZeRO-3 block only then), as the memory model
    counts and as torch's Schedule1F1B leaves them."""

    def __init__(self, model: nn.Module, stages: list[StageModule], plan: Plan, dims: ParallelDims, env: DistEnv):
        super().__init__(model, stages, plan, dims, env)
        pipeline = [RunnerStage(s, self) for s in stages]
        for s in stages:  # pipelining infers shapes with one extra forward per stage in its first step
            s.untracked = 1
        self.schedule = _PipelineScheduleRuntime(pipeline, plan.num_microbatches, loss_fn=self._traced_loss,
                                                 scale_grads=False)
        self.schedule._prepare_schedule_with_comms({
            r: [_Action(a.stage, _ComputationType.from_str(a.kind), a.mb) for a in plan.program(r)]
            for r in range(plan.pp)})
        # its bookkeeping only: the runtime checks a stage was "unsharded" before computing on it
        self.schedule.register_custom_function(
            UNSHARD, lambda action, ctx: ctx.schedule_ref.unsharded_stages.add(action.stage_index))
        self.schedule.register_custom_function(
            RESHARD, lambda action, ctx: ctx.schedule_ref.unsharded_stages.discard(action.stage_index))

    def feed(self, micro: list[Microbatch]) -> tuple[torch.Tensor, ...]:
        # (inputs, targets[, docs]): pipelining splits whole ones itself
        return tuple(torch.cat(t) for t in zip(*micro) if t[0] is not None)

    def run(self, micro: list[Microbatch], feed: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        inputs, targets, *docs = feed
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.stages[0].index == 0 else ()
        with vocab_parallel_loss(self.plan):
            self.schedule.step(*args, target=targets if self.is_last else None, losses=losses,
                               **({"docs": docs[0]} if docs else {}))
        return losses

    def _traced_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`loss`, counted (on traced steps) in the last stage's forward span, as the engine and BPipe time it:
        pipelining computes the loss after forward_one_chunk returns, right after it."""
        loss = self.loss(logits, targets)
        if self.ctx.trace is not None:
            self.ctx.trace.extend(dist.get_rank(), "F")
        return loss


class RunnerStage(PipelineStage):
    """torch's PipelineStage of one StageModule, as `TorchSchedule` runs it: each per-microbatch action timed into
    the step's trace, and FSDP2's gradient sync as the plan says.

    The trace: F, B (or I, where the backward is split) and W spans, timed around `forward_one_chunk`,
    `backward_one_chunk` and `backward_weight_one_chunk`, the per-microbatch entry points torch's schedule runtime
    calls, with the schedule's own microbatch index, after it has waited for that microbatch's receive -- so a span
    is the stage's compute, as in the time model. None is called by pipelining's shape inference. The alternatives
    were worse: StageModule.forward would time forwards but not backwards, and autograd hooks cannot mark a stage's
    whole backward (the last stage's starts at the loss, which has no gradient to hook; the first stage's inputs
    are tokens, which get none at its end) and run among FSDP's own hooks.

    The sync: torch's stage turns FSDP2's gradient sync off before every backward and reduces after the last
    (`perform_reduce_grad`), with no option to leave it on. Where the plan reduces every microbatch
    (`requires_gradient_sync`), `backward_maybe_with_nosync` runs the backward as torch's does, but with it on.
    """

    def __init__(self, module: StageModule, runner: PipelineRunner):
        super().__init__(module, module.index, runner.n_stages, runner.device, group=runner.pp_group)
        self.runner = runner

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        with self.runner.span("F", fwd_chunk_id, self.stage_index):
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        with self.runner.span("B" if full_backward else "I", bwd_chunk_id, self.stage_index):
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        with self.runner.span("W", bwd_chunk_id, self.stage_index):
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if not (isinstance(self.submod, FSDPModule) and requires_gradient_sync(self.runner.plan, last=False)):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        self.submod.set_is_last_backward(False)  # as torch's: perform_reduce_grad ends the step's backward
        self.submod.set_reshard_after_backward(False)
        self.submod.set_requires_gradient_sync(True)
        kw, params = bwd_kwargs, self.submod.parameters()
        if backward_type == "full":
            return stage_backward(kw["stage_output"], kw["output_grads"], kw["input_values"]), None
        if backward_type == "input":
            return stage_backward_input(kw["stage_output"], kw["output_grads"], kw["input_values"], params)
        return stage_backward_weight(params, kw["param_groups"]), None
