"""Share an ensemble: write a run's experts and router as a release folder, the way the
field shares models (safetensors weights, a JSON index, a model card; release.py has the
layout).

    python export.py --run-dir runs --out release/                  # every expert and the router
    python export.py --run-dir runs --out release/ --diffusers      # experts in diffusers' layout
    python sample.py --run-dir release/ --routing top1              # read as a run folder

Each network folder holds its EMA weights (diffusion_pytorch_model.safetensors) and a
config.json with its constructor arguments and its checkpoint's config (objective and time
convention, condition, membership, training flags and FLOPs); no optimizer state, nothing
pickled. The index (model_index.json) lists the experts by name with their objective, time
convention, data fingerprint and source (trained in this run, or taken from an earlier
release), the router, the default routing, the condition, the VAE, the data set's
fingerprint and the training FLOPs, and the FD and class accuracy of every evaluated
sample batch of exactly these weights. README.md is a model card generated from the same
records.

--diffusers writes each expert with diffusers' config and key names: an adaLN-Zero class-conditional
expert loads with `DiTTransformer2DModel.from_pretrained(folder)`, an AdaLN-Single text expert with
`PixArtTransformer2DModel.from_pretrained(folder)`; an expert with no exact counterpart (a
class-conditional AdaLN-Single DiT, this project's default) is refused in one line naming the part
(diffusers_format.py). The router has no diffusers counterpart and stays in this project's layout.

Joining a release: train your own expert into a copy of it (train_expert.py --contribution NAME
--run-dir COPY), a router from every expert's samples (train_router.py --from-samples 256), and
export the grown ensemble: the index says which experts came from the earlier release.
"""
import argparse
import glob
import hashlib
import json
import os
import shlex
import shutil

from model import clip_text_embeddings, registry_name
from plumbing.checkpoint import networks_digests, read_network_file, split_checkpoint
from plumbing.command_line import NUMBER, Parser, UsageError, checked_record, run_main
from plumbing.release.diffusers_format import DiffusersFormatError
from plumbing.ensemble import SINGLE_MODELS, assemble, load_experts, routing_rule
from plumbing.release.model_card import model_card
from plumbing.sources import member_of
from plumbing.data.encoders import TextEncoder, architecture, encoder_spec, open_clip_config
from plumbing.data.latents import file_hash
from plumbing.release.layout import (SCHEDULER_CONFIG, network_files, pipeline_files,
                                     pipeline_index, time_convention, write_network)
from plumbing.release.reader import CONFIG, INDEX, RELEASE_FORMAT, WEIGHTS, build_clip, text_tower_state
from plumbing.run_dir import (check_writable_dir, expert_dir, network_path, router_dir,
                              staged)


def network_source(path, run_name, release_name):
    """(checkpoint dict, where the network came from): the run it was trained in, its
    steps, and every release it has been part of, this one last."""
    ckpt = read_network_file(path, "network")
    source = ckpt.get("source") or {"trained_in": run_name, "steps": ckpt.get(
        "step", ckpt["config"].get("steps")), "releases": []}
    return ckpt, {**source, "releases": [*source["releases"], release_name]}


# what a batch's record must hold to be listed (sample.py writes it; older batches lack
# the newer fields, which default as sample.py's flags do)
BATCH_RECORD = {"routing": str, "n": int, "steps": int, "solver": str, "cfg_scale": NUMBER,
                "seed": int, "weights": dict, "sampling_flops_per_image": (*NUMBER, type(None)),
                "cost_vs_one_expert": (*NUMBER, type(None))}
EVAL_RECORD = {"fd_classifier": (*NUMBER, type(None)),
               "conditional_accuracy": (*NUMBER, type(None))}
FLAGS = {"cfg_routing": ("--cfg-routing", "shared"), "router_every": ("--router-every", 1),
         "class_label": ("--class", None), "negative_prompt": ("--negative-prompt", None)}


def measured(run_dir, digests):
    """The evaluated sample batches of RUN_DIR/samples drawn with exactly these networks'
    weights, each with the command that draws and measures it again. A batch record or
    score that is damaged is refused in one line naming the file and field."""
    rows = []
    for record_path in sorted(glob.glob(os.path.join(run_dir, "samples", "*.json"))):
        scores_path = record_path[:-5] + ".eval.json"
        if record_path.endswith(".eval.json") or not os.path.isfile(scores_path):
            continue
        try:
            with open(record_path) as f:
                record = json.load(f)
            with open(scores_path) as f:
                scores = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError(f"{record_path} or its .eval.json is not readable JSON ({e})")
        checked_record(record, BATCH_RECORD, record_path)
        checked_record(scores, EVAL_RECORD, scores_path)
        if not record["weights"] or any(digests.get(n) != d for n, d in record["weights"].items()):
            continue
        batch = os.path.basename(record_path)[:-5] + ".npz"
        rows.append({"batch": batch, "routing": record["routing"], "n": record["n"],
                     "steps": record["steps"], "cfg_scale": record["cfg_scale"],
                     "command": f"{sample_command(record, batch)}; "
                                f"python eval.py {shlex.quote(batch)}",
                     "sampling_gflops": (record.get("sampling_flops_per_image") or 0) / 1e9 or None,
                     "cost_vs_one_expert": record.get("cost_vs_one_expert"),
                     "fd_classifier": scores.get("fd_classifier"),
                     "conditional_accuracy": scores.get("conditional_accuracy"),
                     "classifier_accuracy_on_real": scores.get("classifier_accuracy_on_real")})
    return [r for r in rows if r["fd_classifier"] is not None]


def sample_command(record, batch):
    """The sample.py command a batch's record says drew it: every setting that differs from
    sample.py's defaults, the experts it used among them; every word from the record quoted
    for the shell, since a model card's reader pastes it."""
    words = ["python sample.py", f"--routing {shlex.quote(record['routing'])}",
             f"--num-samples {record['n']}", f"--steps {record['steps']}",
             f"--solver {shlex.quote(record['solver'])}",
             # always written, as the solver is: sample.py's default grid changed (1 -> 3)
             f"--time-shift {record.get('time_shift', 1.0)}",
             f"--cfg-scale {record['cfg_scale']}", f"--seed {record['seed']}"]
    experts = record.get("experts") or []
    if record.get("missing") or experts in (["all"], ["distilled"]):   # not every expert
        words.append(f"--experts {shlex.quote(','.join(experts))}")
    words += [f"{flag} {shlex.quote(str(record[key]))}" for key, (flag, default) in FLAGS.items()
              if record.get(key, default) != default]
    return " ".join(words + [f"--out {shlex.quote(batch)}"])


def build_index(run_dir, routing, layout, experts, router, names, sources):
    """model_index.json's content, from the loaded ensemble and each network's
    checkpoint: the release's experts in `layout` (diffusers or ddm), sampled under
    `routing`."""
    ref = next(iter(experts.values())).config
    digests = networks_digests(experts, router, names)
    entries = []
    for output, network in sorted(experts.items()):
        name, (ckpt, source) = names[output], sources[names[output]]
        member = member_of(network.config)
        entries.append({"name": name, "folder": f"experts/{name}",
                        "layout": layout,
                        "objective": network.config["objective"],
                        "time": time_convention(network.config["objective"], ckpt["model_args"]),
                        "origin": member.get("origin"), "trained_on": member.get("trained_on"),
                        "size": member.get("size"), "flops": network.config.get("flops"),
                        "source": source})
    router_flops = (router.config.get("flops") or 0) if router is not None else 0
    expert_flops = sum(e["flops"] or 0 for e in entries)
    return {"_class_name": "DecentralizedDiffusionEnsemble", "_ddm_release_format": RELEASE_FORMAT,
            "name": sources[names[0]][1]["releases"][-1],
            "experts": entries,
            "router": None if router is None else {
                "folder": "router", "model": registry_name(sources["router"][0]["model_args"]),
                "flops": router_flops,
                "experts": [m["name"] for m in router.config.get("experts", [])],
                "source": sources["router"][1]},
            "routing": routing, "condition": ref["condition"], "vae": ref.get("vae"),
            "data": ref.get("data"), "data_spec": ref.get("data_spec"), "k": ref.get("k"),
            "cluster_fingerprint": ref.get("cluster_fingerprint"),
            "training_flops": {"experts": expert_flops, "router": router_flops,
                               "total": expert_flops + router_flops},
            "measured": measured(run_dir, digests)}


def text_encoder_files(condition, clip_model, clip_pretrained):
    """text_encoder/'s files for text experts: their open_clip architecture's config and its
    text tower's weights, checked to be the encoder they were trained with (by its spec) and
    to encode, rebuilt from what ships, as it does (to 1e-5)."""
    if condition["kind"] != "text":
        return None
    if not clip_pretrained:
        raise UsageError("a text release ships its experts' text tower: pass --clip-model and "
                         f"--clip-pretrained, the encoder they were trained with "
                         f"({condition['encoder']})")
    spec = encoder_spec(clip_model, clip_pretrained)
    if spec != condition["encoder"]:
        raise UsageError(f"--clip-model/--clip-pretrained give {spec}, but the experts were "
                         f"trained with {condition['encoder']}")
    encoder = TextEncoder(clip_model, clip_pretrained)
    name = architecture(clip_model)
    config = open_clip_config(name)
    state = text_tower_state(encoder.model)
    probe = ["a photograph of a cat", "the digit 3", "x"]
    clip, tokenizer = build_clip(name, config, state)
    shipped, trained = clip_text_embeddings(clip, tokenizer, probe), encoder(probe)
    if any((a - b).abs().max() > 1e-5 for a, b in zip(shipped, trained)):
        raise UsageError(f"the text tower rebuilt from {name}'s open_clip config does not encode "
                         "as the experts' encoder does (a hub tag's variant?): export with the "
                         "local weights file they were trained with")
    return {CONFIG: {"_class_name": "TextTower", "_diffusers_version": "0.38.0",
                     "architecture": name, "open_clip_config": config, "encoder": spec},
            WEIGHTS: state}


def vae_files(vae, flag):
    """{name: source path} of vae/ for latent experts: their VAE folder's config.json and
    safetensors weights, copied byte for byte, so the release's VAE has the fingerprint the
    experts recorded (checked here)."""
    if vae is None:
        return None
    folder = flag or vae["path"]
    paths = {name: os.path.join(folder, name) for name in (CONFIG, WEIGHTS)}
    if not all(os.path.isfile(p) for p in paths.values()):
        raise UsageError(f"a latent release ships its experts' VAE: {folder} has no {CONFIG} and "
                         f"{WEIGHTS} (give the folder with --vae; a .bin-only VAE: save it "
                         "with safe_serialization=True first)")
    if file_hash(list(paths.values())) != vae["fingerprint"]:
        raise UsageError(f"the VAE at {folder} is not the one the experts were trained in "
                         "(config and weights hash differ): give theirs with --vae")
    return paths


def main(args):
    routing = routing_rule(args.routing)
    if os.path.exists(args.out):
        raise UsageError(f"--out {args.out} exists: a release is written whole into a new folder")
    check_writable_dir(os.path.dirname(os.path.abspath(args.out)), "--out")
    which = args.experts.strip()
    if which in SINGLE_MODELS:
        experts, router, names = {0: load_experts(args.run_dir, which)[which]}, None, [which]
    else:
        experts, router, routing, names = assemble(args.run_dir, which, None, args.routing)
    run_name = os.path.basename(os.path.abspath(args.run_dir))
    release_name = args.name or os.path.basename(os.path.normpath(args.out))
    sources = {names[i]: network_source(
        network_path(expert_dir(args.run_dir, names[i])), run_name, release_name) for i in experts}
    if router is not None:
        sources["router"] = network_source(
            network_path(router_dir(args.run_dir)), run_name, release_name)
    files = {}
    try:
        for name, (ckpt, source) in sources.items():
            state, model_args, config = split_checkpoint(ckpt)
            folder = "router" if name == "router" else f"experts/{name}"
            files[folder] = network_files(state, model_args, config, source,
                                          diffusers=args.diffusers and name != "router")
    except DiffusersFormatError as e:
        raise UsageError(f"--diffusers: expert {name}: {e}")
    layout = "diffusers" if args.diffusers else "ddm"
    index = build_index(args.run_dir, args.routing, layout, experts, router, names, sources)
    ref = next(iter(experts.values())).config
    text_encoder = text_encoder_files(ref["condition"], args.clip_model, args.clip_pretrained)
    vae = vae_files(ref.get("vae"), args.vae)
    components = ["experts"] + ["router"] * (router is not None) + ["text_encoder"] * bool(text_encoder)
    # every file diffusers' trust_remote_code runs, pinned by its digest in the index and
    # named on the card, so a user can check what will run before running it
    code = pipeline_files(components)
    index["code"] = {path: hashlib.sha256(text.encode()).hexdigest()
                     for path, text in sorted(code.items())}
    # written whole beside OUT, then renamed: never a half-written release, and what a
    # killed export left is removed by the next
    with staged(args.out, "--out") as tmp:
        for folder, content in files.items():
            write_network(os.path.join(tmp, folder), content)
        if text_encoder:
            write_network(os.path.join(tmp, "text_encoder"), text_encoder)
        for name, path in (vae or {}).items():
            os.makedirs(os.path.join(tmp, "vae"), exist_ok=True)
            shutil.copyfile(path, os.path.join(tmp, "vae", name))
        texts = {INDEX: json.dumps(pipeline_index(index, bool(text_encoder)), indent=1),
                 "scheduler/scheduler_config.json": json.dumps(SCHEDULER_CONFIG, indent=1),
                 "README.md": model_card(index, args.license, args.base_model), **code}
        for path, text in texts.items():
            os.makedirs(os.path.dirname(os.path.join(tmp, path)), exist_ok=True)
            with open(os.path.join(tmp, path), "w") as f:
                f.write(text)
    written = ", ".join(n for n in sources if n != "router")
    print(f"wrote {args.out}: {len(experts)} expert(s) ({written}), "
          f"{len(index['measured'])} measured batch(es), {INDEX}, README.md, and the "
          "diffusers pipeline (DiffusionPipeline.from_pretrained(FOLDER, trust_remote_code=True))")
    if args.diffusers and any("time_embedding" in c["config.json"].get("_ddm", {})
                              for c in files.values()):
        print("note: diffusers' DiTTransformer2DModel embeds time with "
              "downscale_freq_shift=1; these experts were trained with 0: call "
              "diffusers_format.use_dit_time_embedding(model) after from_pretrained to "
              "compute what they compute here")


def build_parser():
    p = Parser(prog="export.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", default="runs", help="the run folder (or a release) to export")
    p.add_argument("--out", required=True, help="the release folder to write (must not exist)")
    p.add_argument("--experts", default="",
                   help="cluster ids or partition names, e.g. 0,2,3 (default: every "
                        "expert), or 'all' / 'distilled' for one model of the whole data "
                        "set")
    p.add_argument("--routing", default="top1",
                   help="the routing rule the index recommends (top1, top2, full, draw, ...)")
    p.add_argument("--diffusers", action="store_true",
                   help="write the experts in diffusers' layout (DiTTransformer2DModel "
                        "or PixArtTransformer2DModel); refused for an expert with no "
                        "exact counterpart")
    p.add_argument("--clip-model", default="ViT-B-32",
                   help="text experts: the open_clip architecture (name or config .json) of "
                        "their text tower, which the release ships")
    p.add_argument("--clip-pretrained", default=None,
                   help="text experts: the weights file they were trained with ('none' for a "
                        "random tower)")
    p.add_argument("--vae", default=None,
                   help="latent experts: where their VAE folder is on this machine (default: "
                        "the path they recorded; it must be the same VAE, by hash), shipped "
                        "as vae/")
    p.add_argument("--name", default=None, help="the release's name (default: --out's folder name)")
    p.add_argument("--license", default="other",
                   help="the licence the model card declares to the Hub (an id such as mit or "
                        "cc-by-4.0; the data set's own licence is noted in the card)")
    p.add_argument("--base-model", default=None, metavar="HUB_ID",
                   help="the Hub id of the weights the experts started from (--init of a "
                        "public checkpoint), for the card's base_model")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
