"""Activation policies: every policy gives the loss and gradients of "keep", and holds what it says."""

import copy

import pytest
import torch

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.runtime.activations import apply_activation_policy
from snugfit.runtime.memory import MemoryTracker


def _loss_and_grads(model, tokens, tracker=None):
    if tracker is None:
        loss = model(tokens[:, :-1], tokens[:, 1:])
    else:
        with tracker.track_activations():
            loss = model(tokens[:, :-1], tokens[:, 1:])
    peak = tracker.live_activation_bytes if tracker else 0
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, peak


@pytest.mark.parametrize("arch,attention", [("llama", "sdpa"), ("gpt2", "eager")])
def test_policies_match_keep(arch, attention):
    torch.manual_seed(0)
    ref = Decoder(ModelConfig(arch=arch, attention=attention, dim=32, n_layers=3, n_heads=4, vocab_size=64))
    tokens = torch.randint(0, 64, (2, 17))
    tracker = MemoryTracker(ref)
    loss0, grads0, held0 = _loss_and_grads(ref, tokens, tracker)
    held = {}
    for policy in ("recompute", "selective", "offload"):
        model = copy.deepcopy(ref)
        model.zero_grad(set_to_none=True)
        for block in model.blocks.values():
            apply_activation_policy(block, policy)
        tracker = MemoryTracker(model)
        loss, grads, held[policy] = _loss_and_grads(model, tokens, tracker)
        assert loss == pytest.approx(loss0, rel=1e-6), policy
        assert grads.keys() == grads0.keys()
        for name in grads0:
            torch.testing.assert_close(grads[name], grads0[name], rtol=1e-5, atol=1e-7, msg=f"{policy} {name}")
        assert set(n for n, _ in model.named_parameters()) == set(grads0)  # names unchanged
    # Recompute holds block inputs only; offload holds nothing of the blocks on the device.
    # (selective keeps matmul outputs inside the checkpoint, where saved-tensor hooks cannot see them.)
    assert held["recompute"] < held0 / 2
    assert held["offload"] < held["recompute"]


def test_unknown_policy_names_choices():
    block = Decoder(ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64)).blocks["0"]
    with pytest.raises(ValueError, match="keep, recompute"):
        apply_activation_policy(block, "evict")
