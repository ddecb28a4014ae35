"""Activation policies: every policy gives the loss and gradients of "keep", and holds what it says."""

import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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
    for policy in ("recompute", "selective", "selective_half", "offload", "recompute_offload"):
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
    # Recompute holds block inputs only, selective_half some of selective's matmul outputs; offload holds nothing
    # of the blocks on the device.
    assert held["recompute"] < held["selective_half"] < held["selective"] < held0
    assert held["recompute"] < held0 / 2
    assert held["offload"] < held["recompute"]
    assert held["recompute_offload"] == held["offload"]  # nothing of the blocks: their checkpoints wait on host


class _Gemms(TorchDispatchMode):
    """Counts the linear layers' GEMMs by the weight they multiply (forward, and the input's gradient)."""

    def __init__(self, model):
        super().__init__()
        self.names = {p.untyped_storage().data_ptr(): n.removesuffix(".weight") for n, p in model.named_parameters()}
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.seen[self.names.get(args[-1].untyped_storage().data_ptr())] += 1
        return func(*args, **(kwargs or {}))


def test_selective_half_replays_every_second_linear_layer():
    """In backward, selective_half runs again the forward GEMMs of k, o and up, the 2nd, 4th and 6th of a Llama
    block's q, k, v, o, gate, up, down (what the profile and the time model charge it for); selective none."""
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64)
    tokens, seen = torch.randint(0, 64, (2, 17)), {}
    for policy in ("keep", "selective", "selective_half"):
        torch.manual_seed(0)
        model = Decoder(cfg)
        for block in model.blocks.values():
            apply_activation_policy(block, policy)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        with _Gemms(model) as gemms:
            loss.backward()
        seen[policy] = gemms.seen
    assert seen["selective"] == seen["keep"]
    assert seen["selective_half"] - seen["keep"] == Counter(f"blocks.{i}.{layer}" for i in range(2)
                                                            for layer in ("attn.k", "attn.o", "mlp.up"))


def test_checkpoint_offload_empties_the_block_input_until_its_backward():
    """recompute_offload: after the forward the block input's device storage is empty (the checkpoint still
    references the tensor); the backward refills it before recomputing."""
    torch.manual_seed(0)
    model = Decoder(ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64))
    for block in model.blocks.values():
        apply_activation_policy(block, "recompute_offload")
    inputs = []
    model.blocks["1"].register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    tokens = torch.randint(0, 64, (2, 17))
    loss = model(tokens[:, :-1], tokens[:, 1:])
    assert inputs[0].untyped_storage().nbytes() == 0  # on host only
    loss.backward()
    assert inputs[0].untyped_storage().nbytes() == inputs[0].numel() * inputs[0].element_size()


@pytest.mark.parametrize("policy", ["keep", "recompute", "selective", "selective_half", "offload",
                                    "recompute_offload"])
def test_block_outputs_are_not_views(policy):
    """A block is an FSDP2 unit, and FSDP2 warns of a unit that returns a view: an in-place op on it would skip the
    unit's pre-backward hook. No policy makes the block's output one."""
    block = Decoder(ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64)).blocks["0"]
    apply_activation_policy(block, policy)
    out = block(torch.randn(2, 8, 32, requires_grad=True))
    assert not out._is_view()
    out.sum().backward()


def test_unknown_policy_names_choices():
    block = Decoder(ModelConfig(dim=32, n_layers=1, n_heads=4, vocab_size=64)).blocks["0"]
    with pytest.raises(ValueError, match="keep, recompute, selective, selective_half, offload, recompute_offload"):
        apply_activation_policy(block, "evict")


def test_offload_copies_back_one_block_ahead_of_backward(monkeypatch):
    """When block i's backward starts, block i-1's saved tensors are already on their way back."""
    import snugfit.runtime.activations as acts
    from snugfit.model.decoder import Decoder, ModelConfig

    torch.manual_seed(0)
    model = Decoder(ModelConfig(dim=32, n_layers=3, n_heads=4, vocab_size=64, max_seq_len=16))
    events: list[tuple[str, int]] = []
    running = [-1]  # the block whose forward saves tensors now
    block_of: dict[int, int] = {}
    init, fetch = acts._HostCopy.__init__, acts._HostCopy.fetch

    def tagged_init(self, t, stream):
        init(self, t, stream)
        block_of[id(self)] = running[0]

    def logged_fetch(self):
        if self.back is None and not self.used:
            events.append(("fetch", block_of[id(self)]))
        fetch(self)

    monkeypatch.setattr(acts._HostCopy, "__init__", tagged_init)
    monkeypatch.setattr(acts._HostCopy, "fetch", logged_fetch)
    for i, block in enumerate(model.blocks.values()):
        acts.apply_activation_policy(block, "offload")
        block.register_forward_pre_hook(lambda m, a, i=i: running.__setitem__(0, i))
        block.register_full_backward_pre_hook(lambda m, g, i=i: events.append(("backward", i)))
    tokens = torch.randint(0, 64, (2, 17))
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    for b in (0, 1):  # on their way as the backward of the block after them starts, before their own
        assert events.index(("backward", b + 1)) < events.index(("fetch", b)) < events.index(("backward", b))
