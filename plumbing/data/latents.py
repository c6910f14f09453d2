"""Latent space: a diffusers AutoencoderKL (SD-VAE) and a cache of a data set's latents.

The papers train every expert in SD-VAE latents (256 px images -> 32x32x4). With `--vae
PATH` (a local diffusers AutoencoderKL folder: config.json and its weights, as
stabilityai/sd-vae-ft-ema ships; or a hub tag together with --download) the images are
encoded once, in batches, into runs/latents/KEY.npy, KEY hashing the data set, the VAE and
the image size. The cache holds the encoder's posterior mean and standard deviation, both
already multiplied by the latent scale factor from the VAE's config (0.18215 for SD-VAE,
after subtracting its shift factor where the config has one). Experts draw a fresh latent
z = mean + std * eps for every batch, as DiT's own train.py does by encoding online with
`latent_dist.sample()`; the router and everything else read the mean. Clustering and
evaluation always see images; sample.py decodes.

Digits and other grey data sets are repeated to the VAE's 3 input channels and decoded
back to one channel by averaging, so eval.py compares like with like.

diffusers is optional: `pip install -r requirements-latent.txt`; imported only when
--vae is given."""
import hashlib
import json
import math
import os

import numpy as np
import torch
from tqdm import tqdm

from plumbing.command_line import UsageError, first_line
from plumbing.run_dir import atomic_json, atomic_path, cache_key

INSTALL = "pip install -r requirements-latent.txt"
WEIGHT_FILES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")


def file_hash(paths):
    h = hashlib.sha1()
    for path in paths:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()


class VAE:
    """A frozen AutoencoderKL: `encode` images in [-1, 1] to scaled (mean, std), `decode`
    scaled latents to images.

    `spec` is what checkpoints record: where it was loaded from, a hash of its config
    and weights (the identity that survives a move to another machine), and its latent
    geometry."""

    def __init__(self, path, download=False, device="cpu"):
        folder = _local_folder(path, download)
        config_path = os.path.join(folder, "config.json")
        try:
            with open(config_path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise UsageError(f"--vae {path}: no readable config.json ({first_line(e)}); "
                             "expected a diffusers AutoencoderKL folder")
        if not isinstance(config, dict):
            raise UsageError(f"--vae {path}: config.json holds a "
                             f"{type(config).__name__}, not a diffusers config (an "
                             "object)")
        if config.get("_class_name") != "AutoencoderKL":
            raise UsageError(f"--vae {path}: config.json describes "
                             f"{config.get('_class_name') or 'no diffusers model'}, not "
                             "an AutoencoderKL")
        weights = [os.path.join(folder, name) for name in WEIGHT_FILES
                   if os.path.isfile(os.path.join(folder, name))]
        if not weights:
            raise UsageError(f"--vae {path}: no weights ({' or '.join(WEIGHT_FILES)}) "
                             "beside config.json")
        try:
            import diffusers
        except ImportError:
            raise UsageError(f"--vae needs diffusers, an optional dependency: {INSTALL}")
        # safetensors where the folder has them; a .bin goes through
        # torch.load(weights_only=True) in diffusers
        try:
            safetensors = weights[0].endswith(".safetensors")
            net, loaded = diffusers.AutoencoderKL.from_pretrained(
                folder, use_safetensors=safetensors, output_loading_info=True)
        except Exception as e:
            raise UsageError(f"--vae {path}: cannot load the AutoencoderKL: {first_line(e)}")
        # diffusers only warns about weights the config has no place for (or places with
        # none): a network built from such a config is not the one the weights were
        # trained as
        unfit = {"missing": loaded["missing_keys"], "unused": loaded["unexpected_keys"],
                 "of another shape": [key for key, *_ in loaded["mismatched_keys"]]}
        if any(unfit.values()):
            raise UsageError(f"--vae {path}: the weights do not fit config.json (" + ", ".join(
                f"{len(keys)} {what}, e.g. {keys[0]}" for what,
                keys in unfit.items() if keys) + ")")
        self.net = net.eval().requires_grad_(False).to(device)
        self.device = torch.device(device)
        c = self.net.config
        # float() would read True as 1.0 and "0.18" as 0.18
        for name in ("scaling_factor", "shift_factor"):
            value = getattr(c, name, None)
            optional = name == "shift_factor" and value is None
            if isinstance(value, bool) or not isinstance(value, (int, float)) and not optional:
                raise UsageError(f"--vae {path}: config.json's {name} is {value!r}, not "
                                 "a number "
                                 f"({'SD-VAE: 0.18215' if name == 'scaling_factor' else 'or null for none'})")
        try:   # a config diffusers accepted can still hold values no latent space is made of
            self.scale, self.shift = float(c.scaling_factor), float(getattr(c, "shift_factor", None) or 0.0)
            self.in_channels, self.latent_channels = int(c.in_channels), int(c.latent_channels)
            self.downsample = 2 ** (len(c.block_out_channels) - 1)
        except (TypeError, ValueError, AttributeError) as e:
            raise UsageError(f"--vae {path}: config.json has no usable scaling_factor / "
                             f"channels / block_out_channels ({first_line(e)})")
        if not math.isfinite(self.scale) or self.scale <= 0 or not math.isfinite(self.shift):
            raise UsageError(f"--vae {path}: config.json's scaling_factor "
                             f"{c.scaling_factor} (shift_factor {self.shift}) cannot "
                             "scale latents: it must be a finite positive number "
                             "(SD-VAE: 0.18215)")
        self._check_geometry(path)
        self.spec = {"path": path, "fingerprint": file_hash([config_path, weights[0]]),
                     "scaling_factor": self.scale,
                     "shift_factor": self.shift, "latent_channels": self.latent_channels,
                     "downsample": self.downsample,
                     "in_channels": self.in_channels}

    def _check_geometry(self, path):
        """Run the network once on a tiny image: what config.json says about channels
        and downsampling is what every stage relies on, and a config that loads can
        still describe a network that fails, or halves the image less often."""
        size = 2 * self.downsample
        try:
            mean, _ = self.encode(torch.zeros(1, self.in_channels, size, size))
            image = self.decode(mean, self.in_channels)
        except Exception as e:
            raise UsageError(f"--vae {path}: the AutoencoderKL does not run on a "
                             f"{size}-pixel image: {first_line(e)}")
        if tuple(mean.shape[1:]) != (self.latent_channels, 2,
                                     2) or tuple(image.shape[1:]) != (self.in_channels, size, size):
            raise UsageError(f"--vae {path}: config.json describes "
                             f"{self.latent_channels}x2x2 latents of a "
                             f"{self.in_channels}x{size}x{size} image, the network gives "
                             f"{'x'.join(map(str, mean.shape[1:]))} latents and "
                             f"{'x'.join(map(str, image.shape[1:]))} images")

    @torch.no_grad()
    def encode(self, x):
        """Images (N, C, H, W) in [-1, 1] to the scaled posterior (mean, std), each (N,
        latent_channels, H/f, W/f)."""
        if x.shape[1] == 1 and self.in_channels == 3:
            x = x.expand(-1, 3, -1, -1)
        posterior = self.net.encode(x.to(self.device)).latent_dist
        return (posterior.mean - self.shift) * self.scale, posterior.std * self.scale

    @torch.no_grad()
    def decode(self, z, channels):
        """Scaled latents to images in [-1, 1] with the data set's `channels` (grey:
        the mean of the decoded RGB)."""
        x = self.net.decode(z.to(self.device,
                                 torch.float32) / self.scale + self.shift).sample.clamp(-1, 1)
        return x.mean(1, keepdim=True) if channels == 1 and x.shape[1] != 1 else x


def _local_folder(path, download):
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise UsageError(f"--vae {path} is a file; give the diffusers folder that holds "
                         "config.json and the weights")
    if not download:
        raise UsageError(f"no VAE folder at {path}: give a local diffusers AutoencoderKL "
                         "folder, or a hub tag with --download")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(path, allow_patterns=["config.json", "*.safetensors"])
    except ImportError:
        raise UsageError("--download of a VAE needs huggingface_hub (comes with "
                         f"diffusers): {INSTALL}")
    except Exception as e:
        raise UsageError(f"cannot download the VAE {path}: {first_line(e)}")


def resolve_vae(flag, recorded, download=False, device="cpu"):
    """The VAE a stage works in: --vae if given, else the one `recorded` by the file it
    reads; None for pixels.

    A VAE given on the command line must be the recorded one (same config and weights
    hash)."""
    if flag is None and recorded is None:
        return None
    vae = VAE(flag or recorded["path"], download, device)
    if recorded is not None and vae.spec["fingerprint"] != recorded["fingerprint"]:
        raise UsageError(f"the VAE at {flag or recorded['path']} is not the one these "
                         "files were made in (config and weights hash "
                         f"{vae.spec['fingerprint'][:10]} vs "
                         f"{recorded['fingerprint'][:10]})")
    return vae


class LatentSet:
    """An image data set seen through a VAE: the ImageSet interface, with latents in place
    of pixels.

    `fingerprint`, labels and captions are the images' (clusters and conditions refer
    to them); `channels` and `image_size` are the latents', what the networks see;
    `vae` is the VAE's spec, `autoencoder` the VAE itself (to decode previews)."""
    bounded = False   # latents have no known range

    def __init__(self, images, autoencoder, moments):
        # moments: (N, 2, C, h, w) float16
        self.images_set, self.autoencoder, self.moments = images, autoencoder, moments
        self.vae = autoencoder.spec
        self.name, self.labels = images.name, images.labels
        self.num_classes, self.captions = images.num_classes, images.captions
        self.fingerprint = images.fingerprint
        self.channels, self.image_size = moments.shape[2], moments.shape[-1]

    def __len__(self):
        return len(self.moments)

    def batch(self, idx, rng=None):
        """Latents for an index array: the posterior mean, or with `rng` (numpy) a draw
        from the posterior."""
        m = torch.from_numpy(np.asarray(self.moments[idx], dtype=np.float32))
        if rng is None:
            return m[:, 0]
        return m[:, 0] + m[:, 1] * torch.from_numpy(rng.standard_normal(m[:, 0].shape, dtype=np.float32))


def latent_set(images, vae, run_dir, batch_size=32):
    """`images` as a LatentSet in `vae`'s space, from the cache (encoded now if absent or
    unreadable)."""
    if images.image_size % vae.downsample:
        raise UsageError(f"the VAE downsamples by {vae.downsample}; "
                         f"{images.image_size}-pixel images do not divide (use "
                         "--image-size)")
    if images.channels not in (1, vae.in_channels):
        raise UsageError(f"the VAE reads {vae.in_channels}-channel images; the data set "
                         f"has {images.channels} channels")
    key = cache_key([images.fingerprint, vae.spec["fingerprint"]])
    path = os.path.join(run_dir, "latents", f"{key}.npy")
    shape = (len(images), 2, vae.latent_channels, images.image_size // vae.downsample,
             images.image_size // vae.downsample)
    if os.path.isfile(path):
        # the record beside the cache must name this VAE and data set: another VAE's
        # latents of the same shape do not fit
        try:
            with open(path[:-4] + ".json") as f:
                record = json.load(f)
            moments = np.load(path, mmap_mode="r", allow_pickle=False)
            if moments.shape == shape and record.get("data") == images.fingerprint and \
                    (record.get("vae") or {}).get("fingerprint") == vae.spec["fingerprint"]:
                return LatentSet(images, vae, moments)
        except (ValueError, OSError, AttributeError):
            pass
        print(f"latents: the cache {path} is unreadable, unrecorded or of another VAE or "
              "data set; encoding again")
    with atomic_path(path) as tmp:
        moments = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=shape)
        for start in tqdm(range(0, len(images), batch_size), desc="encoding latents"):
            mean, std = vae.encode(images.batch(np.arange(start, min(start + batch_size, len(images)))))
            moments[start:start + len(mean)] = torch.stack([mean, std], 1).cpu().numpy()
        moments.flush()
        del moments
    atomic_json({"data": images.fingerprint, "vae": vae.spec, "shape": list(shape),
                 "holds": "posterior mean and std, times the scale factor, float16"},
                path[:-4] + ".json")
    print(f"latents: encoded {len(images)} images to {path}")
    return LatentSet(images, vae, np.load(path, mmap_mode="r", allow_pickle=False))
