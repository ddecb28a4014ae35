"""BPipe: a pipeline whose heavy ranks evict saved activations to their light partner and load them back.

Hand-written rather than run by torch.distributed.pipelining: its action set (F, B, W, SEND/RECV,
UNSHARD, ...) has no evict or load, a registered custom function can only replace an existing action, and
eviction needs messages between non-adjacent stages (x and p-1-x) that the partner must receive and return
while it is itself waiting on ordinary pipeline transfers. So this runs the rank's program from the schedules
registry (plan.schedules: 1F1B's order with EVICT and LOAD as named steps, the same program the time model
simulates) in the picotron style -- warm-up forwards, steady one-forward-one-backward, cool-down backwards --
and both sides read the heavy rank's program, so the partner knows which microbatches will arrive.

Transfers on the pipeline group go out as batch_isend_irecv, a stage's sends with its next receive
(`p2p.StageComms.send`); every wait is bounded by a timeout and raises `PipelineError` naming the stage and
action. A light stage holds its partner's activations on a helper thread with its own process group
(`PartnerStore`), so neither side's waits can block the other.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from snugfit.plan import Plan
from snugfit.plan.schedules import MOVES, Action, partner
from snugfit.runtime.dist import DistEnv
from snugfit.runtime.mesh import ParallelDims
from snugfit.runtime.microbatches import Microbatch
from snugfit.runtime.p2p import StageComms
from snugfit.runtime.pipeline import PipelineRunner, StageModule
from snugfit.runtime.sharding import requires_gradient_sync
from snugfit.runtime.stage_activations import StageActivations

# p2p tags: forward/backward traffic uses 0; evictions are tagged by microbatch so they never mix with it.
_HEADER, _PAYLOAD, _RETURN = 1 << 16, 2 << 16, 3 << 16


class PartnerStore(threading.Thread):
    """The light stage's side of BPipe: hold the heavy partner's evicted microbatches.

    Runs on its own thread and its own process group (gloo point-to-point work
    completes only when waited, so the stage's main loop cannot poll it).
    It follows the heavy stage's EVICT/LOAD steps in the heavy stage's order:
    accept each evicted microbatch as it arrives, and hand it back once this
    stage's own backward of that microbatch is done -- the heavy stage cannot
    need it earlier, since its backward waits on ours.
    """

    def __init__(self, comms: StageComms, group, heavy: int, moves: list[Action], acts: StageActivations,
                 device: torch.device):
        super().__init__(daemon=True, name=f"bpipe-partner-{comms.stage}")
        self.comms, self.group, self.heavy, self.moves, self.acts = comms, group, heavy, moves, acts
        self.device = device  # accepted activations live in this stage's device memory, as the plan counts them
        self.backward_done = {a.mb: threading.Event() for a in moves}
        self.sizes: dict[int, list[int]] = {}  # bytes of each storage of an accepted microbatch, in order
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for a in self.moves:
                (self.accept if a.kind == "EVICT" else self.give_back)(a.mb)
        except BaseException as err:  # reported by finish() on the main thread
            self.error = err

    def accept(self, mb: int) -> None:
        """Receive the heavy stage's storages, one message each, into slices of one buffer (they leave there as
        they are, without a concatenated copy)."""
        count = self.comms.recv(torch.empty(1, dtype=torch.int64), self.heavy, _HEADER + mb,
                                f"accept mb {mb} header from stage {self.heavy}", self.group)
        sizes = self.comms.recv(torch.empty(int(count.item()), dtype=torch.int64), self.heavy, _HEADER + mb,
                                f"accept mb {mb} sizes from stage {self.heavy}", self.group)
        self.sizes[mb] = sizes.tolist()
        # on the device: the heavy stage sends device buffers, and under cuda:nccl,cpu:gloo a host buffer here
        # would be served by the other backend, never meeting them
        flat = torch.empty(sum(self.sizes[mb]), dtype=torch.uint8, device=self.device)
        for part in flat.split(self.sizes[mb]):
            self.comms.recv(part, self.heavy, _PAYLOAD + mb, f"accept mb {mb} from stage {self.heavy}", self.group)
        self.acts.accept((self.heavy, mb), flat)

    def give_back(self, mb: int) -> None:
        if not self.backward_done[mb].wait(self.comms.timeout_s):
            raise self.comms.fail(f"holding mb {mb} for stage {self.heavy}: own backward never came")
        flat = self.acts.release((self.heavy, mb))
        for part in flat.split(self.sizes.pop(mb)):
            work = dist.isend(part, dst=self.comms.ranks[self.heavy], group=self.group, tag=_RETURN + mb)
            self.comms.wait(work, f"return mb {mb} to stage {self.heavy}")

    def finish(self) -> None:
        self.join(self.comms.timeout_s)
        if self.error is not None:
            raise self.error
        if self.is_alive():
            raise self.comms.fail(f"serving stage {self.heavy} at end of step")


class BPipe(PipelineRunner):
    """Runs this rank's program (plan.schedules, with its EVICT and LOAD steps) for a step, one stage per rank;
    the last stage computes the loss. A second process group over the pipeline ranks carries the evictions."""

    def __init__(self, model: nn.Module, stages: list[StageModule], plan: Plan, dims: ParallelDims, env: DistEnv):
        super().__init__(model, stages, plan, dims, env, evict_group=True)
        self.chunk = stages[0]  # hidden states or tokens in, hidden states or logits out; FSDP2 root or not
        s, p = self.pp_rank, plan.pp
        self.program = plan.program(s)
        self.first, self.last = s == 0, s == p - 1
        self.partner = partner(p, s)
        # the heavy partner's EVICT/LOAD steps, in its order: what arrives here and when it must go back
        self.partner_moves = [a for a in plan.program(self.partner) if a.kind in MOVES]

    def run(self, micro: list[Microbatch], feed: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Forward and backward of every microbatch; returns the per-microbatch losses (last stage)."""
        self.inputs, self.outputs, self.losses = {}, {}, []
        self.evict_sends: list[tuple[object, torch.Tensor, int]] = []
        self.store = None
        if self.partner_moves:
            self.store = PartnerStore(self.comms, self.evict_group, self.partner, self.partner_moves, self.acts,
                                      self.hidden.device)
            self.store.start()
        actions = {"F": self.forward, "B": self.backward, "EVICT": self.evict, "LOAD": self.load}
        for a in self.program:
            with self.span(a.kind if a.kind in ("F", "B") else a.kind.lower(), a.mb, a.stage):
                actions[a.kind](a.mb, micro)
        self.comms.finish_sends()
        self.finish_evict_sends()
        if self.store is not None:
            self.store.finish()
        return self.losses

    # -- compute steps --
    def forward(self, mb: int, micro) -> None:
        tokens, targets, docs = micro[mb]
        if self.first:
            self.comms.post_sends()
        x = tokens if self.first else self.comms.recv_forward(self.hidden, mb).requires_grad_()
        self.finish_evict_sends()  # overlapped the receive; done before new activations appear
        y = self.chunk(x, docs)  # the chunk records what it saves under (stage, mb); so does loss_fn
        if self.last:
            y = self.loss(y, targets)
        self.inputs[mb], self.outputs[mb] = x, y
        if self.last:
            self.losses.append(y.detach())
        else:
            self.comms.send_forward(y, mb)

    def backward(self, mb: int, micro) -> None:
        x, y = self.inputs.pop(mb), self.outputs.pop(mb)
        # as PipelineStage does: reduce over dp (unless the plan reduces every microbatch) and reshard once, in the
        # step's last backward (a ZeRO-1/2 unit is gathered once a step)
        if isinstance(self.chunk, FSDPModule):
            last = mb == len(micro) - 1
            self.chunk.set_requires_gradient_sync(requires_gradient_sync(self.plan, last))
            self.chunk.set_reshard_after_backward(last)
        if self.last:
            self.comms.post_sends()
            torch.autograd.backward(y)
        else:
            grad = self.comms.recv_backward(y, mb)
            self.finish_evict_sends()
            torch.autograd.backward(y, grad)
        if not self.first:
            self.comms.send_backward(x.grad, mb)
        if self.store is not None and mb in self.store.backward_done:
            self.store.backward_done[mb].set()

    # -- heavy stage: evict to the partner and load back --
    def evict(self, mb: int, micro) -> None:
        """Ship a microbatch's saved storages to the partner, one message each; the sends overlap the following
        steps, and the storages are freed when they finish."""
        self.comms.finish_sends()  # a pending send_forward may share storage with what is about to be freed
        views = self.acts.evict((self.comms.stage, mb))
        sizes = torch.tensor([v.numel() for v in views], dtype=torch.int64)
        for t, tag in ((torch.tensor([len(views)]), _HEADER + mb), (sizes, _HEADER + mb),
                       *((v, _PAYLOAD + mb) for v in views)):
            work = dist.isend(t, dst=self.comms.ranks[self.partner], group=self.evict_group, tag=tag)
            self.evict_sends.append((work, t, mb))
        self.acts.add_in_flight(int(sizes.sum()))

    def load(self, mb: int, micro) -> None:
        self.finish_evict_sends()  # room made for this microbatch must be gone before it lands
        for view in self.acts.load((self.comms.stage, mb)):  # received straight into the re-allocated storages
            self.comms.recv(view, self.partner, _RETURN + mb, f"load mb {mb} from stage {self.partner}",
                            self.evict_group)

    def finish_evict_sends(self) -> None:
        for work, t, mb in self.evict_sends:
            self.comms.wait(work, f"evict mb {mb} to stage {self.partner}")
            if t.dtype == torch.uint8:
                self.acts.free([t])
                self.acts.add_in_flight(-t.numel())
        self.evict_sends.clear()
