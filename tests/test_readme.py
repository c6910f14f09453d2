"""The README and docs/ stay true: their commands exist and every stage command in them
parses."""
import ast
import glob
import os
import re
import shlex

import pytest

from helpers import ROOT

README = open(os.path.join(ROOT, "README.md")).read()
DOCS = "\n".join(open(f).read() for f in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))


def test_quick_start_commands_are_the_ddm_script_and_ci_runs_the_test_one():
    assert "./ddm pipeline" in README and "./ddm test" in README
    assert "./ddm test" in open(os.path.join(ROOT, ".ci", "run")).read()
    assert ("pipeline)" in open(os.path.join(ROOT, "ddm")).read() and "test)"
            in open(os.path.join(ROOT, "ddm")).read())


@pytest.mark.parametrize("line", [l.strip() for l in (README + "\n" + DOCS).splitlines()
                                  if re.match(r"\s*(torchrun .*?|python )\w+\.py", l)])
def test_every_stage_command_in_the_readme_parses(line):
    import importlib
    words = shlex.split(line.split("#")[0].replace("\\", "").replace("...", ""))
    script = next(w for w in words if w.endswith(".py"))
    argv = [w for w in words[words.index(script) + 1:] if w not in ("&&",)]
    argv = argv[: argv.index("python")] if "python" in argv else argv
    module = importlib.import_module(script[:-3])
    module.build_parser().parse_args([a.replace("$SLURM_ARRAY_TASK_ID", "0") for a in argv])


def test_the_readme_is_the_readers_entry_and_links_only_to_what_exists():
    assert len(README.splitlines()) <= 300, "studies' tables belong in docs/"
    for target in re.findall(r"\]\(((?:docs/)?[\w./-]+\.(?:md|png))(?:#[^)]*)?\)",
                             README + DOCS):
        path = target if target.startswith("docs/") or target in (
            "README.md",) else os.path.join("docs", target)
        assert os.path.isfile(os.path.join(ROOT,
                                           path)), f"a link to {target}, which does not exist"


def test_the_readmes_links_into_the_results_page_name_its_headings():
    def slug(heading):   # GitHub's anchors: lower case, punctuation dropped, spaces to hyphens
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
    results = open(os.path.join(ROOT, "docs", "results.md")).read()
    headings = {slug(line.lstrip("#")) for line in results.splitlines()
                if re.match(r"#{2,4} ", line)}
    anchors = re.findall(r"docs/results\.md#([^)]+)\)", README)
    assert anchors and set(anchors) <= headings, set(anchors) - headings


def test_what_we_found_is_short_verdicts_with_the_two_figures():
    section = README.split("## What we found", 1)[1].split("\n## ", 1)[0]
    prose = re.sub(r"\]\([^)]*\)", "]", section)   # a link's target is not read
    assert len(prose.split()) < 300, "the verdicts' detail belongs in docs/results.md"
    figures = re.findall(r"!\[[^\]]*\]\((docs/[\w./-]+\.png)\)", section)
    assert len(figures) == 2 and all(os.path.isfile(os.path.join(ROOT, f)) for f in figures)
    verdicts = [line for line in section.splitlines() if line.startswith("- **")]
    assert verdicts and all("±" in line and "seed" in line for line in verdicts)


def test_the_readmes_confirmatory_figure_is_the_analysis_of_the_kept_chunks():
    from studies import confirm
    results, _ = confirm.analyse(confirm.load_chunks(os.path.join(ROOT, "docs", "confirm")))
    primary = results["comparisons"]["primary"]
    in_sentence = r"(?:[^.]|\.(?=\d))*"   # a decimal point does not end a sentence
    clause = re.search(in_sentence + r"\[confirmatory test\]\(docs/confirm-protocol\.md\)"
                       + in_sentence + r"\.(?!\d)", README)
    assert clause, "the README names the confirmatory test and links its protocol"
    if len(primary["seeds"]) < len(confirm.SEEDS):   # no interim figure before the declared N
        assert "running" in clause.group() and "±" not in clause.group()
        return
    assert verdict_after(clause.group(), primary), clause.group()
    # the information control: a figure only once its declared seeds are in
    control = results["comparisons"]["experts_minus_control"]
    if len(control["seeds"]) < len(confirm.CONTROL_SEEDS):
        assert "information control is running" in clause.group(), clause.group()
    else:
        assert "information control" in clause.group()
        assert verdict_after(clause.group(), control), clause.group()


def verdict_after(text, comparison):
    """Whether `text` states the comparison's mean ± half-width followed by its verdict
    ("resolved" or "not resolved"), as the README writes a figure."""
    figure = f"{comparison['mean']:+.1f} ± {comparison['half']:.1f}".replace("-", "−")
    verdict = "resolved" if comparison["resolved"] else "not resolved"
    return f"{figure}, {verdict}" in text


def test_every_project_file_the_docs_name_exists():
    named = set(re.findall(r"\b((?:tests|plumbing|bench|studies)/[a-z_0-9]+\.py)",
                           README + DOCS))
    missing = sorted(f for f in named if not os.path.isfile(os.path.join(ROOT, f)))
    assert named and not missing, missing


def definition_length(path, qualified):
    """Lines of the function or class `qualified` (e.g. 'DDPM.velocity') in `path`."""
    nodes = ast.parse(open(os.path.join(ROOT, path)).read()).body
    node = None
    for part in qualified.split("."):
        node = next((n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                     and n.name == part), None)
        assert node is not None, f"README names {path}:{qualified}, which is not there"
        nodes = node.body
    return node.end_lineno - node.lineno + 1


def test_the_reading_lists_lengths_are_the_codes():
    """'Read the method' gives each definition's length in lines: every one is measured
    from the code (a name without a file is in the item's file)."""
    section = README.split("## Read the method", 1)[1].split("\n## ", 1)[0]
    items = re.split(r"\n(?=\d+\. )", section)
    checked = 0
    for item in items:
        first = re.search(r"`([\w/]+\.py):", item)
        if not first:
            continue
        for path, name, given in re.findall(r"`(?:([\w/.]+\.py):)?([\w.]+)`(?: \(|, )(\d+)\)",
                                            item):
            assert definition_length(path or first.group(1), name) == int(given), name
            checked += 1
    assert checked >= 15
