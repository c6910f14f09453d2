import os

# keep test logs readable; before anything imports tqdm
os.environ.setdefault("TQDM_DISABLE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """runs/ with the default clustering of digits (K=4), made once per test session."""
    import cluster
    from helpers import run_stage
    run_dir = tmp_path_factory.mktemp("runs")
    run_stage(cluster, ["--run-dir", str(run_dir)])
    return run_dir


@pytest.fixture(scope="session")
def tiny_ensemble(digits_run, tmp_path_factory):
    """digits, K=4: 2 flow-matching and 2 DDPM experts, a monolith, and a router, all tiny."""
    import shutil
    import train_expert
    import train_router
    from helpers import run_stage
    run_dir = tmp_path_factory.mktemp("ensemble")
    shutil.copy(digits_run / "clusters.pt", run_dir / "clusters.pt")
    tiny = ["--model", "DiT-M/2", "--steps", "30", "--batch-size", "16",
            "--run-dir", str(run_dir)]
    for k, objective in [("0", "fm"), ("1", "ddpm"), ("2", "fm"), ("3", "ddpm"), ("all", "fm")]:
        run_stage(train_expert, ["--cluster", k, "--objective", objective, *tiny])
    run_stage(train_router, ["--steps", "30", "--run-dir", str(run_dir)])
    return run_dir


@pytest.fixture
def float64():
    """Analytic checks to 1e-5 need double precision end to end; set per test and restored,
    never at import."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
