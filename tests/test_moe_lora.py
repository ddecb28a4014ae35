"""Trainable parameters by kind: a LoRA target list that misses the experts or the router shows as 0 there."""

import torch

from snugfit.model.lora import trainable_by_kind
from snugfit.model.moe import MoEMLP


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.wq = torch.nn.Linear(8, 8, bias=False)
        self.mlp = MoEMLP(8, 4, 2, 8, aux_coef=0.0, shared=None)


def test_counts_by_kind_name_router_experts_and_attention():
    model = torch.nn.ModuleDict({"layer": Block()})
    counts = trainable_by_kind(model)
    assert counts == {"router": 4 * 8, "experts": 4 * 16 * 8 + 4 * 8 * 8, "attention": 64, "MLP": 0, "other": 0}
    model.layer.mlp.requires_grad_(False)
    assert trainable_by_kind(model)["experts"] == 0 and trainable_by_kind(model)["router"] == 0
