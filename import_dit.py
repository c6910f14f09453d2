"""Import a pretrained DiT as an expert, untrained: the inverse of export.py.

Reads a checkpoint (an official facebookresearch/DiT .pt such as DiT-XL-2-256x256.pt, or
one of ours) and the run's cluster file if it has one; writes
RUN_DIR/experts/<cluster>/ckpt.pt with the weights unchanged and their provenance recorded
(file name and SHA-1). The imported network then samples as `sample.py --experts all`, or
as expert <cluster> of an ensemble, and `train_expert.py --init
RUN_DIR/experts/<cluster>/ckpt.pt --out-dir NEW` fine-tunes it.

    python import_dit.py DiT-XL-2-256x256.pt --cluster all --vae sd-vae-ft-ema --run-dir runs/official
"""
import argparse
import os

from model import DiT
from plumbing.checkpoint import CheckpointError, read_network_file
from plumbing.training.plan import written_by
from plumbing.training.warm_start import split_expert_checkpoint
from plumbing.command_line import Parser, UsageError, cluster_name, first_line, run_main
from plumbing.data.datasets import same_vae
from plumbing.data.latents import file_hash, resolve_vae
from plumbing.checkpoint import CHECKPOINT_FORMAT
from plumbing.run_dir import (atomic_save, check_not_released, check_writable_dir,
                              cluster_path, expert_dir, folder_lock, load_checkpoint,
                              network_file_set)
from plumbing.sources import load_clusters


def read_network(path):
    """(network, constructor args, config) of a DiT checkpoint this project can load."""
    source = read_network_file(path, "checkpoint to import")
    try:
        state, model_args, config = split_expert_checkpoint(source)
        net = DiT(**model_args)
        net.load_state_dict(state, strict=True)
    except (CheckpointError, KeyError, TypeError, ValueError, RuntimeError) as e:
        raise UsageError(f"{path}: not a DiT checkpoint this project can load ({first_line(e)})")
    return net, model_args, config


def check_space(path, model_args, clusters, vae, cluster):
    """The imported network reads what the run's experts read: the cluster file's
    images, or their VAE latents."""
    size, channels = model_args["input_size"], model_args["in_channels"]
    space = f"{channels}x{size}x{size}"
    if vae is not None and channels != vae.latent_channels:
        raise UsageError(f"{path} reads {space} inputs; the VAE's latents have "
                         f"{vae.latent_channels} channels")
    if clusters is None:
        return space
    c, side = clusters["data"]["shape"][0], clusters["data"]["shape"][-1]
    want = (vae.latent_channels, side // vae.downsample) if vae else (c, side)
    if (channels, size) != want:
        hint = "" if vae else " (a latent model needs --vae)"
        raise UsageError(f"{path} reads {space} inputs; the cluster file's data give "
                         f"{want[0]}x{want[1]}x{want[1]}{hint}")
    if cluster != "all" and int(cluster) >= clusters["k"]:
        raise UsageError(f"unknown cluster {cluster!r}: valid ones are "
                         f"0..{clusters['k'] - 1}, all")
    return space


def main(args):
    net, model_args, config = read_network(args.checkpoint)
    has_clusters = os.path.isfile(cluster_path(args.run_dir))
    if args.cluster != "all" and not has_clusters:
        raise UsageError(f"importing as expert {args.cluster} needs the run's cluster "
                         f"file ({cluster_path(args.run_dir)}); without one, import it "
                         "as --cluster all")
    clusters = load_clusters(args.run_dir) if has_clusters else None
    run_vae = clusters.get("vae") if clusters else None
    if config.get("vae") and run_vae and not same_vae(config["vae"], run_vae):
        raise UsageError(f"{args.checkpoint} was trained in another VAE's latents than "
                         "the cluster file's")
    vae = resolve_vae(args.vae, config.get("vae") or run_vae, args.download)
    space = check_space(args.checkpoint, model_args, clusters, vae, args.cluster)

    out_dir = args.out_dir or expert_dir(args.run_dir, args.cluster)
    check_writable_dir(out_dir, "the expert's folder")
    check_not_released(out_dir)
    digest = file_hash(network_file_set(args.checkpoint))
    existing = os.path.join(out_dir, "ckpt.pt")
    if os.path.isfile(existing):   # an import replaces nothing but the same file imported before
        held = load_checkpoint(existing, "checkpoint")
        held_config = held.get("config") or {}
        if (held_config.get("imported") or {}).get("sha1") != digest:
            writer = written_by(held_config)
            what = f"a network that {writer} trained" if writer else "another imported checkpoint"
            raise UsageError(f"{out_dir} already holds {what} (step {held.get('step')}, init "
                             f"{held_config.get('init', 'scratch')}); import into another "
                             f"--out-dir or --run-dir, or remove {existing} first")
    name = os.path.basename(args.checkpoint)
    record = dict(format=CHECKPOINT_FORMAT, flags={},
        imported={"file": name, "sha1": digest}, init=f"imported:{name}",
        image_size=model_args["input_size"], channels=model_args["in_channels"],
        vae=vae.spec if vae else None, cluster=args.cluster, flops=0, flops_per_step=None,
        cluster_fingerprint=clusters["fingerprint"] if clusters else None,
        k=clusters["k"] if clusters else 1, data=clusters["data"] if clusters else None,
        data_spec=clusters["data_spec"] if clusters else None)
    with folder_lock(out_dir, "import_dit.py"):
        atomic_save({"model": net.state_dict(), "ema": None, "opt": None, "step": 0, "rng": [],
                     "model_args": model_args, "config": {**config, **record}}, existing)
    print(f"imported {args.checkpoint} ({config['objective']['name']}, {space}, "
          "condition "
          f"{config['condition']['kind']}{', VAE ' + vae.spec['path'] if vae else ''}) "
          f"as {existing}; it samples as-is, and train_expert.py --init starts a "
          "fine-tuned expert from it")


def build_parser():
    p = Parser(prog="import_dit.py", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", metavar="CKPT",
                   help="an official facebookresearch/DiT .pt (e.g. DiT-XL-2-256x256.pt, "
                        "with --vae), or a checkpoint of this project")
    p.add_argument("--cluster", type=cluster_name, required=True,
                   help="which expert it becomes: a cluster id of the run's cluster "
                        "file, or 'all' (the monolith; needs no cluster file)")
    p.add_argument("--vae", default=None,
                   help="the diffusers AutoencoderKL folder of a latent DiT (default: "
                        "the cluster file's)")
    p.add_argument("--download", action="store_true", help="allow downloading the VAE")
    p.add_argument("--run-dir", default="runs")
    p.add_argument("--out-dir", default=None, help="default: RUN_DIR/experts/<cluster>")
    return p


if __name__ == "__main__":
    run_main(main, build_parser())
