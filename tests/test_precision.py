"""The fast paths give the same answers: bf16 autocast against fp32, torch.compile against eager."""
import pytest
import torch

import train_expert
from helpers import run_stage
from model import DiT


def tiny_model(modulation):
    torch.manual_seed(0)
    m = DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=64, depth=2, num_heads=4, num_classes=10,
            learn_sigma=False, modulation=modulation, t_scale=1000.0)
    for p in m.parameters():            # the zero-initialised layers would hide every difference
        torch.nn.init.normal_(p, std=0.05)
    return m.eval()


def inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 1, 8, 8, generator=g), torch.rand(8, generator=g), torch.randint(0, 11, (8,), generator=g)


@pytest.mark.parametrize("modulation", ["adaln-single", "adaln-zero"])
def test_bf16_autocast_matches_fp32(modulation):
    model, (x, t, y) = tiny_model(modulation), inputs()
    with torch.no_grad():
        reference = model(x, t, y)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(x, t, y).float()
    relative = (low - reference).norm() / reference.norm()
    assert 0 < relative < 2e-2     # bf16 keeps ~3 significant digits; not bitwise equal, but close


def test_compile_matches_eager():
    model, (x, t, y) = tiny_model("adaln-single"), inputs()
    compiled = torch.compile(model)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, t, y), model(x, t, y), rtol=1e-5, atol=1e-5)


def test_bf16_training_run(digits_run, tmp_path):
    run_stage(train_expert, ["--cluster", "1", "--steps", "6", "--precision", "bf16", "--model", "DiT-M/2", "--batch-size", "16",
                             "--run-dir", str(digits_run), "--out-dir", str(tmp_path), "--log-every", "3"])
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    assert ckpt["config"]["precision"] == "bf16" and all(v.dtype == torch.float32 for v in ckpt["model"].values())
