"""BPipe: 1F1B whose heavy stages evict saved activations to their light partner stage.

Hand-written rather than built on torch.distributed.pipelining: its action set
(F, B, W, SEND/RECV, UNSHARD, ...) has no evict or load, a registered custom
function can only replace an existing action, and eviction needs messages
between non-adjacent stages (x and p-1-x) that the partner must receive and
return while it is itself waiting on ordinary pipeline transfers. So this is
a compact 1F1B in the picotron style -- warm-up forwards, steady
one-forward-one-backward, cool-down backwards -- with EVICT and LOAD as named
steps of the heavy stage's program (`bpipe_program`), computed identically on
both sides so the partner knows which microbatches will arrive.

Transfers on the pipeline group go out as batch_isend_irecv, a stage's sends with
its next receive (see `StageComms.send`); every wait is bounded by a timeout and raises `PipelineError` naming the stage and action.
A light stage holds its partner's activations on a helper thread with its own
process group (`PartnerStore`), so neither side's waits can block the other.
"""

from __future__ import annotations

from contextlib import nullcontext

import threading
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from snugfit.runtime.stage_activations import StageActivations

# p2p tags: forward/backward traffic uses 0; evictions are tagged by microbatch so they never mix with it.
_HEADER, _PAYLOAD, _RETURN = 1 << 16, 2 << 16, 3 << 16


class PipelineError(RuntimeError):
    """A pipeline step failed; the message names the stage, the rank and the action."""


def one_f_one_b(num_stages: int, num_microbatches: int, stage: int) -> list[tuple[str, int]]:
    """1F1B order of one stage: p-s-1 warm-up forwards, then alternate, then the remaining backwards."""
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    order = [("F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i), ("B", i)]
    return order + [("B", i) for i in range(m - warmup, m)]


def partner(num_stages: int, stage: int) -> int:
    return num_stages - 1 - stage


def bpipe_program(num_stages: int, num_microbatches: int, stage: int, bound: int) -> list[tuple[str, int]]:
    """A stage's 1F1B order with EVICT/LOAD steps keeping at most `bound` microbatches resident.

    Only heavy stages (stage < its partner) evict. Before a forward that would
    exceed the bound, evict the resident microbatch whose backward is furthest
    away (the newest); before the backward of an evicted one, make room and load it.
    """
    order = one_f_one_b(num_stages, num_microbatches, stage)
    if stage >= partner(num_stages, stage):
        return order
    resident: list[int] = []
    evicted: set[int] = set()
    program: list[tuple[str, int]] = []

    def make_room() -> None:
        while len(resident) >= bound:
            victim = max(resident)
            resident.remove(victim)
            evicted.add(victim)
            program.append(("EVICT", victim))

    for op, mb in order:
        if op == "F":
            make_room()
            resident.append(mb)
        elif mb in evicted:
            make_room()
            evicted.remove(mb)
            program.append(("LOAD", mb))
            resident.append(mb)
        if op == "B":
            resident.remove(mb)
        program.append((op, mb))
    return program


class StageComms:
    """Point-to-point transfers of one stage on the pipeline group, every wait bounded and named."""

    def __init__(self, group, stage: int, num_stages: int, timeout_s: float):
        self.group, self.stage, self.num_stages, self.timeout_s = group, stage, num_stages, timeout_s
        self.ranks = dist.get_process_group_ranks(group)  # global rank of each stage
        self.rank = self.ranks[stage]
        self.sends: list[tuple[object, torch.Tensor, str]] = []  # posted, not yet waited
        self.unposted: list[tuple[dist.P2POp, str]] = []  # queued for the next receive's batch

    def fail(self, action: str, err: BaseException | None = None) -> PipelineError:
        why = f": {err}" if err else f": nothing within {self.timeout_s:.0f} s (peer dead or stuck?)"
        return PipelineError(f"pipeline stage {self.stage} (rank {self.rank}) {action} failed{why}")

    def wait(self, work, action: str) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except Exception as err:  # backend timeout or a closed connection: say where
            raise self.fail(action, err) from err

    def send(self, t: torch.Tensor, stage: int, tag: int, action: str) -> None:
        """Queue t for `stage` on the pipeline group. It is posted together with this stage's next receive, as
        one batch_isend_irecv, or by `post_sends`. Two neighbours in steady 1F1B both send before they
        receive (forward out, then the gradient in; gradient out, then the next forward in), and NCCL blocks
        an unbatched send until it is matched: posted alone, in that order, both sides would wait forever."""
        self.unposted.append((dist.P2POp(dist.isend, t.contiguous(), self.ranks[stage], self.group, tag), action))

    def post_sends(self) -> None:
        """Post the queued sends (before compute that starts with no receive)."""
        if self.unposted:
            self._post(self.unposted, None)
            self.unposted = []

    def recv(self, t: torch.Tensor, stage: int, tag: int, action: str, group=None) -> torch.Tensor:
        """Receive into t from `stage`; on the pipeline group the queued sends go in the same batch."""
        own = group is None
        op = dist.P2POp(dist.irecv, t, self.ranks[stage], group or self.group, tag)
        self._post(self.unposted if own else [], (op, action))
        if own:
            self.unposted = []
        return t

    def _post(self, sends: list[tuple[dist.P2POp, str]], recv: tuple[dist.P2POp, str] | None) -> None:
        """One batch_isend_irecv; waits for the receive only. Gloo returns a work per op (the sends are waited
        in finish_sends); NCCL one for the whole batch, waited here (on the device stream, not the host)."""
        ops = [op for op, _ in sends] + ([recv[0]] if recv else [])
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):
            self.sends += [(w, op.tensor, action) for w, (op, action) in zip(works, sends)]
            if recv:
                self.wait(works[-1], recv[1])
        else:
            for w in works:
                self.wait(w, recv[1] if recv else sends[0][1])

    def finish_sends(self) -> None:
        self.post_sends()
        while self.sends:
            work, _, action = self.sends.pop(0)
            self.wait(work, action)

    # -- named pipeline transfers --
    def send_forward(self, y: torch.Tensor, mb: int) -> None:
        self.send(y.detach(), self.stage + 1, 0, f"send_forward mb {mb}")

    def recv_forward(self, like: torch.Tensor, mb: int) -> torch.Tensor:
        return self.recv(torch.empty_like(like), self.stage - 1, 0, f"recv_forward mb {mb}")

    def send_backward(self, g: torch.Tensor, mb: int) -> None:
        self.send(g, self.stage - 1, 0, f"send_backward mb {mb}")

    def recv_backward(self, like: torch.Tensor, mb: int) -> torch.Tensor:
        return self.recv(torch.empty_like(like), self.stage + 1, 0, f"recv_backward mb {mb}")


class PartnerStore(threading.Thread):
    """The light stage's side of BPipe: hold the heavy partner's evicted microbatches.

    Runs on its own thread and its own process group (gloo point-to-point work
    completes only when waited, so the stage's main loop cannot poll it).
    It follows the heavy stage's EVICT/LOAD steps in the heavy stage's order:
    accept each evicted microbatch as it arrives, and hand it back once this
    stage's own backward of that microbatch is done -- the heavy stage cannot
    need it earlier, since its backward waits on ours.
    """

    def __init__(self, comms: StageComms, group, heavy: int, moves: list[tuple[str, int]], acts: StageActivations,
                 device: torch.device):
        super().__init__(daemon=True, name=f"bpipe-partner-{comms.stage}")
        self.comms, self.group, self.heavy, self.moves, self.acts = comms, group, heavy, moves, acts
        self.device = device  # accepted activations live in this stage's device memory, as the plan counts them
        self.backward_done = {mb: threading.Event() for op, mb in moves}
        self.sizes: dict[int, list[int]] = {}  # bytes of each storage of an accepted microbatch, in order
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for op, mb in self.moves:
                (self.accept if op == "EVICT" else self.give_back)(mb)
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


class BPipeSchedule:
    """Runs one stage's `bpipe_program` for a step; the last stage computes the loss.

    chunk: the stage module (hidden states or tokens in, hidden states or logits out), FSDP2 root or not.
    loss_fn: the microbatch's share of the step loss (already scaled: `runtime.engine.loss_divisors`).
    evict_group: a second process group over the pipeline ranks, for evictions only.
    hidden: an empty tensor of the hidden-state shape and dtype passed between stages.
    """

    def __init__(self, chunk: nn.Module, comms: StageComms, evict_group, acts: StageActivations,
                 num_microbatches: int, bound: int, hidden: torch.Tensor, loss_fn: Callable):
        self.chunk, self.comms, self.acts, self.loss_fn, self.hidden = chunk, comms, acts, loss_fn, hidden
        self.evict_group = evict_group
        s, p, m = comms.stage, comms.num_stages, num_microbatches
        self.program = bpipe_program(p, m, s, bound)
        self.first, self.last = s == 0, s == p - 1
        self.partner = partner(p, s)
        # the heavy partner's EVICT/LOAD steps, in its order: what arrives here and when it must go back
        self.partner_moves = [a for a in bpipe_program(p, m, self.partner, bound) if a[0] in ("EVICT", "LOAD")]
        self.span: Callable = lambda kind, mb: nullcontext()  # the engine's tracer, for traced steps

    def step(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Forward and backward of every microbatch; returns the per-microbatch losses (last stage)."""
        self.inputs, self.outputs, self.losses = {}, {}, []
        self.evict_sends: list[tuple[object, torch.Tensor, int]] = []
        self.store = None
        if self.partner_moves:
            self.store = PartnerStore(self.comms, self.evict_group, self.partner, self.partner_moves, self.acts,
                                      self.hidden.device)
            self.store.start()
        actions = {"F": self.forward, "B": self.backward, "EVICT": self.evict, "LOAD": self.load}
        for op, mb in self.program:
            with self.span(op if op in ("F", "B") else op.lower(), mb):
                actions[op](mb, micro)
        self.comms.finish_sends()
        self.finish_evict_sends()
        if self.store is not None:
            self.store.finish()
        return self.losses

    # -- compute steps --
    def forward(self, mb: int, micro) -> None:
        tokens, targets = micro[mb]
        if self.first:
            self.comms.post_sends()
        x = tokens if self.first else self.comms.recv_forward(self.hidden, mb).requires_grad_()
        self.finish_evict_sends()  # overlapped the receive; done before new activations appear
        y = self.chunk(x)  # the chunk records what it saves under (stage, mb); so does loss_fn
        if self.last:
            y = self.loss_fn(y, targets)
        self.inputs[mb], self.outputs[mb] = x, y
        if self.last:
            self.losses.append(y.detach())
        else:
            self.comms.send_forward(y, mb)

    def backward(self, mb: int, micro) -> None:
        x, y = self.inputs.pop(mb), self.outputs.pop(mb)
        if isinstance(self.chunk, FSDPModule):  # as PipelineStage does: reduce over dp and reshard once, in the
            last = mb == len(micro) - 1           # step's last backward (a ZeRO-1/2 unit is gathered once a step)
            self.chunk.set_requires_gradient_sync(last)
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
