"""A training run as the loop's handlers see it: what they share (`Run`), the moments they are called at (`Handler`)
and what a step hands them (`StepDone`). The run's state goes into a checkpoint and comes back out of one here,
in one place, whoever asks for it (an interval, the last step, a signal, a switch of plan, a run of bad steps)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from snugfit.config import RunConfig, packed_in
from snugfit.data import BatchSampler
from snugfit.data.instruct import InstructSampler
from snugfit.errors import SnugfitError
from snugfit.plan import Plan
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.engine import Engine, StepResult
from snugfit.train.build import RunData, base_record, model_identity
from snugfit.train.checkpoint import Checkpoints
from snugfit.train.metrics import MetricsLog

log = logging.getLogger("snugfit")


@dataclass
class TrainResult:
    """What `train` returns: where the run wrote, the last step it finished and its losses."""

    out_dir: Path
    last_step: int
    losses: dict[int, float] = field(default_factory=dict)  # step -> training loss
    val_losses: dict[int, float] = field(default_factory=dict)  # step -> validation loss (step 0: before training)


@dataclass(frozen=True)
class StepDone:
    """The step just taken: its number (from 1), learning rate and result, and its seconds with the blocks'
    compilation left out (compile_s: the seconds this step spent compiling them)."""

    step: int
    lr: float
    result: StepResult
    seconds: float
    compile_s: float


@dataclass
class Run:
    """What the handlers share: the run's settings and ranks, the plan and engine it trains under now with their data
    order and validation batches (a switch of plan replaces all four), the steps done, and where it records and says
    things."""

    cfg: RunConfig
    env: DistEnv
    data: RunData
    checkpoints: Checkpoints
    plan: Plan
    engine: Engine
    result: TrainResult
    metrics: MetricsLog = field(init=False)  # opened once the run's folder is settled: a refused resume writes nothing
    bar: object = None  # rank 0's progress bar (tqdm), None without one
    sampler: BatchSampler | InstructSampler = field(init=False)
    val: list[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.use(self.plan, self.engine)

    @property
    def step(self) -> int:
        """Steps done (the last one finished)."""
        return self.result.last_step

    @property
    def out(self) -> Path:
        return self.result.out_dir

    def use(self, plan: Plan, engine: Engine) -> None:
        """Train under `plan` with `engine` from here on, with this rank's data order and the validation batches
        for that plan."""
        t = self.cfg.train
        self.plan, self.engine = plan, engine
        dp_rank = plan.layout.coords(self.env.rank)[1]
        self.sampler = self.data.sampler(plan, t.seed, dp_rank)
        self.val = self.data.eval_batches(plan, t.eval_batches, dp_rank)

    def say(self, text: str) -> None:
        """A line for the user, above the progress bar where there is one."""
        if self.bar is not None:
            self.bar.write(text)
        else:
            log.info(text)

    def save_checkpoint(self, in_background: bool = False) -> Path:
        """The one save path: this step's checkpoint (weights, optimizer, loss scale, data position, RNGs, plan and
        config), committed before returning, or with `in_background` written behind the next steps."""
        save = self.checkpoints.save_async if in_background else self.checkpoints.save
        return save(self.step, self.engine.state_dict(), self._trainer_state())

    def restore(self, path: Path) -> None:
        """Go on from the checkpoint at `path` under this run's plan (another plan or world size than the one that
        wrote it included): weights, optimizer state, loss scale, data position and step."""
        state = self.engine.state_dict()
        trainer_state = self.checkpoints.load(path, state, model_identity(self.cfg))
        packed = packed_in(trainer_state["config"]) if "config" in trainer_state else self.cfg.data.packs
        if packed != self.cfg.data.packs:  # the saved data position counts rows: packed ones, or one example each
            raise SnugfitError(f"checkpoint {path} trained on examples {'packed' if packed else 'one a sequence'}, "
                               f"this run {'packs' if self.cfg.data.packs else 'does not pack'} them, so the resumed "
                               f"data order would differ; pass --pack {str(packed).lower()}")
        self.engine.load_state_dict(state)
        if self.engine.scaler is not None and "loss_scale" in trainer_state:  # a float16 run goes on at its scale
            self.engine.scaler.load_state_dict(trainer_state["loss_scale"])
        self.sampler.load_state_dict(trainer_state["sampler"])
        saved = Plan.from_dict(trainer_state["plan"]).world_size if "plan" in trainer_state else None
        if saved and saved != self.plan.world_size and self.env.is_main:
            log.info("the checkpoint was written by %d ranks; %s for the %d launched", saved,
                     "re-planned" if self.cfg.parallel.plan == "auto" else "resuming under the given plan",
                     self.plan.world_size)
        if trainer_state["step"] >= self.cfg.train.steps:
            raise SnugfitError(
                f"checkpoint {path} is at step {trainer_state['step']}, not before train.steps "
                f"({self.cfg.train.steps}); raise --steps to train further"
            )
        self.result.last_step = trainer_state["step"]

    def _trainer_state(self) -> dict:
        state = {"sampler": self.sampler.state_dict(), "model": model_identity(self.cfg), "plan": self.plan.to_dict(),
                 "config": self.cfg.to_dict(), "base": base_record(self.cfg)}
        if self.engine.scaler is not None:
            state["loss_scale"] = self.engine.scaler.state_dict()
        return state


class Handler:
    """One concern of a run (its log, evaluation, checkpoints, ...), called by the loop at named moments, in the
    order the loop was given the handlers. Each moment does nothing unless a handler overrides it."""

    def on_start(self, run: Run) -> None:
        """Before this launch's first step (run.step: the step it starts after, 0 for a fresh run)."""

    def before_step(self, run: Run) -> None:
        """Before step run.step + 1 is taken."""

    def after_step(self, run: Run, done: StepDone) -> None:
        """After step done.step (run.step now). Raising stops the run (save what must be saved first)."""

    def on_stop(self, run: Run, error: BaseException | None) -> None:
        """When the run ends: error None after its last step, else what stopped it (a handler, a signal, a
        failure). Raising here puts a clearer error in its place, and the handlers after this one are not called."""
