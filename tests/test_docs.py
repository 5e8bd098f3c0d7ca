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


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def test_the_api_reference_documents_every_public_name(site: Path):
    html = (site / "api" / "index.html").read_text()
    anchors = set(re.findall(r'id="(dmscale\.[\w.]+)"', html))

    def documented(name: str) -> bool:
        return any(a == f"dmscale.{name}" or a.endswith(f".{name}") for a in anchors)

    missing = [n for n in dms.__all__ if n not in ("deploy", "distributed") and not documented(n)]
    missing += [f"{m}.{n}" for m in ("deploy", "distributed") for n in getattr(dms, m).__all__
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
