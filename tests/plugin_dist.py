"""Install a plugin project (a folder with ``pyproject.toml``) for tests, without pip.

``install_metadata`` does what an editable install leaves behind: a ``*.dist-info``
folder whose ``METADATA`` and ``entry_points.txt`` come from the project's
``pyproject.toml``, in a site folder; with the site and the project folder on
``sys.path`` (or ``PYTHONPATH``), ``importlib.metadata`` finds its entry points and the
package imports from the project's source. ``build_wheel`` runs the real build
(``pip wheel --no-deps --no-build-isolation``) to check the packaging itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path


def install_metadata(project: Path, site: Path) -> dict:
    """Write ``<dist>-<version>.dist-info`` for ``project`` into ``site``; returns ``[project]`` of pyproject."""
    meta = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n"
                                   f"Summary: {meta.get('description', '')}\n", encoding="utf-8")
    text = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n"
                   for group, entries in meta.get("entry-points", {}).items())
    (info / "entry_points.txt").write_text(text, encoding="utf-8")
    return meta


def build_wheel(project: Path, out: Path) -> zipfile.ZipFile:
    """Build ``project``'s wheel with pip (no dependencies, no isolation: offline) into ``out``."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(project)], check=True, capture_output=True, text=True)
    (wheel,) = out.glob("*.whl")
    return zipfile.ZipFile(wheel)


def subprocess_env(*paths: Path) -> dict[str, str]:
    """The environment for a child Python that sees ``paths`` and this process's ``sys.path`` (tk's shim)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), *[p for p in sys.path if p]])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def pip_editable(project: Path, prefix: Path) -> Path:
    """``pip install --no-deps --no-build-isolation -e project`` into ``prefix`` (not this
    environment); returns the site-packages folder to hand to ``site.addsitedir``."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--prefix",
                    str(prefix), "-e", str(project)], check=True, capture_output=True, text=True)
    (site_packages,) = prefix.glob("lib/python*/site-packages")
    return site_packages
