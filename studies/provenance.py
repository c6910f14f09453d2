"""Where a declared test's chunks came from, asked of the git history.

A declared test (docs/confirm-protocol.md, docs/attribution-protocol.md) is credible only
if its protocol was committed before any of its runs and every run used that commit's
code. A chunk records the commit it ran at (`commit()`); the analysis refuses chunks of an
uncommitted tree or of more commits than were declared, and, where this checkout has its
full history, chunks that ran at any commit but the one that added the protocol, chunk
files committed before the commit they ran at, and chunk files changed since.

An amendment (a document committed after the protocol, docs/attribution-amendment.md) may
move a test's remaining chunks to its own commit on the condition it declares: one chunk
run again there, its bridge, measures exactly what the original measured. The chunks of
its commit are read only beside that bridge (check_bridge).

Without the history (no git, a shallow clone, a copied folder) the analysis says so in its
report rather than passing the check in silence."""
import os
import subprocess
from collections import Counter

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


def check_chunks(chunks, results, protocol, amendments=None):
    """Refuse chunks of another protocol, of an uncommitted tree, or of more commits than
    the protocol and its AMENDMENTS declare; where the history is whole, chunks that ran
    at a commit that added neither, chunks of an amendment's commit whose bridge differs
    from its original (check_bridge), and chunk files committed no later than the commit
    they ran at or changed since (check_kept). CHUNKS: {(seed, side): chunk}, each kept
    in RESULTS as seedN-SIDE.json; AMENDMENTS: {document: (its bridge's path, the bridge
    chunk or None)}."""
    amendments = amendments or {}
    foreign = sorted({c["protocol"] for c in chunks.values()} - {protocol})
    if foreign:
        raise UsageError(f"--results {results}: chunks of {foreign[0]}, not of {protocol}")
    commits = sorted({c["commit"] for c in chunks.values()})
    dirty = [c for c in commits if c.endswith("+uncommitted")]
    if dirty or len(commits) > 1 + len(amendments):
        allowed = "one clean commit" + (" or an amendment's" if amendments else "")
        raise UsageError(f"--results {results}: the chunks ran at {', '.join(commits)}; "
                         f"a declared test's chunks all run at the protocol's {allowed}")
    declared = declared_commits(protocol, amendments)
    if declared is None:
        return
    for (seed, side), chunk in sorted(chunks.items()):
        if chunk["commit"] not in declared:
            raise UsageError(f"--results {results}: seed{seed}-{side} ran at "
                             f"{chunk['commit'][:12]}, not at {declared_at(declared)}")
    for amended, document in list(declared.items())[1:]:
        if any(c["commit"] == amended for c in chunks.values()):
            check_bridge(chunks, document, amended, *amendments[document])
    kept = {os.path.join(results, f"seed{seed}-{side}.json"): chunk
            for (seed, side), chunk in chunks.items()}
    kept.update({path: bridge for path, bridge in amendments.values() if bridge})
    check_kept(kept, results)


def declared_commits(protocol, amendments):
    """{commit: the document it added}: PROTOCOL's, then each amendment's, which must
    come after it; None where the history cannot say (protocol_commit)."""
    first = protocol_commit(protocol)
    if first is None:
        return None
    declared = {first: protocol}
    for document in amendments:
        amended = protocol_commit(document)
        if not follows(amended, first):
            raise UsageError(f"{document}: committed in {amended[:12]}, which does not "
                             f"follow {first[:12]}, the commit that added {protocol}")
        declared[amended] = document
    return declared


def declared_at(declared):
    return " or ".join(f"{commit[:12]}, the commit that added {document}"
                       for commit, document in declared.items())


def check_bridge(chunks, document, amended, path, bridge):
    """An amendment moves a test's remaining chunks to its own commit on one condition,
    declared with it: one chunk run again at that commit (its bridge, kept at PATH)
    measured exactly what its original measured before, every value of `arms`."""
    if bridge is None:
        raise UsageError(f"chunks ran at {amended[:12]}, the commit that added "
                         f"{document}; they are read only beside its bridge, {path}, "
                         "which is missing")
    if bridge["commit"] != amended:
        raise UsageError(f"{path}: ran at {bridge['commit'][:12]}; the bridge of "
                         f"{document} runs at {amended[:12]}, the commit that added it")
    name = f"seed{bridge['seed']}-{bridge['side']}"
    original = chunks.get((bridge["seed"], bridge["side"]))
    if original is None or original["commit"] == amended:
        raise UsageError(f"{path}: bridges {name}, which has no chunk here run before "
                         "the amendment to compare it with")
    differs = first_difference(original["arms"], bridge["arms"])
    if differs:
        raise UsageError(f"{path}: its arms differ from {name}'s at {differs}: chunks of "
                         f"{amended[:12]} do not measure what {original['commit'][:12]} "
                         f"measured, so {document} does not hold")


def first_difference(a, b, where="arms"):
    """The first path at which two JSON values differ (7 and 7.0 do), None if equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                return f"{where}.{key}"
            inner = first_difference(a[key], b[key], f"{where}.{key}")
            if inner:
                return inner
        return None
    return None if a == b and type(a) is type(b) else where


def check_kept(kept, results):
    """Each file of KEPT ({path: chunk}) that a commit holds came after the commit its
    chunk ran at, and is unchanged since."""
    touched, changed = history_of(results)
    for path, chunk in sorted(kept.items()):
        path = os.path.realpath(path)
        if path not in touched:
            continue   # not committed yet
        came = touched[path][-1]
        if not follows(came, chunk["commit"]):
            raise UsageError(f"{path}: committed in {came[:12]}, which does not follow "
                             f"{chunk['commit'][:12]}, the commit it ran at")
        if len(touched[path]) > 1 or path in changed:
            raise UsageError(f"{path}: changed since it was committed in {came[:12]}; a "
                             "chunk is kept as it was measured")


def report_line(chunks, protocol, results=None, amendments=None):
    """What the history could confirm of CHUNKS (read by check_chunks, which refused what
    it contradicts), and, given their folder RESULTS, which of them no commit holds yet:
    a write-up's numbers rebuild from the repository only once none is left."""
    counts = Counter(chunk["commit"] for chunk in chunks.values())
    declared = declared_commits(protocol, amendments or {})
    if declared is None:
        ran = ", ".join(f"{commit[:12]} ({n} chunks)" for commit, n in counts.items())
        if len(counts) == 1:
            ran = next(iter(counts))[:12]
        return (f"Provenance: every chunk ran at {ran}; not compared with the commit "
                f"that added {protocol}: this checkout has no full git history.")
    if list(counts) == list(declared)[:1]:   # the protocol's commit alone
        line = (f"Provenance (git history): every chunk ran at {list(counts)[0][:12]}, "
                f"the commit that added {protocol}, and every chunk file committed so "
                "far came after it, unchanged since.")
    else:
        ran = "; ".join(f"{counts[commit]} at {commit[:12]}, the commit that added "
                        f"{document}{bridged(document, amendments)}"
                        for commit, document in declared.items() if commit in counts)
        line = (f"Provenance (git history): of {len(chunks)} chunks, {ran}; every chunk "
                "file committed so far came after the commit it ran at, unchanged since.")
    pending = [] if results is None else uncommitted(chunks, results)
    if pending:
        line += (f" Not committed yet: {len(pending)} of {len(chunks)} chunk files "
                 f"({', '.join(pending)}).")
    return line


def bridged(document, amendments):
    """The clause saying an amendment's bridge held (check_chunks refused it if not)."""
    if document not in (amendments or {}):
        return ""
    path, _ = amendments[document]
    return (f", whose bridge ({os.path.basename(path)}, run again there) measured "
            "exactly what its original did")


def uncommitted(chunks, results):
    """The chunk files of CHUNKS, kept in RESULTS, that no commit of this checkout holds."""
    touched, _ = history_of(results)
    names = [f"seed{seed}-{side}.json" for seed, side in sorted(chunks)]
    return [name for name in names
            if os.path.realpath(os.path.join(results, name)) not in touched]
