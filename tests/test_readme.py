"""The README stays true: its commands exist and every stage command in it parses."""
import os
import re
import shlex

import pytest

from helpers import ROOT

README = open(os.path.join(ROOT, "README.md")).read()


def test_quick_start_commands_are_the_ddm_script_and_ci_runs_the_test_one():
    assert "./ddm pipeline" in README and "./ddm test" in README
    assert "./ddm test" in open(os.path.join(ROOT, ".ci", "run")).read()
    assert "pipeline)" in open(os.path.join(ROOT, "ddm")).read() and "test)" in open(os.path.join(ROOT, "ddm")).read()


@pytest.mark.parametrize("line", [l.strip() for l in README.splitlines() if re.match(r"\s*(torchrun .*?|python )\w+\.py", l)])
def test_every_stage_command_in_the_readme_parses(line):
    import importlib
    words = shlex.split(line.split("#")[0].replace("\\", "").replace("...", ""))
    script = next(w for w in words if w.endswith(".py"))
    argv = [w for w in words[words.index(script) + 1:] if w not in ("&&",)]
    argv = argv[: argv.index("python")] if "python" in argv else argv
    module = importlib.import_module(script[:-3])
    module.build_parser().parse_args([a.replace("$SLURM_ARRAY_TASK_ID", "0") for a in argv])
