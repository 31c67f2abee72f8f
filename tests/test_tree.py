"""The checkout itself: no committed file names a folder of the machine it was made on."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Folders every machine has and example paths use (`--out /tmp/t.json`): not a trace of one machine.
EVERYONE_S = {"/", "/tmp", "/home", "/var", "/usr", "/opt", "/mnt", "/srv"}
# Recorded outputs of runs, kept byte for byte as the runs wrote them (their commands and run folders); and this
# file, whose examples name folders.
RECORDS = ("benchmarks/results/", "tests/test_tree.py")


def machine_folders(repo: Path = REPO, home: Path | None = None) -> list[str]:
    """The absolute folders of this machine a committed file must not name: the top folder the clone lies in
    and the home folder, each with its trailing slash.

    >>> machine_folders(Path("/builds/wt/x"), Path("/Users/ana"))
    ['/Users/ana/', '/builds/']
    >>> machine_folders(Path("/home/ana/src/annotated"), Path("/home/ana"))
    ['/home/ana/']
    """
    home = Path.home() if home is None else home
    top = Path(*repo.resolve().parts[:2])
    return sorted({f"{p}/" for p in (top, home) if str(p) not in EVERYONE_S})


def tracked_text_files(repo: Path = REPO) -> list[Path]:
    names = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, check=True).stdout
    files = [repo / n for n in names.decode().split("\0") if n and not n.startswith(RECORDS)]
    return [f for f in files if f.is_file() and b"\0" not in f.read_bytes()[:8192]]


def test_no_committed_file_names_a_folder_of_this_machine():
    """Captions, docs, results and code say a checkpoint as typed (`shipped:de-en`, runs/...), never where this
    clone lies; benchmarks/results/ keeps the commands its runs recorded."""
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    folders = machine_folders()
    hits = [
        f"{f.relative_to(REPO)}:{n}: {line.strip()[:120]}"
        for f in tracked_text_files()
        for n, line in enumerate(f.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if any(folder in line for folder in folders)
    ]
    assert hits == [], f"absolute paths of this machine ({', '.join(folders)}) in committed files:\n" + "\n".join(hits)


# The last commit written before the rule below; every later subject keeps to it.
SUBJECTS_RULE_FROM = "fe8c498"


def test_commit_subjects_fit_72_characters():
    """CONTRIBUTING's habit, checked for every commit after the rule began: a subject of at most 72 characters,
    the details in the body (so `git log --oneline` and every review tool show whole subjects)."""
    log = subprocess.run(
        ["git", "-C", str(REPO), "log", "--format=%h %s", f"{SUBJECTS_RULE_FROM}..HEAD"], capture_output=True, text=True
    )
    if log.returncode != 0:
        pytest.skip(f"commit {SUBJECTS_RULE_FROM} is not in this clone's history (a shallow clone or an archive)")
    long = [line for line in log.stdout.splitlines() if len(line.split(" ", 1)[1]) > 72]
    assert not long, "subjects over 72 characters (shorten with git commit --amend):\n" + "\n".join(long)
