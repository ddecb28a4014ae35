"""MemoryTracker on a plain model: categories counted from the tensors, activations from saved tensors."""

from __future__ import annotations

import torch

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.runtime.memory import KEYS, MemoryTracker, tensor_bytes

CFG = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32)


def test_categories_follow_the_step():
    model = Decoder(CFG)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    tracker = MemoryTracker(model, [opt])
    params = sum(p.numel() * 4 for p in model.parameters())
    snap = tracker.sample()
    assert set(KEYS) <= set(snap)
    assert snap["device.parameters"] == params and snap["device.gradients"] == 0 and snap["host.total"] == 0
    x = torch.randint(0, CFG.vocab_size, (2, 17))
    with tracker.track_activations():
        loss = model(x[:, :-1], x[:, 1:])
    held = tracker.sample()["device.activations"]
    assert held > 2 * 16 * CFG.dim * 4 * CFG.n_layers  # at least one hidden state per block
    loss.backward()
    opt.step()
    snap = tracker.sample()
    assert snap["device.activations"] == 0  # backward freed every saved tensor
    assert snap["device.gradients"] == params
    assert 2 * params <= snap["device.optimizer"] < 2 * params + 1024  # two states + step counters
    peak = tracker.peak()
    assert peak["device.activations"] == held
    assert peak["device.total"] >= snap["device.total"]
    tracker.reset_peak()
    assert tracker.peak()["device.activations"] == 0


def test_saved_tensors_are_counted_once_per_storage_and_parameters_never():
    w = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    tracker = MemoryTracker(torch.nn.Linear(1, 1))
    with tracker.track_activations():
        y = (x * x).sum() + (x @ w).sum()  # x saved three times, w (a parameter) twice
    assert tracker.live_activation_bytes == x.numel() * 4
    y.backward()
    assert tracker.live_activation_bytes == 0


def test_sources_add_host_bytes():
    model = torch.nn.Linear(4, 4)
    host = torch.zeros(100)
    tracker = MemoryTracker(model, sources=[lambda: {"host.optimizer": tensor_bytes([host, host[:10]])}])
    snap = tracker.snapshot()
    assert snap["host.optimizer"] == 400 and snap["host.total"] == 400
