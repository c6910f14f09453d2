"""Files written before the redesign still load: tests/fixtures/37591f6/ holds a run folder (two
DiT-N/8 experts and a router on digits, their optimizer state dropped to keep it small), its
release (export.py) and a shard export (cluster.py --export-shards of 40 digits), all written by
the code at commit 37591f6."""
import shutil

import numpy as np

import sample
import train_expert
from helpers import ROOT, run_stage

OLD = f"{ROOT}/tests/fixtures/37591f6"


def test_an_old_run_folder_and_its_release_sample(tmp_path):
    """Their routers were written with `num_clusters`, today's `num_experts`."""
    shutil.copytree(f"{OLD}/run", tmp_path / "run")
    shutil.copytree(f"{OLD}/release", tmp_path / "release")
    for source in ("run", "release"):
        out = tmp_path / f"{source}.npz"
        run_stage(sample, ["--run-dir", str(tmp_path / source), "--routing", "top1", "--n", "4",
                           "--steps", "2", "--out", str(out)])
        with np.load(out) as batch:
            assert batch["arr_0"].shape == (4, 8, 8, 1)


def test_an_old_shard_export_trains_its_island(tmp_path):
    island = tmp_path / "island"
    island.mkdir()
    shutil.copy(f"{OLD}/shard-run/clusters.pt", island)
    run_stage(train_expert, ["--cluster", "1", "--data", f"wds:{OLD}/islands/1/*.tar",
                             "--run-dir", str(island), "--model", "DiT-N/8", "--steps", "2",
                             "--batch-size", "4", "--precision", "fp32", "--workers", "0"])
    assert (island / "experts" / "1" / "ckpt.pt").is_file()
