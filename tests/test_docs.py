"""The documentation: the site builds with ``mkdocs build --strict`` (no broken link), the API
reference documents every public name, the README stays short and its links resolve."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dmscale as dms

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300


def build_site(out: Path, config: Path = ROOT / "mkdocs.yml") -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of ``config`` into ``out``. Not ``-q``: quiet mode hides the
    warnings that ``--strict`` counts, and a broken link would then build."""
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config),
                           "-d", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build_site(out)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_the_site_build_fails_on_a_broken_link(tmp_path: Path):
    """The check itself can fail: the same build of the docs with one broken link added."""
    import shutil

    import yaml

    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    page = docs / "errors.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no_such_page.md).\n")
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config["docs_dir"] = str(docs)
    config["hooks"] = [str(ROOT / h) for h in config.get("hooks", [])]
    config["plugins"] = ["search"]  # the API reference plays no part in links
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = build_site(tmp_path / "site", tmp_path / "mkdocs.yml")
    assert done.returncode != 0
    assert "no_such_page.md" in done.stdout + done.stderr


def test_the_api_reference_documents_every_public_name(site: Path):
    html = (site / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="(dmscale\.[\w.]+)"', html))

    def documented(name: str) -> bool:
        return any(a == f"dmscale.{name}" or a.endswith(f".{name}") for a in anchors)

    modules = ("deploy", "distributed", "errors")
    missing = [n for n in dms.__all__ if n not in modules and not documented(n)]
    missing += [f"{m}.{n}" for m in modules for n in getattr(dms, m).__all__
                if not documented(n) and not n.isupper()]
    assert missing == []


def test_every_page_is_in_the_navigation(site: Path):
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    built = {p.parent.name if p.parent != site else "index" for p in site.rglob("index.html")}
    assert pages <= built | {"index"}


def test_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for target in re.findall(r"\]\(([^)\s#]+)\)", text):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target).exists(), target
