"""Point-to-point transfers of one pipeline stage: batched with the next receive, every wait bounded and named.

The pipeline runners' own transfers (BPipe's steps, every runner's forward-only evaluation) go through
`StageComms`; torch's schedules use their own. A failed or stalled transfer raises `PipelineError` naming the
stage, the rank and the action.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class PipelineError(RuntimeError):
    """A pipeline step failed; the message names the stage, the rank and the action."""


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
