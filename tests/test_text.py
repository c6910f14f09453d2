"""The text-to-image path: offline text tower, captioned data, text experts, router,
prompts, CLIP score."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import cluster
import eval as evaluate
import export
import sample
import train_expert
import train_router
from plumbing.command_line import UsageError
from plumbing.data.datasets import load_dataset
from plumbing.data.encoders import TextEncoder, caption_embeddings
from helpers import (TINY_CLIP, cli, fake_folder, run_in_diffusers, run_script, run_stage,
                     sample_py_images, tiny_clip)


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory):
    return tiny_clip(tmp_path_factory.mktemp("clip"))


def test_text_tower_offline_from_a_local_file(clip_files):
    config, weights = clip_files
    encoder = TextEncoder(config, weights)
    tokens, pooled = encoder(["the digit 3", "the digit 8", "the digit 3"])
    assert (tokens.shape == (3, 77, TINY_CLIP["text_cfg"]["width"])
            and pooled.shape == (3, TINY_CLIP["embed_dim"]))
    torch.testing.assert_close(pooled.norm(dim=1), torch.ones(3))
    assert torch.equal(tokens[0], tokens[2]) and not torch.allclose(tokens[0], tokens[1])
    assert encoder.spec["clip_pretrained"].startswith("tiny-clip.pt")
    random_tower = TextEncoder(config, "none")
    assert random_tower.spec["clip_pretrained"] == "none (random)"


def test_caption_cache_encodes_each_distinct_caption_once(clip_files, tmp_path):
    config, weights = clip_files
    captions = load_dataset("digits-captions").captions
    tokens, pooled, index, spec = caption_embeddings(captions, str(tmp_path),
                                                     clip_model=config, clip_pretrained=weights)
    assert len(tokens) == len(set(captions)) == 40 and index.shape == (1797,)
    again = caption_embeddings(captions, str(tmp_path), clip_model=config,
                               clip_pretrained=weights)
    assert torch.equal(again[0], tokens) and len(list((tmp_path / "text").iterdir())) == 1
    # a later stage that knows the encoder only by the spec an earlier stage recorded
    # needs no weights for cached captions
    some = captions[:5]
    cached = caption_embeddings(some, str(tmp_path), encoder=spec)
    torch.testing.assert_close(cached[0][cached[2]], tokens[index[:5]])
    with pytest.raises(UsageError, match="needs a text encoder"):
        caption_embeddings(["a caption never seen"], str(tmp_path), encoder=spec)
    with pytest.raises(UsageError, match="needs a text encoder"):
        caption_embeddings(captions, str(tmp_path / "elsewhere"), clip_model=config)


@pytest.mark.parametrize("damage", ["not a checkpoint", "no captions", "rows cut short"])
def test_a_damaged_caption_cache_is_encoded_again_and_replaced(clip_files, tmp_path, damage):
    """A cache: before, the first two stopped every stage that read RUN_DIR/text/, and rows
    cut short failed inside the lookup."""
    config, weights = clip_files
    captions = load_dataset("digits-captions").captions
    tokens = caption_embeddings(captions, str(tmp_path), clip_model=config,
                                clip_pretrained=weights)[0]
    (path,) = (tmp_path / "text").iterdir()
    cache = torch.load(path, weights_only=True)
    if damage == "not a checkpoint":
        path.write_bytes(b"not a checkpoint")
    else:
        if damage == "no captions":
            del cache["captions"]
        else:
            cache["tokens"] = cache["tokens"][:3]
        torch.save(cache, path)
    again = caption_embeddings(captions, str(tmp_path), clip_model=config,
                               clip_pretrained=weights)[0]
    assert torch.equal(again, tokens)
    assert torch.equal(torch.load(path, weights_only=True)["tokens"], tokens)


def test_captioned_data_sets(tmp_path):
    d = load_dataset("digits-captions")
    assert d.captions[7] == "the number 7, handwritten" and d.captions[0] == "a handwritten zero"
    assert d.fingerprint != load_dataset("digits").fingerprint
    root = fake_folder(tmp_path / "f", per_class=2)
    for c in ("cat", "dog"):
        (root / c / "0.txt").write_text(f"a photo of a {c}")
    with open(root / "captions.jsonl", "w") as f:
        for c in ("cat", "dog"):
            f.write(json.dumps({"file": f"{c}/1.png", "text": f"another {c}"}) + "\n")
    d = load_dataset(f"folder:{root}", image_size=16)
    assert sorted(d.captions) == ["a photo of a cat", "a photo of a dog", "another cat",
                                  "another dog"]
    (root / "cat" / "0.txt").write_bytes("un caf\u00e9".encode("latin-1"))   # not UTF-8
    with pytest.raises(UsageError, match="is not UTF-8 text"):
        load_dataset(f"folder:{root}", image_size=16)
    (root / "cat" / "0.txt").write_text("a photo of a cat")
    (root / "captions.jsonl").write_bytes(b'{"file": "cat/1.png", "text": "caf\xe9"}\n')
    with pytest.raises(UsageError, match="captions.jsonl is not UTF-8 text"):
        load_dataset(f"folder:{root}", image_size=16)
    os.remove(root / "captions.jsonl")
    os.remove(root / "dog" / "0.txt")
    with pytest.raises(UsageError, match="have no caption"):
        load_dataset(f"folder:{root}", image_size=16)


@pytest.fixture(scope="module")
def text_run(tmp_path_factory, clip_files):
    """Captioned digits, K=2: a flow and a DDPM text expert, a caption-aware router, tiny
    budgets."""
    config, weights = clip_files
    run = tmp_path_factory.mktemp("text-run")
    clip = ["--clip-model", config, "--clip-pretrained", weights]
    run_stage(cluster, ["--data", "digits-captions", "--k", "2", "--run-dir", str(run)])
    for k, objective in (("0", "fm"), ("1", "ddpm")):
        run_stage(train_expert, ["--cluster", k, "--objective", objective,
                                 "--condition", "text", "--steps", "20",
                                 "--model", "DiT-M/2", "--batch-size", "16",
                                 "--run-dir", str(run), *clip])
    run_stage(train_router, ["--condition", "text", "--steps", "20",
                             "--run-dir", str(run), *clip])
    return run, clip


def test_end_to_end_text_run_writes_npz_and_per_prompt_grids(text_run):
    run, clip = text_run
    ckpt = torch.load(run / "experts" / "0" / "ckpt.pt", weights_only=True)
    assert (ckpt["config"]["condition"]["kind"] == "text"
            and ckpt["config"]["condition"]["encoder"]["clip_model"] == "tiny-clip.json")
    assert "blocks.0.cross_attn.kv_linear.weight" in ckpt["model"]
    with open(run / "experts" / "0" / "log.jsonl") as f:
        assert json.loads(f.readline())["condition"] == ckpt["config"]["condition"]
    out = run / "samples" / "prompts.npz"
    run_stage(sample, ["--run-dir", str(run), "--prompt", "the digit 3",
                       "--prompt", "a handwritten eight", "--n", "6",
                       "--steps", "4", "--cfg-scale", "2", "--routing", "full",
                       "--out", str(out), *clip])
    batch = np.load(out)
    # labels from the captions
    assert batch["arr_0"].shape == (6, 8, 8, 1) and list(batch["arr_1"]) == [3, 8, 3, 8, 3, 8]
    assert (os.path.isfile(run / "samples" / "prompts.prompt0.png")
            and os.path.isfile(run / "samples" / "prompts.prompt1.png"))
    usage = json.load(open(run / "samples" / "prompts.json"))
    assert (usage["prompts"] == ["the digit 3", "a handwritten eight"]
            and usage["prompt_index"] == [0, 1, 0, 1, 0, 1])
    # CLIP score and intra-prompt diversity, with the (random, local) CLIP as the scorer
    config, weights = clip[1], clip[3]
    run_stage(evaluate, [str(out), "--run-dir", str(run), "--clip-model", config,
                         "--clip-pretrained", weights, "--max-real", "50"])
    result = json.load(open(run / "samples" / "prompts.eval.json"))
    assert 0 <= result["clip_score"] <= 100 and np.isfinite(result["diversity"])


def test_text_bad_inputs(text_run, tmp_path):
    run, clip = text_run
    (tmp_path / "empty.txt").write_text("\n\n")
    other_config = tmp_path / "other.json"
    other_config.write_text(json.dumps(TINY_CLIP))
    cases = [(["--prompts", tmp_path / "empty.txt", *clip], "holds no prompt"),
             (["--prompts", tmp_path / "none.txt", *clip], "no prompt file"),
             ([*clip], "give --prompt TEXT"),
             (["--prompt", "a seven", "--clip-model", other_config,
               "--clip-pretrained", "none"], "were trained with")]
    for argv, message in cases:
        code, _, err = run_script("sample.py", "--run-dir", run, "--n", "2",
                                  "--steps", "2", *argv)
        assert code == 2 and message in err and "Traceback" not in err, (argv, err[-1500:])
    # an expert trained with another text encoder cannot join the ensemble
    import shutil
    mixed = tmp_path / "mixed"
    shutil.copytree(run, mixed)
    ckpt = torch.load(mixed / "experts" / "1" / "ckpt.pt", weights_only=True)
    ckpt["config"]["condition"]["encoder"] = {
        "clip_model": "ViT-L-14", "clip_pretrained": "openai"}
    torch.save(ckpt, mixed / "experts" / "1" / "ckpt.pt")
    code, _, err = run_script("sample.py", "--run-dir", mixed, "--prompt", "a seven",
                              "--n", "2", "--steps", "2", *clip)
    assert code == 2 and "expert 1 does not match expert 0: condition" in err
    # captions are required for text experts
    code, _, err = run_script("train_expert.py", "--run-dir", run, "--data", "digits",
                              "--condition", "text", "--steps", "2", *clip)
    assert code == 2 and "another data set" in err
    plain = tmp_path / "plain"
    run_stage(cluster, ["--run-dir", str(plain)])
    code, _, err = run_script("train_expert.py", "--run-dir", plain,
                              "--condition", "text", "--steps", "2", *clip)
    assert code == 2 and "needs captions" in err


def test_conditioning_on_the_prompt_matters(tmp_path, clip_files):
    """A briefly trained text model gives the requested digit far more often for its own
    prompt than for another."""
    config, weights = clip_files
    clip = ["--clip-model", config, "--clip-pretrained", weights]
    run_stage(cluster, ["--data", "digits-captions", "--k", "2", "--run-dir", str(tmp_path)])
    run_stage(train_expert, ["--cluster", "all", "--condition", "text", "--steps", "1200",
                             "--model", "DiT-M/2", "--lr", "2e-3",
                             "--run-dir", str(tmp_path), "--log-every", "400", *clip])
    accuracy = {}
    for prompt in ("the digit 3", "the digit 8"):
        out = tmp_path / f"{prompt[-1]}.npz"
        run_stage(sample, ["--run-dir", str(tmp_path), "--experts", "all",
                           "--prompt", prompt, "--n", "200", "--steps", "20",
                           "--cfg-scale", "5", "--out", str(out), *clip])
        run_stage(evaluate, [str(out), "--run-dir", str(tmp_path)])
        accuracy[prompt] = json.load(
            open(tmp_path / f"{prompt[-1]}.eval.json"))["conditional_accuracy"]
    # Each batch is scored against its own prompt's label (arr_1: 3, then 8). Were the prompt
    # ignored, both batches would come from one distribution, whose shares of threes and of
    # eights add up to at most 1 (up to the sampling noise of N = 200, about 0.05 each).
    assert accuracy["the digit 3"] + accuracy["the digit 8"] > 1.15, accuracy


def test_clustering_on_caption_and_image_embeddings(clip_files, tmp_path):
    config, weights = clip_files
    clip = ["--clip-model", config, "--clip-pretrained", weights]
    run_stage(cluster, ["--data", "digits-captions", "--features", "text", "--k", "4",
                        "--run-dir", str(tmp_path / "t"), *clip])
    c = torch.load(tmp_path / "t" / "clusters.pt", weights_only=True)
    captions = load_dataset("digits-captions").captions
    # captions are the only input: two images with the same caption always share a cluster
    by_caption = {}
    for caption, k in zip(captions, c["assignments"].tolist()):
        by_caption.setdefault(caption, set()).add(k)
    assert (all(len(ks) == 1 for ks in by_caption.values())
            and c["features"]["features"] == "text")
    run_stage(cluster, ["--data", "digits-captions", "--features", "clip+text",
                        "--k", "4", "--run-dir", str(tmp_path / "b"), *clip])
    assert torch.load(tmp_path / "b" / "clusters.pt",
                      weights_only=True)["centroids"].shape == (4, 2 * TINY_CLIP["embed_dim"])
    code, _, err = run_script("cluster.py", "--features", "text",
                              "--run-dir", tmp_path / "x", *clip)
    assert code == 2 and "needs captions" in err


def test_init_a_text_expert_from_a_class_conditional_ddpm_checkpoint(text_run, tmp_path):
    run, clip = text_run
    tiny = ["--model", "DiT-M/2", "--batch-size", "16", "--steps", "4", "--run-dir", str(run)]
    run_stage(train_expert, ["--cluster", "0", "--objective", "ddpm",
                             "--out-dir", str(tmp_path / "class"), *tiny])
    run_stage(train_expert, ["--cluster", "0", "--objective", "fm", "--condition", "text",
                             "--out-dir", str(tmp_path / "text"),
                             "--init", str(tmp_path / "class" / "ckpt.pt"), *tiny, *clip])
    ckpt = torch.load(tmp_path / "text" / "ckpt.pt", weights_only=True)
    assert (ckpt["config"]["init"] == "convert_ddpm_to_fm:ckpt.pt"
            and ckpt["model_args"]["num_classes"] == 0)
    assert (ckpt["model_args"]["text_dim"] == TINY_CLIP["text_cfg"]["width"]
            and "y_embedder.embedding_table.weight" not in ckpt["model"])


PROMPTS = ["the digit 3", "a handwritten eight", "the digit 3"]


def test_a_text_release_samples_prompts_in_diffusers_as_sample_py_does(text_run, tmp_path):
    """The experts' text tower ships as the `text_encoder` component (its open_clip config
    and text weights, checked at export to encode as the experts' encoder does); prompts,
    a negative prompt and guidance give sample.py's images to 1e-5."""
    run, clip = text_run
    config, weights = clip[1], clip[3]
    release = tmp_path / "release"
    code, err = cli(export, ["--run-dir", str(run), "--out", str(release)])
    assert code == 2 and "--clip-pretrained" in err and len(err.strip().splitlines()) == 1
    code, err = cli(export, ["--run-dir", str(run), "--out", str(release),
                             "--clip-model", config, "--clip-pretrained", "none"])
    assert code == 2 and "were trained with" in err and not release.exists(), err
    run_stage(export, ["--run-dir", str(run), "--out", str(release), *clip])
    index = json.loads((release / "model_index.json").read_text())
    assert index["text_encoder"] == ["hub_components", "TextTower"]
    noise = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(7))
    settings = {"top1-1": ("top1", 1.0, None), "full-2": ("full", 2.0, None),
                "full-2-negative": ("full", 2.0, "a blurry photo"),
                "top1-3-negative": ("top1", 3.0, "the digit 8")}
    cases = {name: {"release": release, "call": {
        "prompt": PROMPTS, "negative_prompt": negative, "latents": "@noise",
        "num_inference_steps": 4, "routing": rule, "guidance_scale": scale}}
        for name, (rule, scale, negative) in settings.items()}
    # the experts in diffusers' PixArt layout: the same reader maps them back
    pixart = tmp_path / "release-pixart"
    run_stage(export, ["--run-dir", str(run), "--out", str(pixart), "--diffusers", *clip])
    cases["pixart"] = {**cases["full-2-negative"], "release": pixart}
    images, errors = run_in_diffusers(tmp_path, cases, noise=noise)
    assert not errors, errors
    for name, (rule, scale, negative) in settings.items():
        ours = sample_py_images(release, noise, 4, prompts=PROMPTS, negative=negative,
                                clip=(config, weights), rule=rule, scale=scale)
        assert np.abs(images[name] - ours).max() < 1e-5, name
        if name == "full-2-negative":
            assert np.abs(images["pixart"] - ours).max() < 1e-5
    # sample.py reads a text release's own tower when no weights file is given: the same
    # images as with the experts' encoder files
    drawn = {}
    for name, flags in (("files", clip), ("release", [])):
        copy = tmp_path / f"copy-{name}"
        shutil.copytree(release, copy)
        code, err = cli(sample, ["--run-dir", str(copy), *sum((["--prompt", p] for p in PROMPTS), []),
                                 "--negative-prompt", "a blurry photo", "--cfg-scale", "2",
                                 "--n", "3", "--steps", "3", "--out", str(tmp_path / f"{name}.npz"),
                                 *flags])
        assert code == 0, err
        drawn[name] = np.load(tmp_path / f"{name}.npz")["arr_0"]
    assert np.array_equal(drawn["files"], drawn["release"])
    # the negative prompt is read: guided images move off the null caption's, by far more
    # than the tolerance above (these 20-step experts read their captions only faintly)
    assert np.abs(images["full-2"] - images["full-2-negative"]).max() > 1e-4
