"""Where a declared test's chunks came from, asked of the git history.

A declared test (docs/confirm-protocol.md, docs/attribution-protocol.md) is credible only
if its protocol was committed before any of its runs and every run used that commit's
code. A chunk records the commit it ran at (`commit()`); the analysis refuses chunks of
two commits or of an uncommitted tree, and, where this checkout has its full history,
chunks that ran at any commit but the one that added the protocol, chunk files committed
before it, and chunk files changed since they were committed. Without the history (no
git, a shallow clone, a copied folder) it says so in its report rather than passing the
check in silence."""
import os
import subprocess

from plumbing.command_line import UsageError
from studies.common import PROJECT


def git(*args):
    return subprocess.run(["git", *args], cwd=PROJECT, capture_output=True, text=True,
                          check=True).stdout.strip()


def commit():
    """HEAD of this checkout, marked +uncommitted where a tracked file differs from it;
    None outside a git checkout."""
    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+uncommitted" if dirty else "")


def protocol_commit(protocol):
    """The commit that added PROTOCOL (a path in this project), or None where the history
    cannot say: git missing, not a checkout, a shallow clone (its oldest commit seems to
    add every file)."""
    try:
        if git("rev-parse", "--is-shallow-repository") != "false":
            return None
        added = git("log", "--diff-filter=A", "--format=%H", "--", protocol).splitlines()
    except (OSError, subprocess.CalledProcessError):
        return None
    if not added:
        raise UsageError(f"{protocol} is not in this checkout's history: a test is declared "
                         "by committing its protocol before any of its runs")
    return added[-1]   # git log lists the newest first; a file re-added keeps its first


def history_of(results):
    """({chunk file path: the commits that touched it, newest first}, {paths changed since
    HEAD}) for the files of RESULTS that this checkout's history holds (none where RESULTS
    lies outside the project)."""
    folder, project = os.path.realpath(results), os.path.realpath(PROJECT)
    if os.path.commonpath([folder, project]) != project:
        return {}, set()
    touched, current = {}, None
    for line in git("log", "--format=@%H", "--name-only", "--", folder).splitlines():
        if line.startswith("@"):
            current = line[1:]
        elif line:
            touched.setdefault(os.path.join(project, line), []).append(current)
    changed = {os.path.join(project, line)
               for line in git("diff", "--name-only", "HEAD", "--", folder).splitlines()}
    return touched, changed


def follows(commit, earlier):
    """Whether COMMIT came after EARLIER in this history: descends from it, and is not it."""
    return commit != earlier and subprocess.run(
        ["git", "merge-base", "--is-ancestor", earlier, commit], cwd=PROJECT,
        capture_output=True).returncode == 0


def check_chunks(chunks, results, protocol):
    """Refuse chunks of another protocol, or that ran at two commits or an uncommitted tree;
    where the history is whole, chunks that ran at another commit than the one that added
    PROTOCOL, chunk files committed no later than it, and chunk files changed since they
    were committed. CHUNKS: {(seed, side): chunk}, each kept in RESULTS as
    seedN-SIDE.json."""
    foreign = sorted({c["protocol"] for c in chunks.values()} - {protocol})
    if foreign:
        raise UsageError(f"--results {results}: chunks of {foreign[0]}, not of {protocol}")
    commits = sorted({c["commit"] for c in chunks.values()})
    if len(commits) > 1 or commits[0].endswith("+uncommitted"):
        raise UsageError(f"--results {results}: the chunks ran at {', '.join(commits)}; a "
                         "declared test's chunks all run at the protocol's one clean commit")
    declared = protocol_commit(protocol)
    if declared is None:
        return
    if commits[0] != declared:
        raise UsageError(f"--results {results}: the chunks ran at {commits[0][:12]}, not at "
                         f"{declared[:12]}, the commit that added {protocol}")
    touched, changed = history_of(results)
    for seed, side in sorted(chunks):
        path = os.path.realpath(os.path.join(results, f"seed{seed}-{side}.json"))
        if path not in touched:
            continue   # not committed yet
        came = touched[path][-1]
        if not follows(came, declared):
            raise UsageError(f"{path}: committed in {came[:12]}, which does not follow "
                             f"{declared[:12]}, the commit that added {protocol}")
        if len(touched[path]) > 1 or path in changed:
            raise UsageError(f"{path}: changed since it was committed in {came[:12]}; a "
                             "chunk is kept as it was measured")


def report_line(chunks, protocol, results=None):
    """What the history could confirm of CHUNKS (read by check_chunks, which refused what it
    contradicts), and, given their folder RESULTS, which of them no commit holds yet: a
    write-up's numbers rebuild from the repository only once none is left."""
    ran_at = next(iter(chunks.values()))["commit"][:12]
    if protocol_commit(protocol) is None:
        return (f"Provenance: every chunk ran at {ran_at}; not compared with the commit that "
                f"added {protocol}: this checkout has no full git history.")
    line = (f"Provenance (git history): every chunk ran at {ran_at}, the commit that added "
            f"{protocol}, and every chunk file committed so far came after it, unchanged "
            "since.")
    pending = [] if results is None else uncommitted(chunks, results)
    if pending:
        line += (f" Not committed yet: {len(pending)} of {len(chunks)} chunk files "
                 f"({', '.join(pending)}).")
    return line


def uncommitted(chunks, results):
    """The chunk files of CHUNKS, kept in RESULTS, that no commit of this checkout holds."""
    touched, _ = history_of(results)
    names = [f"seed{seed}-{side}.json" for seed, side in sorted(chunks)]
    return [name for name in names
            if os.path.realpath(os.path.join(results, name)) not in touched]
