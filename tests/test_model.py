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
