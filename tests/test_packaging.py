"""What ``pip install polymq`` installs: the ``polymq`` namespace and nothing else at
top level, and a wheel that works on its own, away from the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ONE_FORM = True  # builds a wheel; starts no server
ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("gateway", "storage", "protocols", "nameserver", "navigation", "conformance")


def _wheel(tmp_path: Path) -> Path:
    """A wheel built from a copy of the repository's files (tracked or not, unless
    ignored): setuptools reuses a build/ folder in the source tree, whose stale files
    would hide a package missing from pyproject.toml."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    ).stdout.decode()
    source = tmp_path / "source"
    for name in filter(None, listed.split("\0")):
        origin = ROOT / name
        if origin.is_file() and not origin.is_symlink():
            target = source / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--quiet",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("polymq-*.whl")
    return wheel


def test_the_wheel_installs_only_polymq_and_imports_on_its_own(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        tops = {name.split("/")[0] for name in names}
        assert {t for t in tops if not t.endswith(".dist-info")} == {"polymq"}
        assert not any(name == "polymq/__init__.py" for name in names)  # a namespace
        packaged = {name.split("/")[1] for name in names if name.startswith("polymq/")}
        assert packaged == set(FOLDERS)
        # every package folder of the repository is in the wheel (pyproject lists them)
        for init in ROOT.glob("*/**/__init__.py"):
            relative = init.relative_to(ROOT)
            if relative.parts[0] in FOLDERS and "node_modules" not in relative.parts:
                assert f"polymq/{relative.as_posix()}" in names
        entry_points = archive.read(
            next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        ).decode()
        assert "polymq = polymq.gateway.cli:main" in entry_points
        archive.extractall(tmp_path / "site")
    # The unpacked wheel alone (plus the dependencies already installed), run from a
    # folder outside the repository: the product imports, the old names do not.
    probe = (
        "import sys; sys.path = [p for p in sys.path if p not in ('', {!r})]\n"
        "sys.path.insert(0, {!r})\n"
        "import polymq.storage, polymq.gateway.cli, polymq.protocols.kafka\n"
        "assert polymq.gateway.cli.__file__.startswith({!r}), polymq.gateway.cli.__file__\n"
        "import importlib.util\n"
        "assert all(importlib.util.find_spec(n) is None for n in {!r})\n"
    ).format(str(ROOT), str(tmp_path / "site"), str(tmp_path / "site"), FOLDERS)
    subprocess.run([sys.executable, "-I", "-c", probe], check=True, cwd=tmp_path, timeout=120)
