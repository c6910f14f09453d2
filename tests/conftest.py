import os

import pytest

os.environ.setdefault("TQDM_DISABLE", "1")   # keep test logs readable


@pytest.fixture(scope="session")
def digits_run(tmp_path_factory):
    """runs/ with the default clustering of digits (K=4), made once per test session."""
    import cluster
    from helpers import run_stage
    run_dir = tmp_path_factory.mktemp("runs")
    run_stage(cluster, ["--run-dir", str(run_dir)])
    return run_dir
