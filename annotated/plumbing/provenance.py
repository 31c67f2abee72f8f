"""Where a result came from: the interpreter, the machine, every installed package and the code's commit.

`make` installs `requirements.lock` (every package pinned, with hashes), so two runs whose `packages` agree ran
the same code of every library; `results.json` and the shipped models' cards carry this record.

>>> env = environment()
>>> env["packages"]["torch"] == __import__("torch").__version__
True
>>> sorted(env)
['commit', 'cpu', 'machine', 'packages', 'python']
"""

from __future__ import annotations

import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def installed_packages() -> dict[str, str]:
    """{distribution name (lower case): version} of every package this interpreter can import."""
    found = {dist.metadata["Name"].lower(): dist.version for dist in metadata.distributions() if dist.metadata["Name"]}
    return dict(sorted(found.items()))


def code_commit(root: Path = ROOT) -> str | None:
    """The checkout's commit, with "+changes" when tracked files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+changes" if dirty else "")


def cpuinfo(key: str, path: Path = Path("/proc/cpuinfo")) -> str | None:
    """The value of the first CPU's `key` line in /proc/cpuinfo; None where there is no such file or line."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    return next((line.partition(":")[2].strip() for line in lines if line.startswith(key)), None)


def environment() -> dict:
    """The record a result carries: python, machine, cpu, packages (every one, with its version), commit."""
    return {
        "python": sys.version.split()[0],
        "machine": f"{platform.system()} {platform.machine()}",
        "cpu": cpuinfo("model name") or platform.processor() or platform.machine(),
        "packages": installed_packages(),
        "commit": code_commit(),
    }
