"""Pipeline-parallel plans: stages cut from the Decoder, scheduled 1F1B, interleaved 1F1B or BPipe.

Ranks sit on the plan's pp x dp x tp grid (`ParallelDims`, `plan.RankLayout`). Pipeline
stage k runs on pp rank k % pp (more than one stage per rank when interleaved).

Each rank keeps one pruned Decoder holding everything its stages run (blocks
it does not run are deleted from the ModuleDict, embedding/head set to None),
so parameter names, optimizer state and checkpoints are those of the full
model under any split. `StageModule`s are views over that Decoder, one per
stage, which the schedules drive:

- 1f1b, interleaved: torch.distributed.pipelining (PipelineStage +
  Schedule1F1B / ScheduleInterleaved1F1B).
- bpipe: `schedules.BPipeSchedule` (hand-written; see there why).

Inside a stage the plan applies as without pipelining (runtime.apply): tensor
parallelism splits its pieces over the tp ranks (stages then send and receive
their sequence slices), each block follows its BlockPlan (FSDP2 zero 0-3 over this stage's dp ranks,
parameter or optimizer offload, activation policy) and the StageModule is the
FSDP2 root unit of its embedding/final norm/head. Gradients are reduced over
dp on the last microbatch's backward only, or on every one (plan.grad_reduce "microbatch"). Optimizer step, exact clipping
(summed over stages and shards), host offload and checkpoints are `Engine`'s.

Every stage forward runs under `StageActivations.microbatch`, so each rank
measures its peak activation bytes and resident microbatches per step
(`PipelineEngine.stage_stats`), whichever schedule runs it.

On traced steps (`Engine.trace` set) every schedule records an F and a B span
per microbatch and stage, numbered as the time model's simulation numbers them
(`report.timeline` draws the two side by side): BPipe times its own program,
pipelining's schedules are timed by `trace_stage`.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor, Shard

from snugfit.model.decoder import Decoder, cross_entropy
from snugfit.plan import Plan, PlanError
from snugfit.runtime.stage_activations import StageActivations
from snugfit.runtime.apply import Weights, apply_activations, place, read_weights
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.engine import Engine, OptimConfig, StepResult, loss_divisors, split_batch
from snugfit.runtime.memory import local
from snugfit.runtime.mesh import ParallelDims
from snugfit.runtime.schedules import BPipeSchedule, PipelineError, StageComms
from snugfit.runtime.sharding import DTYPES, apply_fsdp
from snugfit.runtime.tensor_parallel import apply_tp, vocab_parallel_loss


class StageModule(nn.Module):
    """One pipeline stage: [embedding] -> its blocks -> [final norm + head], sharing the rank's Decoder."""

    def __init__(self, decoder: Decoder, blocks: range, first: bool, last: bool, index: int, acts: StageActivations,
                 tp_mesh: DeviceMesh | None = None):
        super().__init__()
        self.__dict__["tp_mesh"] = tp_mesh  # stages exchange plain tensors: this rank's sequence slice
        self.index = index
        self.embed = decoder.embed if first else None
        self.blocks = nn.ModuleList(decoder.blocks[str(i)] for i in blocks)
        self.norm = decoder.norm if last else None
        self.head = decoder.head if last else None
        self.__dict__["decoder"] = decoder  # not a submodule: parameters belong to the decoder
        self.__dict__["acts"] = acts
        self.microbatch = 0  # forwards since the step began; pipelining's schedules run them in order
        self.untracked = 0  # forwards still to come that are no microbatch (shape inference)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grad = torch.is_grad_enabled()
        tracked = grad and not self.untracked
        if tracked:
            key, self.microbatch = (self.index, self.microbatch), self.microbatch + 1
        elif grad:
            self.untracked -= 1
        with self.acts.microbatch(key) if tracked else nullcontext():
            h = self.embed(x) if self.embed is not None else x
            if self.embed is None and self.tp_mesh is not None:
                h = DTensor.from_local(h, self.tp_mesh, [Shard(1)])
            for block in self.blocks:
                h = block(h, self.decoder.rope)
            if self.head is not None:
                return self.head(self.norm(h))
            return h.to_local() if isinstance(h, DTensor) else h


def trace_stage(stage: PipelineStage, engine: Engine) -> None:
    """Time `stage`'s per-microbatch forward and backward into `engine.trace` as F and B spans, on traced steps.

    Wraps the stage instance's `forward_one_chunk` and `backward_one_chunk`: the public per-microbatch
    entry points every torch schedule calls (Schedule1F1B directly, the interleaved ones through their
    action runner), with the schedule's own microbatch index, after it has waited for that
    microbatch's receive -- so a span is the stage's compute, as in the time model. Neither is called
    by pipelining's shape inference. The alternatives were worse: StageModule.forward would time
    forwards but not backwards, and autograd hooks cannot mark a stage's whole backward (the last
    stage's starts at the loss, which has no gradient to hook; the first stage's inputs are tokens,
    which get none at its end) and run among FSDP's own hooks. Zero-bubble schedules' input/weight
    split (backward_one_chunk(full_backward=False) + backward_weight_one_chunk) would time only the
    input half; no plan runs those. Untraced steps pay one attribute test per call.
    """
    for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk")):
        run = getattr(stage, name)
        first = next(iter(inspect.signature(run).parameters))  # fwd_chunk_id / bwd_chunk_id

        @functools.wraps(run)
        def timed(*args, _run=run, _kind=kind, _first=first, **kwargs):
            if engine.trace is None:
                return _run(*args, **kwargs)
            mb = args[0] if args else kwargs[_first]
            with engine.trace.span(dist.get_rank(), _kind, mb, stage.stage_index):
                return _run(*args, **kwargs)

        setattr(stage, name, timed)


def prune_to_rank(model: Decoder, plan: Plan, pp_rank: int) -> list[int]:
    """Delete what this pipeline rank does not run; return the stage indices it runs."""
    stages = list(range(pp_rank, plan.pp * plan.virtual_stages, plan.pp))
    ranges = plan.stage_ranges()
    keep = {str(i) for k in stages for i in ranges[k]}
    for name in [n for n in model.blocks if n not in keep]:
        del model.blocks[name]
    if 0 not in stages:
        model.embed = None
    if len(ranges) - 1 not in stages:
        model.norm = model.head = None
    return stages


class PipelineEngine(Engine):
    """`Engine` (step, clipping, host offload, checkpoints) over this rank's stages, run by the plan's schedule."""

    def __init__(self, model: Decoder, plan: Plan, optim: OptimConfig, env: DistEnv, weights: Weights | None = None):
        if plan.schedule not in ("1f1b", "interleaved", "bpipe"):
            raise PlanError(f"plan.schedule {plan.schedule!r} is not a pipeline schedule")
        if model.cfg.tie_embeddings:
            raise PlanError("tied embeddings cannot be split across pipeline stages; set model.tie_embeddings=false")
        dims = ParallelDims.of(plan, env)
        self.pp_rank, self.dp_rank = dims.pp_rank, dims.dp_rank
        self.pp_group, self.evict_group = dims.pipeline_groups(env.timeout_s, bpipe=plan.schedule == "bpipe")
        self.stages = prune_to_rank(model, plan, self.pp_rank)
        tp_mesh = dims.tp_mesh if plan.tp > 1 else None
        if tp_mesh is not None:
            apply_tp(model, tp_mesh)
        apply_activations(dict(model.blocks.items()), plan)
        host = place(model, plan, env.device, weights)  # a model on meta: read after sharding, this rank's stages only
        self.acts = StageActivations([model])
        ranges = plan.stage_ranges()
        n = len(ranges)
        self.chunks = []
        for k in self.stages:
            chunk = StageModule(model, ranges[k], k == 0, k == n - 1, k, self.acts, tp_mesh)
            apply_fsdp(chunk, {str(i): model.blocks[str(i)] for i in ranges[k]}, plan, dims, output_fp32=k == n - 1)
            self.chunks.append(chunk)
        read_weights(model, plan, env.device, weights)
        super().__init__(model, plan, optim, env.device, dp_group=dims.dp_group,
                         host=host, stage_group=self.pp_group, units=tuple(self.chunks))
        self.hidden = torch.empty(plan.micro_batch_size, plan.seq_len // plan.tp, model.cfg.dim, device=env.device,
                                  dtype=DTYPES[plan.compute_dtype])  # what stages send each other
        self.divisors: list[float] = []  # this step's, per microbatch (`loss_divisors`)
        self.comms = StageComms(self.pp_group, self.pp_rank, plan.pp, env.timeout_s)
        self.is_last = self.stages[-1] == n - 1
        self.schedule = self._make_schedule()

    def _make_schedule(self):
        """Losses come out of `_loss` already scaled to their share of the step, so no schedule rescales gradients
        (pipelining's rescaling would miss gradients that host offload has already moved off the device)."""
        plan, m = self.plan, self.plan.num_microbatches
        if plan.schedule == "bpipe":
            schedule = BPipeSchedule(self.chunks[0], self.comms, self.evict_group, self.acts, m, plan.bpipe_bound(),
                                     self.hidden, self._loss)
            stage = self.stages[0]
            schedule.span = lambda kind, mb: (self.trace.span(dist.get_rank(), kind, mb, stage)
                                              if self.trace is not None else nullcontext())
            return schedule
        n = len(plan.stage_ranges())
        stages = [PipelineStage(c, c.index, n, self.device, group=self.pp_group) for c in self.chunks]
        for stage in stages:
            trace_stage(stage, self)
        for c in self.chunks:  # pipelining infers shapes with one extra forward per stage in its first step
            c.untracked = 1
        if plan.schedule == "interleaved":
            return ScheduleInterleaved1F1B(stages, m, loss_fn=self._traced_loss, scale_grads=False)
        return Schedule1F1B(stages[0], m, loss_fn=self._traced_loss, scale_grads=False)

    def _traced_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """`_loss`, counted (on traced steps) in the last stage's forward span, as Engine and BPipe time it:
        pipelining computes the loss after forward_one_chunk returns, right after it."""
        loss = self._loss(logits, targets)
        if self.trace is not None:
            self.trace.extend(dist.get_rank(), "F")
        return loss

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This microbatch's share of the step loss (times the float16 loss scale), counted as the last stage's
        activations of that microbatch."""
        last = self.chunks[-1]
        with self.acts.microbatch((last.index, last.microbatch - 1)):
            return local(cross_entropy(logits, targets)) * (self.loss_scale / self.divisors[last.microbatch - 1])

    def train_step(self, batch: torch.Tensor) -> StepResult:
        self.model.train()
        batch = batch.to(self.device)
        micro = split_batch(batch, self.plan)
        self.divisors = loss_divisors(batch, self.plan, self.dp_group, self.device)
        inputs, targets = (torch.cat(t) for t in zip(*micro))  # pipelining takes whole inputs, BPipe `micro`
        self.acts.tracker = self.memory if self.track_memory else None
        self.acts.recording = self.track_memory or self.plan.schedule == "bpipe"  # BPipe evicts what it records
        self.acts.reset(external=(batch, inputs))  # the tracker reads what is held as the step starts
        self.memory.reset_peak()
        self._begin()
        if self.host is not None:
            self.host.wait()  # the root unit waits in a Decoder.forward hook, and stages never call Decoder.forward
        for c in self.chunks:
            c.microbatch = 0
        losses: list[torch.Tensor] = []
        try:
            if self.plan.schedule == "bpipe":
                losses = self.schedule.step(micro)
            else:
                args = (inputs,) if self.stages[0] == 0 else ()
                with vocab_parallel_loss(self.plan):
                    self.schedule.step(*args, target=targets if self.is_last else None, losses=losses)
        except PipelineError:
            raise
        except Exception as err:  # torch.distributed.pipelining's own transfers: name the stage
            raise PipelineError(f"pipeline stages {self.stages} (rank {dist.get_rank()}) "
                                f"{self.plan.schedule} step failed: {err}") from err
        loss = torch.stack(losses).detach().sum().float() if losses else torch.zeros((), device=self.device)
        loss /= self.loss_scale  # the schedules backpropagate the scaled loss (float16)
        dist.all_reduce(loss, group=self.pp_group)  # only the last stage has it
        return self._update(loss)

    @torch.no_grad()
    def eval_loss(self, batch: torch.Tensor) -> float:
        """Forward only, microbatch by microbatch through every stage in order (blocking transfers suffice)."""
        self.model.eval()
        if self.host is not None:
            self.host.wait()
        total = torch.zeros((), device=self.device)
        n = len(self.plan.stage_ranges())
        micro = split_batch(batch.to(self.device), self.plan)
        divisors = loss_divisors(batch, self.plan, self.dp_group, self.device)
        for mb, (tokens, targets) in enumerate(micro):
            for chunk in self.chunks:
                k = chunk.index
                x = tokens if k == 0 else self.comms.recv(
                    torch.empty_like(self.hidden), (k - 1) % self.plan.pp, 0, f"eval recv mb {mb}")
                y = chunk(x)
                if k == n - 1:
                    with vocab_parallel_loss(self.plan):
                        total += local(cross_entropy(y, targets)).float() / divisors[mb]
                else:
                    self.comms.send(y, (k + 1) % self.plan.pp, 0, f"eval send mb {mb}")
            self.comms.finish_sends()
        dist.all_reduce(total, group=self.pp_group)
        if self.dp_group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=self.dp_group)
        return total.item()

    def stage_stats(self) -> dict:
        """What this rank's stages held in the last step: peak activation bytes and resident microbatches."""
        a = self.acts
        return {"pp_rank": self.pp_rank, "stages": list(self.stages), "peak_activation_bytes": a.peak_bytes,
                "peak_microbatches": a.peak_microbatches, "evictions": a.evictions, "accepted": a.accepts,
                "peak_own_bytes": a.peak_own_bytes, "largest_accepted_bytes": a.largest_accepted_bytes}


def build_pipeline_engine(model: Decoder, plan: Plan, optim: OptimConfig, env: DistEnv,
                          weights: Weights | None = None) -> PipelineEngine:
    """Cut `model` into this rank's stages and return the engine that runs the plan's schedule; its transfers wait
    at most env.timeout_s."""
    return PipelineEngine(model, plan, optim, env, weights)
