"""The built-in decoder: analytic counts match the instantiated model; structure the runtime relies on."""

import pytest
import torch

from snugfit.model import Decoder, ModelConfig


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("kv", [4, 2, 1])
def test_parameter_count_matches_instantiated(arch, tie, kv):
    cfg = ModelConfig(arch=arch, dim=64, n_layers=3, n_heads=4, n_kv_heads=kv, tie_embeddings=tie)
    model = Decoder(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert sum(p.numel() for p in model.blocks["0"].parameters()) == cfg.block_params()
    assert sum(p.numel() for p in model.embed.parameters()) == cfg.embed_params()


def test_meta_device_builds_without_memory():
    with torch.device("meta"):
        model = Decoder(ModelConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336))
    assert all(p.is_meta for p in model.parameters())
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9  # Llama-3-8B shape


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eager_attention_equals_sdpa(arch):
    torch.manual_seed(0)
    sdpa = Decoder(ModelConfig(arch=arch, dim=64, n_layers=2, n_kv_heads=2))
    eager = Decoder(ModelConfig(arch=arch, dim=64, n_layers=2, n_kv_heads=2, attention="eager"))
    eager.load_state_dict(sdpa.state_dict())
    x = torch.randint(0, 256, (2, 24))
    torch.testing.assert_close(eager(x), sdpa(x), rtol=1e-5, atol=1e-5)


def test_attention_is_causal():
    torch.manual_seed(0)
    model = Decoder(ModelConfig(dim=64, n_layers=2))
    x = torch.randint(0, 256, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 256
    torch.testing.assert_close(model(x)[:, :10], model(y)[:, :10])
    assert not torch.allclose(model(x)[:, 10:], model(y)[:, 10:])


def test_stage_split_keeps_names_and_composes():
    """A pipeline stage deletes pieces; the stages chained equal the whole model."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=64, n_layers=4)
    whole = Decoder(cfg)
    first, last = Decoder(cfg), Decoder(cfg)
    first.load_state_dict(whole.state_dict())
    last.load_state_dict(whole.state_dict())
    for i in ("2", "3"):
        del first.blocks[i]
    for i in ("0", "1"):
        del last.blocks[i]
    first.head = first.norm = None
    last.embed = None
    assert set(last.state_dict()) <= set(whole.state_dict())
    x = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(last(first(x), x), whole(x, x))


def test_invalid_config_names_the_field():
    with pytest.raises(ValueError, match="n_heads"):
        Decoder(ModelConfig(dim=64, n_heads=5))
    with pytest.raises(ValueError, match="arch"):
        Decoder(ModelConfig(arch="rnn"))


def test_chunked_loss_equals_the_whole_logits_loss_and_its_gradients(monkeypatch):
    import snugfit.model.decoder as decoder

    torch.manual_seed(0)
    head = torch.nn.Linear(32, 50, bias=False)
    hidden = torch.randn(2, 300, 32, requires_grad=True)
    targets = torch.randint(0, 50, (2, 300))
    targets[0, :40] = -100  # a masked prompt
    want = decoder.cross_entropy(head(hidden), targets)
    want.backward()
    grads = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    monkeypatch.setattr(decoder, "LOSS_CHUNK_BYTES", 4 * 50 * 130)  # 130-token chunks: 5 of them, the last short
    got = decoder.chunked_cross_entropy(hidden, head, targets)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(hidden.grad, grads[0], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(head.weight.grad, grads[1], rtol=1e-5, atol=1e-8)


def test_a_model_trains_alike_with_the_chunked_loss(monkeypatch):
    import snugfit.model.decoder as decoder

    def losses() -> list[float]:
        torch.manual_seed(0)
        model = Decoder(ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = torch.randint(0, 64, (4, 65), generator=torch.Generator().manual_seed(1))
        out = []
        for _ in range(3):
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    whole = losses()
    monkeypatch.setattr(decoder, "LOSS_CHUNK_BYTES", 4 * 64 * 100)  # 128-token chunks (the floor): 2 per batch
    assert losses() == pytest.approx(whole, rel=1e-5)
