"""The built-in Mixture-of-Experts MLP (model.moe): equal to a per-expert loop in forward and gradients, its aux loss
the hand-computed value with its gradient reaching the router, and the decoder with experts trained equal to one
process at 2 and 4 gloo ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from snugfit.model.decoder import Decoder, ModelConfig
from snugfit.model.moe import MoEMLP, begin_step, step_aux_loss

CFG = dict(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=32, n_experts=4, top_k=2, moe_ffn_dim=16)


def _reference(mlp: MoEMLP, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-expert loop over each token's top-k experts, and the aux loss written out."""
    probs = (x @ mlp.router.weight.T).softmax(-1)
    top, idx = probs.topk(mlp.top_k, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(mlp.n_experts):
        gate, up = (x @ mlp.experts.gate_up_proj[e].T).chunk(2, -1)
        y = (F.silu(gate) * up) @ mlp.experts.down_proj[e].T
        out = out + y * (top * (idx == e)).sum(-1, keepdim=True)
    frac = torch.stack([(idx == e).sum() for e in range(mlp.n_experts)]).float() / idx.numel()
    return out, mlp.aux_coef * mlp.n_experts * (frac * probs.mean(0)).sum()


def test_moe_mlp_equals_a_per_expert_loop_and_its_aux_loss_reaches_the_router():
    torch.manual_seed(0)
    model = Decoder(ModelConfig(**CFG, n_shared_experts=1))
    mlp = model.blocks["0"].mlp
    x = torch.randn(3, 8, 32)
    g = torch.randn(3, 8, 32)
    out = mlp(x)
    (out * g).sum().backward()  # backward adds the aux loss's gradient
    grads = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    mlp.zero_grad()
    ref, aux = _reference(mlp, x.reshape(-1, 32))
    ref = ref + mlp.shared(x.reshape(-1, 32))
    torch.testing.assert_close(out.reshape(-1, 32), ref, rtol=1e-5, atol=1e-6)
    # the same upstream gradient as above, plus the aux loss's
    ((ref.reshape(out.shape) * g).sum() + aux).backward()
    for n, p in mlp.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert mlp.router.weight.grad.abs().sum() > 0
    # the aux value by hand: 1 at balanced routing, times the layer's coefficient share
    assert abs(aux.item() / (0.01 / 2) - 1) < 0.5
    assert mlp._aux_sum is not None and torch.allclose(mlp._aux_sum, aux.detach())


def test_aux_loss_is_hand_computed():
    mlp = MoEMLP(8, 4, 2, 8, aux_coef=0.5, shared=None)
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]])
    counts = torch.tensor([1, 1, 1, 1])  # each expert got one of the four (token, slot) pairs
    # E * sum_e f_e P_e = 4 * (0.25 * 0.25 * 4) = 1
    assert abs(mlp.aux_loss(probs, counts).item() - 0.5 * 1.0) < 1e-6
    counts = torch.tensor([2, 2, 0, 0])
    assert abs(mlp.aux_loss(probs, counts).item() - 0.5 * 4 * (0.5 * 0.25 + 0.5 * 0.25)) < 1e-6


def test_step_weights_and_reports_the_aux_loss():
    torch.manual_seed(0)
    model = Decoder(ModelConfig(**CFG))
    tokens = torch.randint(0, 64, (2, 16))
    begin_step(model, 0.5, 1.0)
    for half in tokens.split(1):
        model(half, half).backward()
    aux = step_aux_loss(model)
    assert aux is not None and 0 < aux.item() < 0.05  # about router_aux_coef (0.01) at near-balanced routing
    assert model.cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert model.cfg.num_params(active=True) < model.cfg.num_params()
