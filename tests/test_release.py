"""Releases (export.py, release.py) and diffusers' layout (diffusers_format.py): a
release samples exactly as its run, loads in diffusers with no missing key and computes
what our network computes, and a damaged release is one line with nothing written."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import distill
import eval as evaluate
import export
import sample
import import_dit
import train_expert
import train_router
from plumbing.checkpoint import load
from plumbing.release.diffusers_format import to_diffusers, use_dit_time_embedding
from helpers import cli, run_stage
from model import DiT
from plumbing.release.layout import network_files, write_network
from plumbing.release.reader import read_network

TINY = ["--model", "DiT-M/2", "--steps", "5", "--batch-size", "16"]


def read_index(folder):
    """(model_index.json as written: diffusers' pipeline index, this project's index under
    "_ddm")"""
    return json.loads((folder / "model_index.json").read_text())


def write_index(folder, doc, index):
    (folder / "model_index.json").write_text(json.dumps({**doc, "_ddm": index}))


def draw(run_dir, out, *flags):
    run_stage(sample, ["--run-dir", str(run_dir), "--n", "12", "--steps", "4",
                       "--out", str(out), *flags])
    return np.load(out)["arr_0"]


@pytest.fixture(scope="module")
def release(tiny_ensemble, tmp_path_factory):
    out = tmp_path_factory.mktemp("release") / "digits-k4"
    run_stage(export, ["--run-dir", str(tiny_ensemble), "--out", str(out)])
    return out


@pytest.mark.parametrize("flags", [["--routing", "top1"], ["--routing", "full"],
                                   ["--routing", "top1", "--cfg-scale", "2"]])
def test_a_release_samples_bit_exactly_as_its_run(tiny_ensemble, release, tmp_path, flags):
    ours = draw(tiny_ensemble, tmp_path / "run.npz", *flags)
    theirs = draw(release, tmp_path / "release.npz", *flags)
    assert np.array_equal(ours, theirs)
    record = json.loads((tmp_path / "release.json").read_text())
    assert record["weights"] == json.loads((tmp_path / "run.json").read_text())["weights"]


def test_a_release_is_safetensors_and_json_with_a_self_describing_index(tiny_ensemble, release):
    files = sorted(os.path.relpath(os.path.join(root, f), release)
                   for root, _, fs in os.walk(release) for f in fs)
    # weights and records; the only code is the diffusers pipeline's, which this project
    # never runs
    assert all(f.endswith((".json", ".safetensors", "README.md")) or os.path.basename(f) in (
        "pipeline_ddm.py", "model.py", "diffusion.py", "routing.py", "reader.py",
        "diffusers_format.py", "hub_components.py") for f in files), files
    index = read_index(release)["_ddm"]
    # the heterogeneous ensemble keeps each expert's objective, and says how each reads time
    assert {e["name"]: e["objective"]["name"] for e in index["experts"]} == {
        "0": "fm", "1": "ddpm", "2": "fm", "3": "ddpm"}
    assert "DDPM" in index["experts"][1]["time"] and "1000 * t" in index["experts"][0]["time"]
    assert (index["router"]["experts"] == ["0", "1", "2", "3"]
            and index["data"]["name"] == "digits")
    ckpt = torch.load(tiny_ensemble / "experts" / "1" / "ckpt.pt", weights_only=True)
    released = read_network(release / "experts" / "1")
    # the EMA weights exactly, and no optimizer state
    assert released["ema"].keys() == ckpt["ema"].keys() and "opt" not in released
    assert all(torch.equal(released["ema"][k], ckpt["ema"][k]) for k in ckpt["ema"])
    experts_flops = sum(e["flops"] for e in index["experts"])
    assert index["training_flops"]["total"] == experts_flops + index["router"]["flops"]
    assert "digits-k4" in (release / "README.md").read_text()


def test_eval_and_distill_read_a_release_as_a_run_folder(release, tmp_path):
    run = tmp_path / "release"
    shutil.copytree(release, run)   # eval caches its classifier in the folder it is given
    draw(run, tmp_path / "b.npz")
    code, err = cli(evaluate, [tmp_path / "b.npz", "--run-dir", run, "--classifier-steps", "20"])
    assert code == 0, err   # the data set is the index's: a release has no cluster file
    assert json.loads((tmp_path / "b.eval.json").read_text())["fd_classifier"] > 0
    code, err = cli(distill, ["--run-dir", run, "--steps", "2", "--batch-size", "8",
                              "--model", "DiT-M/2",
                              "--out-dir", tmp_path / "student"])
    assert code == 0, err
    assert torch.load(tmp_path / "student" / "ckpt.pt", weights_only=True)["config"]["k"] == 4


def random_dit(**kwargs):
    torch.manual_seed(0)
    net = DiT(input_size=8, patch_size=2, hidden_size=64, depth=2, num_heads=4,
              learn_sigma=False, t_scale=1000.0,
              **kwargs)
    # every parameter, the zero-initialised ones too, so every key is exercised
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.2)
    return net.eval()


def args_of(net, **kwargs):
    return dict(input_size=8, patch_size=2, hidden_size=64, depth=2, num_heads=4,
                learn_sigma=False, t_scale=1000.0,
                **kwargs)


def test_dit_and_pixart_experts_load_in_diffusers_with_no_missing_key_and_compute_ours(tmp_path):
    diffusers = pytest.importorskip("diffusers",
                                    reason="diffusers (requirements-latent.txt) is not installed")
    x, t = torch.randn(5, 3, 8, 8), torch.rand(5)
    config = {"network": "dit", "format": 2, "objective": {"name": "fm"},
              "condition": {"kind": "class", "num_classes": 10}}
    # adaLN-Zero, class labels (the null class included): DiTTransformer2DModel
    a = dict(in_channels=3, num_classes=10, modulation="adaln-zero")
    ours = random_dit(**a)
    write_network(tmp_path / "dit", network_files(ours.state_dict(),
                                                  args_of(ours, **a), config, None, diffusers=True))
    theirs, info = diffusers.DiTTransformer2DModel.from_pretrained(
        tmp_path / "dit", output_loading_info=True)
    assert (not info["missing_keys"] and not info["unexpected_keys"] and
            not info["mismatched_keys"])
    y = torch.tensor([0, 3, 9, 10, 2])
    with torch.no_grad():
        want = ours(x, t, y)
        # diffusers' DiT embeds time at other frequencies (downscale_freq_shift 1): no
        # weight can fix that
        assert (theirs.eval()(x, 1000 * t, y).sample - want).abs().max() > 1e-2
        torch.testing.assert_close(use_dit_time_embedding(theirs)(x, 1000 * t, y).sample,
                                   want, atol=1e-5, rtol=0)
        torch.testing.assert_close(load(read_network(tmp_path / "dit")).net(x, t, y),
                                   want, atol=0, rtol=0)
    # AdaLN-Single, caption cross-attention: PixArtTransformer2DModel, the null caption
    # passed as its input
    a = dict(in_channels=4, num_classes=0, text_dim=24, text_len=7, modulation="adaln-single")
    ours, x = random_dit(**a), torch.randn(5, 4, 8, 8)
    write_network(tmp_path / "pixart", network_files(ours.state_dict(), args_of(
        ours, **a), config, None, diffusers=True))
    theirs, info = diffusers.PixArtTransformer2DModel.from_pretrained(
        tmp_path / "pixart", output_loading_info=True)
    assert (not info["missing_keys"] and not info["unexpected_keys"] and
            not info["mismatched_keys"])
    caption = torch.randn(5, 7, 24)
    caption[1] = 0   # "no caption"
    null = read_network(tmp_path / "pixart")["ema"]["y_embedder.y_embedding"]
    with torch.no_grad():
        want = ours(x, t, caption)
        given = torch.where((caption == 0).flatten(1).all(1)[:, None, None], null[None], caption)
        got = theirs.eval()(x, encoder_hidden_states=given, timestep=1000 * t,
                            added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_no_counterpart_in_diffusers_is_refused_naming_the_part(tiny_ensemble, tmp_path):
    from plumbing.release.diffusers_format import DiffusersFormatError
    for a, part in [(dict(num_classes=10, modulation="adaln-single"),
                     "class-conditional AdaLN-Single"),
                    (dict(num_classes=0, modulation="adaln-zero"), "conditioned on nothing")]:
        net = random_dit(in_channels=1, **a)
        with pytest.raises(DiffusersFormatError, match=part):
            to_diffusers(net.state_dict(), args_of(net, in_channels=1, **a))
    code, err = cli(export, ["--run-dir", tiny_ensemble, "--out", tmp_path / "r", "--diffusers"])
    assert (code == 2 and "has no diffusers counterpart" in err
            and len(err.strip().splitlines()) == 1)
    assert not (tmp_path / "r").exists() and not list(tmp_path.iterdir())


def test_a_diffusers_layout_release_samples_as_its_run_and_a_diffusers_dit_imports(
        digits_run, tmp_path):
    diffusers = pytest.importorskip("diffusers",
                                    reason="diffusers (requirements-latent.txt) is not installed")
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(digits_run / "clusters.pt", run / "clusters.pt")
    for k in range(4):
        run_stage(train_expert, ["--cluster", str(k), "--modulation", "adaln-zero", *TINY,
                                 "--run-dir", str(run)])
    run_stage(train_router, ["--steps", "5", "--run-dir", str(run)])
    run_stage(export, ["--run-dir", str(run), "--out", str(tmp_path / "rel"), "--diffusers"])
    config = json.loads((tmp_path / "rel" / "experts" / "0" / "config.json").read_text())
    assert config["_class_name"] == "DiTTransformer2DModel"
    flags = ["--routing", "full", "--cfg-scale", "2"]
    assert np.array_equal(draw(run, tmp_path / "a.npz", *flags),
                          draw(tmp_path / "rel", tmp_path / "b.npz", *flags))
    # the reverse: a plain diffusers DiT folder (no record of ours) is an official-style
    # DDPM expert
    torch.manual_seed(1)
    theirs = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=1, num_layers=1, sample_size=8,
        patch_size=4, num_embeds_ada_norm=10, norm_eps=1e-6).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.2)
    theirs.save_pretrained(tmp_path / "hub-dit")
    run_stage(import_dit, [str(tmp_path / "hub-dit"), "--cluster", "all", "--run-dir", str(run)])
    imported = load(str(run / "experts" / "all" / "ckpt.pt"))
    assert imported.objective.name == "ddpm"
    x, s, y = torch.randn(3, 1, 8, 8), torch.tensor([0.0, 400.0, 999.0]), torch.tensor(
        [1, 10, 7])
    with torch.no_grad():
        torch.testing.assert_close(imported.net(x, s, y), use_dit_time_embedding(theirs)(
            x, s, y).sample, atol=1e-5, rtol=0)
    run_stage(train_expert, ["--init", str(tmp_path / "hub-dit"), "--objective", "fm",
                             "--modulation", "adaln-zero",
                             "--cluster", "0", "--steps", "1", "--batch-size", "8",
                             "--out-dir", str(tmp_path / "fm"),
                             "--run-dir", str(run)])
    assert torch.load(tmp_path / "fm" / "ckpt.pt",
                      weights_only=True)["config"]["init"].startswith("convert_ddpm_to_fm")


def damage(release, tmp_path, how):
    bad = tmp_path / how
    shutil.copytree(release, bad)
    doc = read_index(bad)
    index = doc["_ddm"]
    if how == "missing-expert":
        shutil.rmtree(bad / "experts" / "2")
    elif how == "expert-twice":
        index["experts"].append(index["experts"][0])
    elif how == "truncated":
        weights = bad / "experts" / "1" / "diffusion_pytorch_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "shapes":
        config = json.loads((bad / "experts" / "3" / "config.json").read_text())
        config["_ddm"]["model_args"]["hidden_size"] *= 2
        (bad / "experts" / "3" / "config.json").write_text(json.dumps(config))
    elif how == "newer-network":
        config = json.loads((bad / "experts" / "0" / "config.json").read_text())
        config["_ddm"]["format"] = 99
        (bad / "experts" / "0" / "config.json").write_text(json.dumps(config))
    elif how == "newer-index":
        index["_ddm_release_format"] = 99
    write_index(bad, doc, index)
    return bad


@pytest.mark.parametrize("how, says", [
    ("missing-expert", "lists expert 2 at experts/2, which is missing"),
    ("expert-twice", "names expert 0 twice"),
    ("truncated", "is not a complete safetensors file"),
    ("shapes", "the weights disagree with config.json"),
    ("newer-network", "release format 99; this version reads 2"),
    ("newer-index", "format 99; this version reads 2")])
def test_a_damaged_release_is_one_line_and_nothing_is_written(release, tmp_path, how, says):
    bad = damage(release, tmp_path, how)
    for stage, argv in [(sample, ["--run-dir", bad, "--n", "4", "--out", tmp_path / "x.npz"]),
                        (export, ["--run-dir", bad, "--out", tmp_path / "again"])]:
        code, err = cli(stage, argv)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x.npz").exists() and not (tmp_path / "again").exists()


def test_a_contributor_joins_a_release_and_the_grown_index_says_where_each_expert_came_from(
        release, tmp_path):
    grown = tmp_path / "grown"
    shutil.copytree(release, grown)
    run_stage(train_expert, ["--contribution", "eights", "--data", "digits",
                             "--classes", "8", *TINY, "--run-dir", str(grown)])
    run_stage(train_router, ["--from-samples", "8", "--sample-steps", "2", "--steps", "5",
                             "--run-dir", str(grown)])
    run_stage(export, ["--run-dir", str(grown), "--out", str(tmp_path / "digits-k4-plus")])
    index = read_index(tmp_path / "digits-k4-plus")["_ddm"]
    sources = {e["name"]: e["source"] for e in index["experts"]}
    assert (sources["0"]["releases"] == ["digits-k4", "digits-k4-plus"]
            and sources["0"]["trained_in"] != "grown")
    assert sources["eights"] == {"trained_in": "grown", "steps": 5,
                                 "releases": ["digits-k4-plus"]}
    assert index["router"]["experts"] == ["0", "1", "2", "3", "eights"]
    draw(tmp_path / "digits-k4-plus", tmp_path / "grown.npz", "--routing", "top2")


def test_a_release_card_states_what_sampling_costs(tiny_ensemble, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_ensemble, run)
    batch = run / "samples" / "top1.npz"
    run_stage(sample, ["--run-dir", str(run), "--n", "8", "--steps", "3",
                       "--routing", "top1", "--out", str(batch)])
    run_stage(evaluate, [str(batch), "--run-dir", str(run), "--classifier-steps", "20"])
    run_stage(export, ["--run-dir", str(run), "--out", str(tmp_path / "rel"),
                       "--routing", "top1"])
    record = json.loads((run / "samples" / "top1.json").read_text())
    assert f"{record['cost_vs_one_expert']:.2f}x one expert" in (
        tmp_path / "rel" / "README.md").read_text()


def test_a_release_cards_commands_paste_into_a_shell_whatever_the_batchs_name(
        tiny_ensemble, tmp_path):
    """The card's command for each measured batch is quoted for the shell: a batch named
    with a space and a $(...) splits back into exactly the words that drew it."""
    import re
    import shlex
    run = tmp_path / "run"
    shutil.copytree(tiny_ensemble, run)
    name = "top 1 $(touch injected).npz"
    run_stage(sample, ["--run-dir", str(run), "--n", "8", "--steps", "3",
                       "--routing", "top1", "--out", str(run / "samples" / name)])
    run_stage(evaluate, [str(run / "samples" / name), "--run-dir", str(run),
                         "--classifier-steps", "20"])
    run_stage(export, ["--run-dir", str(run), "--out", str(tmp_path / "rel")])
    card = (tmp_path / "rel" / "README.md").read_text()
    command = next(c for c in re.findall(r"`([^`]*)`", card) if c.startswith("python sample.py"))
    drawn, measured = command.split("; ")
    assert shlex.split(drawn)[-2:] == ["--out", name]
    assert shlex.split(measured) == ["python", "eval.py", name]


@pytest.mark.parametrize("damage", ["a list", "an entry without folder", "experts as a dict",
                                    "a folder elsewhere", "no expert"])
def test_a_damaged_index_is_refused_in_one_line(release, tmp_path, damage):
    rel = tmp_path / "rel"
    shutil.copytree(release, rel)
    doc = read_index(rel)
    index = doc["_ddm"]
    if damage == "a list":
        index = []
    elif damage == "an entry without folder":
        del index["experts"][0]["folder"]
    elif damage == "experts as a dict":
        index["experts"] = {"0": 1}
    elif damage == "a folder elsewhere":
        index["experts"][0]["folder"] = str(tmp_path)
    else:
        index["experts"] = []
    write_index(rel, doc, index)
    code, err = cli(sample, ["--run-dir", str(rel), "--n", "2", "--steps", "1",
                             "--out", str(tmp_path / "o.npz")])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "model_index.json" in err, err
    assert not (tmp_path / "o.npz").exists()


def test_a_release_holds_the_experts_its_index_lists_and_no_training_writes_over_them(
        tiny_ensemble, release, tmp_path):
    rel = tmp_path / "rel"
    shutil.copytree(release, rel)
    doc = read_index(rel)
    # its folder stays
    index = {**doc["_ddm"], "experts": [e for e in doc["_ddm"]["experts"] if e["name"] != "1"]}
    write_index(rel, doc, index)
    run_stage(sample, ["--run-dir", str(rel), "--n", "4", "--steps", "1",
                       "--out", str(tmp_path / "o.npz")])
    assert json.loads((tmp_path / "o.json").read_text())["experts"] == ["0", "2", "3"]
    code, err = cli(sample, ["--run-dir", str(rel), "--experts", "1", "--n", "2", "--steps", "1",
                             "--out", str(tmp_path / "one.npz")])
    assert code == 2 and "lists 0, 2, 3" in err
    before = sorted(os.listdir(rel / "experts" / "0"))
    code, err = cli(train_expert, ["--cluster", "0", "--steps", "2", "--model", "DiT-M/2",
                                   "--run-dir",
                                   str(tiny_ensemble), "--out-dir", str(rel / "experts" / "0")])
    assert (code == 2 and "holds a released network" in err
            and sorted(os.listdir(rel / "experts" / "0")) == before)


def test_a_student_resumes_only_with_the_teacher_it_learnt_from(tiny_ensemble, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_ensemble, run)
    student = ["--run-dir", str(run), "--batch-size", "8", "--model", "DiT-M/2",
               "--out-dir", str(tmp_path / "s")]
    run_stage(distill, [*student, "--steps", "2"])
    # the router retrained
    run_stage(train_router, ["--steps", "3", "--seed", "7", "--run-dir", str(run)])
    code, err = cli(distill, [*student, "--steps", "4"])
    assert code == 2 and "another teacher" in err and len(err.strip().splitlines()) == 1


def test_what_a_killed_export_left_is_removed_by_the_next(tiny_ensemble, tmp_path):
    # this host's, above Linux's largest pid: its writer is dead
    from plumbing.run_dir import writer
    left = tmp_path / f"rel.partial-{writer().rpartition('-')[0]}-4000000"
    theirs = tmp_path / "rel.partial-another-host-4000000"   # a writer elsewhere
    (theirs / "experts").mkdir(parents=True)
    (left / "experts" / "0").mkdir(parents=True)
    (left / "experts" / "0" / "config.json").write_text("{")
    run_stage(export, ["--run-dir", str(tiny_ensemble), "--out", str(tmp_path / "rel")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rel", theirs.name]


@pytest.mark.parametrize("change, says", [
    ({"sample_size": 200000}, "sample_size is 200000"), ({"patch_size": 0}, "patch_size is 0"),
    ({"sample_size": "8"}, "sample_size is '8'"), ({"patch_size": 3}, "does not divide")])
def test_a_diffusers_config_is_checked_before_anything_is_allocated_from_it(change, says):
    from plumbing.release.diffusers_format import DiffusersFormatError, model_args_of
    config = {"_class_name": "DiTTransformer2DModel", "sample_size": 8, "patch_size": 2,
              "in_channels": 1,
              "num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 1,
              "num_embeds_ada_norm": 10}
    assert model_args_of(config, None)["input_size"] == 8
    with pytest.raises(DiffusersFormatError, match=says):
        model_args_of({**config, **change}, None)


def test_a_stray_block_key_never_sizes_a_network(tiny_ensemble):
    from plumbing.checkpoint import CheckpointError, infer_dit_args
    state = dict(torch.load(tiny_ensemble / "experts" / "0" / "ckpt.pt",
                            weights_only=True)["ema"])
    assert infer_dit_args(state)["depth"] == 2
    state["blocks.999999999.attn.qkv.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="numbered up to 999999999 but 3 are present"):
        infer_dit_args(state)


def test_a_network_record_missing_a_part_is_one_line(release, tmp_path):
    rel = tmp_path / "rel"
    shutil.copytree(release, rel)
    config = json.loads((rel / "experts" / "0" / "config.json").read_text())
    del config["_ddm"]["config"]
    (rel / "experts" / "0" / "config.json").write_text(json.dumps(config))
    code, err = cli(sample, ["--run-dir", str(rel), "--n", "2", "--steps", "1",
                             "--out", str(tmp_path / "o.npz")])
    assert (code == 2 and "_ddm record has no config" in err
            and len(err.strip().splitlines()) == 1), err


@pytest.mark.parametrize("network, change",
                         [("router", {"downsample": 0}), ("router", {"depth": "two"}),
                          ("experts/0", {"patch_size": 3}), ("experts/0", {"size": 9})])
def test_model_args_that_build_no_network_are_one_line(release, tmp_path, network, change):
    rel = tmp_path / "rel"
    shutil.copytree(release, rel)
    path = rel / network / "config.json"
    config = json.loads(path.read_text())
    config["_ddm"]["model_args"].update(change)
    path.write_text(json.dumps(config))
    code, err = cli(sample, ["--run-dir", str(rel), "--n", "2", "--steps", "1",
                             "--out", str(tmp_path / "o.npz")])
    assert code == 2 and "model_args" in err and len(err.strip().splitlines()) == 1, err
