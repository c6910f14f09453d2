"""model.py: DiT's and PixArt's names and shapes, the registry, the routers and their size
rule, and the FLOP counter."""
import numpy as np
import pytest
import torch

from plumbing.checkpoint import infer_dit_args
from model import DiT, Router, count_flops, model_args_for, registry_name, sincos_pos_embed

pytestmark = [pytest.mark.fast, pytest.mark.usefixtures("float64")]


def count(model):
    """Tensors in the state dict, as DiT's 675M counts them (its frozen pos_embed included)."""
    return sum(v.numel() for v in model.state_dict().values())


def test_dit_xl2_parameter_counts():
    with torch.device("meta"):
        zero = DiT(**model_args_for("DiT-XL/2"), input_size=32, in_channels=4,
                   modulation="adaln-zero")
        single = DiT(**model_args_for("DiT-XL/2"), input_size=32, in_channels=4,
                     modulation="adaln-single")
    assert count(zero) == 675_129_632          # DiT paper: 675M
    D, depth = 1152, 28
    removed = depth * (D * 6 * D + 6 * D) + (D * 2 * D + 2 * D)
    added = (D * 6 * D + 6 * D) + depth * 6 * D + 2 * D
    assert count(single) == count(zero) - removed + added
    # the per-block modulation MLPs were a third of DiT-XL
    assert 440e6 < count(single) < 460e6
    assert not any("adaLN_modulation" in k for k in single.state_dict())
    assert tuple(single.blocks[3].scale_shift_table.shape) == (6, D)


@pytest.mark.parametrize("modulation", ["adaln-single", "adaln-zero"])
def test_dit_shapes_and_null_class(modulation):
    torch.manual_seed(0)
    m = DiT(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=2,
            num_heads=4, num_classes=10,
            learn_sigma=True, modulation=modulation)
    out = m(torch.randn(5, 3, 8, 8), torch.rand(5) * 999, torch.tensor([0, 1, 2, 10, 10]))
    assert out.shape == (5, 6, 8, 8)
    assert out.abs().max() == 0   # the zero-initialised output layer
    uncond = DiT(input_size=8, patch_size=4, in_channels=1, hidden_size=32, depth=1,
                 num_heads=2, num_classes=0, learn_sigma=False)
    assert uncond(torch.randn(2, 1, 8, 8), torch.rand(2)).shape == (2, 1, 8, 8)
    assert not hasattr(uncond, "y_embedder")


def test_registry_cuts_28_pixels_into_patches_that_divide_it():
    """Fashion-MNIST's 28 px has no patch 8: /7 and /14 give 16 and 4 tokens, and the
    size's name survives a round trip."""
    for name, tokens in [("DiT-N/7", 16), ("DiT-N/14", 4), ("DiT-N/28", 1)]:
        args = model_args_for(name, input_size=28, in_channels=1, num_classes=10,
                              learn_sigma=False)
        m = DiT(**args)
        assert (m.x_embedder.proj.kernel_size == (args["patch_size"],) * 2
                and m.pos_embed.shape[1] == tokens)
        assert m(torch.randn(2, 1, 28, 28), torch.rand(2),
                 torch.tensor([0, 10])).shape == (2, 1, 28, 28)
        assert registry_name(args) == name


def test_router_shapes():
    r = Router(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=1,
               num_heads=2, num_experts=4, num_classes=10)
    logits = r(torch.randn(3, 1, 8, 8), torch.rand(3), torch.tensor([1, 2, 10]))
    assert logits.shape == (3, 4) and torch.allclose(logits, torch.zeros(3, 4))
    torch.testing.assert_close(r(torch.randn(3, 1, 8, 8), torch.rand(3),
                                 torch.full((3,), 10)).softmax(1), torch.full((3, 4), 0.25))


def test_a_pooled_router_is_the_plain_router_on_the_pooled_image():
    torch.manual_seed(0)
    pooled = Router(input_size=28, patch_size=7, in_channels=1, hidden_size=32, depth=1,
                    num_heads=2,
                    num_experts=4, num_classes=10, downsample=2)
    plain = Router(input_size=14, patch_size=7, in_channels=1, hidden_size=32, depth=1,
                   num_heads=2,
                   num_experts=4, num_classes=10)
    # the head starts at zero: give the logits something to say
    torch.nn.init.normal_(pooled.head.weight)
    plain.load_state_dict(pooled.state_dict())
    x, t, y = torch.randn(3, 1, 28, 28), torch.rand(3), torch.tensor([1, 2, 10])
    torch.testing.assert_close(pooled(x, t, y),
                               plain(torch.nn.functional.avg_pool2d(x, 2), t, y))
    assert pooled.pos_embed.shape[1] == 4


def test_forward_flops_on_the_meta_device_are_the_count_of_the_real_forward():
    from model import DiT, forward_flops, model_args_for
    cases = [(DiT, model_args_for("DiT-M/4", input_size=28, in_channels=1, num_classes=10)),
             (DiT, model_args_for("DiT-N/2", input_size=8, in_channels=4, num_classes=0,
                                  text_dim=16, text_len=5)),
             (Router, model_args_for("DiT-N/7", input_size=28, in_channels=1,
                                     num_classes=10, num_experts=4)),
             (Router, model_args_for("DiT-M/7", input_size=28, in_channels=1,
                                     num_classes=0, num_experts=4,
                                     downsample=2)),
             (Router, model_args_for("DiT-N/2", input_size=8, in_channels=4,
                                     num_classes=0, text_dim=16,
                                     num_experts=3))]
    for cls, args in cases:
        net, n = cls(**args), args["input_size"]
        y = (torch.zeros(1, dtype=torch.long) if args["num_classes"] else
             torch.randn(1, args["text_len"], 16) if cls is DiT and args.get("text_dim") else
             torch.randn(1, 16) if args.get("text_dim") else None)
        real = count_flops(
            lambda: net(torch.randn(1, args["in_channels"], n, n), torch.full((1,), 0.5), y))
        assert forward_flops(cls, args) == real > 0


def test_the_default_router_is_the_largest_within_five_percent_of_an_expert():
    """Checked against every registry router counted on real networks: DiT-M/4 experts
    on 28 px get the costliest router at most 5 % of one expert's forward with 4+
    tokens; a DiT-N/4 expert on 8 px, which no router undercuts that far, the cheapest one."""
    from model import (DiT, MIN_ROUTER_TOKENS, ROUTER_SHARE, DiT_models, forward_flops,
                       model_args_for, router_for)
    for expert, side in (("DiT-M/4", 28), ("DiT-T/2", 8), ("DiT-N/4", 8)):
        expert_flops = forward_flops(DiT, model_args_for(
            expert, input_size=side, in_channels=1, num_classes=10))
        every = {}
        for name, (depth, width, heads, patch) in DiT_models.items():
            if side % patch or (side // patch) ** 2 < MIN_ROUTER_TOKENS or width > 128:
                continue
            router = Router(**model_args_for(name, input_size=side,
                                             in_channels=1, num_classes=10, num_experts=4))
            every[name] = count_flops(
                lambda: router(torch.zeros(1, 1, side, side), torch.rand(1),
                               torch.zeros(1, dtype=torch.long)))
        within = {n: f for n, f in every.items() if f <= ROUTER_SHARE * expert_flops}
        expected = max(within, key=within.get) if within else min(every, key=every.get)
        name, flops = router_for(expert_flops, side, 1, num_classes=10, num_experts=4)
        assert (name, flops) == (expected, every[expected])
    assert router_for(forward_flops(DiT, model_args_for(
        "DiT-M/4", input_size=28, in_channels=1, num_classes=10)),
                      28, 1, num_classes=10, num_experts=4)[0] == "DiT-N/7"
    assert expected == "DiT-N/4" and every["DiT-N/4"] > ROUTER_SHARE * expert_flops


def test_a_cluster_conditioned_dit_adds_the_clusters_embedding_to_the_class():
    """With the cluster embedding zeroed it is the class DiT; each cluster row shifts c as
    a label does."""
    torch.manual_seed(0)
    args = dict(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=1,
                num_heads=2, num_classes=10,
                learn_sigma=False)
    plain, told = DiT(**args), DiT(**args, cluster_classes=4)
    # 4 clusters and the null
    assert told.cluster_embedder.embedding_table.weight.shape == (5, 32)
    told.load_state_dict({**plain.state_dict(),
                          "cluster_embedder.embedding_table.weight": torch.zeros(5, 32)})
    # a zero output layer says nothing
    for module in (plain.final_layer.linear, told.final_layer.linear):
        torch.nn.init.normal_(module.weight, std=0.1)
    told.final_layer.linear.load_state_dict(plain.final_layer.linear.state_dict())
    x, t, y = torch.randn(3, 1, 8, 8), torch.rand(3), torch.tensor([1, 2, 10])
    torch.testing.assert_close(told(x, t, torch.stack([y, torch.tensor([0, 3, 4])], 1)),
                               plain(x, t, y))
    torch.nn.init.normal_(told.cluster_embedder.embedding_table.weight)
    a, b = (told(x, t, torch.stack([y, torch.full((3,), c)], 1)) for c in (0, 1))
    assert (a - b).abs().amax() > 1e-4


def test_pos_embed_matches_dits_formula():
    """DiT builds its table with np.meshgrid(w, h): the first half of each row encodes the
    column."""
    D, grid = 8, 3
    table = sincos_pos_embed(D, grid)
    omega = 1 / 10000 ** (np.arange(2) / 2)
    for row in range(grid):
        for col in range(grid):
            expected = np.concatenate([np.sin(col * omega), np.cos(col * omega),
                                       np.sin(row * omega), np.cos(row * omega)])
            np.testing.assert_allclose(table[row * grid + col], expected)


@pytest.mark.parametrize("modulation", ["adaln-single", "adaln-zero"])
def test_text_dit_names_shapes_and_null_caption(modulation):
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)
    m = DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2,
            num_heads=4, num_classes=0,
            learn_sigma=False, modulation=modulation, text_dim=16, text_len=5)
    keys = set(m.state_dict())
    assert {"blocks.1.cross_attn.q_linear.weight", "blocks.1.cross_attn.kv_linear.weight",
            "blocks.1.cross_attn.proj.weight",
            "y_embedder.y_proj.fc1.weight", "y_embedder.y_proj.fc2.weight",
            "y_embedder.y_embedding"} <= keys
    assert m.state_dict()["blocks.0.cross_attn.kv_linear.weight"].shape == (64, 32)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x, t = torch.randn(3, 1, 8, 8), torch.rand(3)
    caption = torch.randn(3, 5, 16)
    null = torch.zeros(3, 5, 16)
    with torch.no_grad():
        out = m(x, t, caption)
        assert out.shape == (3, 1, 8, 8)
        # an all-zero caption is the learned null caption
        torch.testing.assert_close(m(x, t, null),
                                   m(x, t, m.y_embedder.y_embedding[None].expand(3, -1, -1)))
        assert not torch.allclose(m(x, t, null), out)
        # the caption matters per sample: changing sample 0's caption changes only sample 0
        changed = caption.clone(); changed[0] += 1
        diff = (m(x, t, changed) - out).flatten(1).abs().amax(1)
        assert diff[0] > 1e-4 and diff[1:].max() == 0
    assert (infer_dit_args(m.state_dict())["text_dim"] == 16
            and infer_dit_args(m.state_dict())["text_len"] == 5)


def test_text_router_uses_the_pooled_embedding():
    torch.set_default_dtype(torch.float32)
    r = Router(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=1,
               num_heads=2, num_experts=3, text_dim=16)
    torch.nn.init.normal_(r.head.weight)
    x, t = torch.randn(2, 1, 8, 8), torch.rand(2)
    assert not torch.allclose(r(x, t, torch.randn(2, 16)), r(x, t, torch.zeros(2, 16)))
