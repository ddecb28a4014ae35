"""Tied embeddings across pipeline stages, Megatron's way: the first and the last stage each hold the shared weight,
and their gradients are summed before the update.

A model that ties its head to its token embedding (Qwen2.5 up to 3B, Gemma, GPT-2, OPT) computes with one weight at
both ends. Pipelined, the embedding runs in stage 0 and the head in the last stage, each stage its own FSDP2 root
unit: the head holds a copy of its own (the memory model charges it, plan.piece_memory), on another rank, or on
the same one where a V schedule folds the last stage back (`untie_head`: two FSDP2 roots cannot share a parameter).
After backward, before the global-norm clip, `TiedEmbeddings.sum_grads` adds the two gradients (an all-reduce
between the two pipeline ranks of each data-parallel and tensor-parallel coordinate, or in place on one rank): each
copy then holds the gradient the one-process model's shared weight gets, takes the same update from the same
values, and stays equal to the other. Both copies are sharded over dp alike, so local shards pair exactly.

Both start equal: the weights' sources fill the head's copy with the embedding's values (model.decoder.init_name,
model.hf.load_weights), and a model built whole cuts both from the same tensor. The global gradient norm counts the
weight once (`is_head_copy`, as Megatron's clip skips its shared copies). Checkpoints hold each copy's weight under
its own name, as the one-process model's state dict names both, and their optimizer states once, under the
embedding's name (`TiedEmbeddings.saved_states`), as the one-process model's: a checkpoint loads under any other pipeline split.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn

from snugfit.model.decoder import EMBEDDING
from snugfit.plan import Plan, PlanError
from snugfit.runtime.dist import DistEnv, cached_group
from snugfit.runtime.memory import local
from snugfit.runtime.offload import HostOffload

HEAD_COPY = "snugfit_tied_head_copy"  # set on the head's copy: the gradient norm counts the embedding's only


def ties(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "cfg", None), "tie_embeddings", False))


def head_name(model: nn.Module) -> str:
    """The head's output weight's name: a Hugging Face model's says where it is (after OPT's project_out)."""
    return getattr(model, "head_weight", "head.weight")


def untie_head(model: nn.Module) -> None:
    """Give the head a weight of its own, equal to the embedding's: the stages holding them are separate FSDP2
    roots (runtime.pipeline.stage_parts, where one rank runs both the first and the last stage)."""
    module, _, attr = head_name(model).rpartition(".")
    out, shared = model.get_submodule(module), model.get_parameter(EMBEDDING)
    if getattr(out, attr) is shared:
        setattr(out, attr, nn.Parameter(shared.detach().clone(), requires_grad=shared.requires_grad))


def is_head_copy(p: torch.Tensor) -> bool:
    """Whether p is the head's copy of a tied weight (runtime.grad_norm leaves it out of the norm)."""
    return getattr(p, HEAD_COPY, False)


class TiedEmbeddings:
    """Sums the gradients of this rank's copies of a tied weight with those of its partner stage.

    copies: this rank's parameters holding the weight (the embedding's and/or the head's, as FSDP2 registered
    them); group: the two pipeline ranks holding them, None where this rank holds both; host: host offload, whose
    masters hold the gradients of the units it owns.
    """

    def __init__(self, copies: list[nn.Parameter], group: dist.ProcessGroup | None, device: torch.device,
                 host: HostOffload | None = None, head: str | None = None):
        self.copies, self.group, self.device, self.host = copies, group, device, host
        self.head = head  # the head's copy's name on this rank (None: the embedding's only)

    @classmethod
    def of(cls, model: nn.Module, plan: Plan, env: DistEnv, host: HostOffload | None = None) -> "TiedEmbeddings | None":
        """The pairing of this rank's part of a pipelined `model` (as runtime.build parallelized and filled it);
        None where the model ties nothing, this rank holds no copy, or the weight is frozen. Every rank makes every
        pair's group (new_group's rule)."""
        if not ties(model) or not plan.schedule_entry.pipelined:
            return None
        if plan.optimizer.in_backward:
            raise PlanError("a tied embedding's copies are summed after backward, but the optimizer steps in it; "
                            "drop optimizer.in_backward or untie the embeddings (model.tie_embeddings = false)")
        first, last = plan.stage_rank(0), plan.stage_rank(len(plan.stage_ranges()) - 1)
        group, timeout = None, timedelta(seconds=env.timeout_s)
        for d in range(plan.dp if first != last else 0):
            for t in range(plan.tp):
                ranks = [plan.layout.rank(first, d, t), plan.layout.rank(last, d, t)]
                g = cached_group(("tied", *ranks, env.timeout_s), lambda: dist.new_group(ranks, timeout=timeout))
                group = g if env.rank in ranks else group
        copies = ([model.get_parameter(EMBEDDING)] if model.embed is not None else []) + (
            [model.get_parameter(head_name(model))] if model.head is not None else [])
        if not any(p.requires_grad for p in copies):  # a rank between the two, or a frozen weight
            return None
        if model.head is not None:
            setattr(copies[-1], HEAD_COPY, True)
        return cls(copies, group, env.device, host, head_name(model) if model.head is not None else None)

    def saved_states(self, states: dict[str, dict]) -> dict[str, dict]:
        """The updaters' optimizer states by name, the tied weight's once, under the embedding's name, as the
        one-process model saves them: a checkpoint of one pipeline split loads into both copies under another."""
        if self.head in states:
            head = states.pop(self.head)
            states.setdefault(EMBEDDING, head)  # where both copies are here their states are equal
        return states

    def states_to_load(self, saved: dict[str, dict]) -> dict[str, dict]:
        """A checkpoint's optimizer states with the tied weight's given to the head's copy too."""
        if self.head is not None and EMBEDDING in saved:
            return {**saved, self.head: saved[EMBEDDING]}
        return saved

    @torch.no_grad()
    def sum_grads(self) -> None:
        """Make every copy's gradient the sum of both stages' (after backward, before clipping and the update)."""
        grads = self._grads()
        if self.group is None:  # both copies here
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
            return
        g = grads[0]
        on_device = g if g.device == self.device else g.to(self.device)  # host-held: NCCL reduces device tensors
        dist.all_reduce(on_device, group=self.group)
        if on_device is not g:
            g.copy_(on_device)

    def _grads(self) -> list[torch.Tensor]:
        """This step's local gradient of each copy: the device shard, or host offload's master gradient."""
        hosted = {id(p): g for p, g in self.host.grads()} if self.host is not None else {}
        out = []
        for p in self.copies:
            g = hosted.get(id(p), p.grad)
            if g is None:  # no gradient reached this copy in this step (no token, or a frozen partner)
                p.grad = g = torch.zeros_like(p)
            out.append(local(g))
        return out
