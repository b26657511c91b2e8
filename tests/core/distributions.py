"""Installed-looking distributions for tests: a package plus a ``*.dist-info`` folder with
``METADATA`` (name, version, optional summary) and ``entry_points.txt`` of any groups."""

from __future__ import annotations

from pathlib import Path


def write_distribution(site: Path, dist: str, package: str, source: str,
                       groups: dict[str, dict[str, str]], summary: str | None = None) -> Path:
    """Write package ``package`` (``__init__.py`` = ``source``) and distribution ``dist``
    declaring ``groups`` ({"tk.tasks": {"name": "pkg:obj"}, "tk.commands": {...}}) into ``site``."""
    (site / package).mkdir(parents=True, exist_ok=True)
    (site / package / "__init__.py").write_text(source)
    # wheel naming: the folder name escapes "-" (importlib.metadata reads the name from it)
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir(exist_ok=True)
    meta = f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n"
    (info / "METADATA").write_text(meta + (f"Summary: {summary}\n" if summary else ""))
    text = ""
    for group, entries in groups.items():
        text += f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items())
    (info / "entry_points.txt").write_text(text)
    return site
