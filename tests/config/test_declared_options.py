"""An option of the search is declared once, on its :class:`~dmscale.SearchConfig` field.

The test adds one field (with its option metadata) to ``search/config.py`` in a copy of the
package, changes no other file, and finds the option in ``dmscale search --help``, in
``--print-config``, in the run's ``config.yaml``, in the searcher's configuration of a
resumed run and in the refusal to change it on resume.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import dmscale
from dmscale.config.declare import _Place, _table
from dmscale.config.options import OPTIONS
from dmscale.config.run_config import RunConfig
from dmscale.core.errors import ConfigError
from dmscale.core.options import declared_options
from dmscale.search.config import SearchConfig

PACKAGE = Path(dmscale.__file__).parent
ANCHOR = "    targets: dict[str, float] | None = None\n"
NEW_FIELD = ('    probe_knob: float = field(default=0.0, metadata=_search(\n'
             '        convert=nonneg_float, metavar="X", help="a probe option declared on SearchConfig alone"))\n')

# runs in the copy: help, print-config, a search stopped after 2 steps, a refused resume, a resume
SCRIPT = r"""
import contextlib, io, json, sys, torch
from dmscale.cli import main
from dmscale.config.run_config import load_run_config

run = sys.argv[1]
tiny = ["--task", "digits", "--model", "smallcnn", "--model-args", "width=4,blocks=1", "--train-limit",
        "128", "--test-limit", "64", "--batch-size", "64", "--threads", "1", "--epochs", "4",
        "--retrain-epochs", "0", "--quiet"]

def call(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as stop:
            rc = stop.code
    return rc, out.getvalue(), err.getvalue()

found = {"help": call("search", "--help")[1],
         "print": call("search", *tiny, "--probe-knob", "0.25", "--print-config")[1]}
found["first"] = call("search", *tiny, "--probe-knob", "0.25", "--stop-after", "2", "--out", run)[0]
found["config_yaml"] = open(run + "/config.yaml").read()
found["refused"] = call("search", "--resume", run, "--probe-knob", "0.5")[:3:2]
found["resumed"] = call("search", "--resume", run, "--stop-after", "4")[0]
ck = torch.load(run + "/checkpoint.pt", weights_only=False)
found["searcher"] = ck["searcher"]["config"].get("probe_knob")
found["step"] = ck["step"]
found["loaded"] = load_run_config(run).probe_knob
print(json.dumps(found))
"""


def _copy_with_field(tmp_path: Path) -> Path:
    """A copy of the package whose search/config.py declares one more field; nothing else changed."""
    root = tmp_path / "src"
    shutil.copytree(PACKAGE, root / "dmscale", ignore=shutil.ignore_patterns("__pycache__"))
    config = root / "dmscale" / "search" / "config.py"
    text = config.read_text(encoding="utf-8")
    assert text.count(ANCHOR) == 1
    config.write_text(text.replace(ANCHOR, ANCHOR + NEW_FIELD), encoding="utf-8")
    return root


def _changed_files(a: Path, b: Path) -> list[str]:
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__"])
    out = [str(Path(cmp.left).relative_to(a) / n) for n in cmp.diff_files + cmp.left_only + cmp.right_only]
    stack = list(cmp.subdirs.values())
    while stack:
        sub = stack.pop()
        out += [str(Path(sub.left).relative_to(a) / n) for n in sub.diff_files + sub.left_only + sub.right_only]
        stack += list(sub.subdirs.values())
    return sorted(out)


def test_a_field_added_to_searchconfig_is_an_option_everywhere(tmp_path: Path) -> None:
    root = _copy_with_field(tmp_path)
    assert _changed_files(PACKAGE, root / "dmscale") == ["search/config.py"]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert "--probe-knob X" in found["help"] and "a probe option declared on SearchConfig alone" in found["help"]
    entry = found["help"].split("\n  --probe-knob", 1)[1].split("\n  --", 1)[0]  # its lines in --help
    assert "(default: 0.0)" in entry
    assert "probe-knob: 0.25" in found["print"].splitlines()
    assert found["first"] == 0 and "probe_knob: 0.25" in found["config_yaml"].splitlines()
    rc, err = found["refused"]
    assert rc == 2 and "--probe-knob (run: 0.25, now: 0.5)" in err
    assert found["resumed"] == 0 and found["step"] == 4
    assert found["searcher"] == 0.25 and found["loaded"] == 0.25


def test_every_searchconfig_option_reaches_the_run_config_and_back() -> None:
    """Each declared field is an option, a RunConfig field, and comes back into the SearchConfig
    a run builds (by name: a value other than the default survives the round trip)."""
    declared = declared_options(SearchConfig)
    assert {o.name for o in declared} <= {o.name for o in OPTIONS}
    changed = {"resource": "params", "target": 0.3, "resource_weight": 2.0, "schedule": "constant",
               "schedule_end": 0.5, "importance": "snip", "min_width": 2, "width_step": 2, "align": 4,
               "width_only_from": 0.7, "cost_forward": "exact", "settle": 0.2, "settle_hold": False,
               "budget_band": (0.9, 1.0), "layer_uniform": True, "fuse_norms": True, "depth_unit": "sublayer"}
    assert set(changed) | {"exclude"} == {o.name for o in declared}
    scfg = RunConfig(**changed).search_config(["conv1"])
    assert {k: getattr(scfg, k) for k in changed} == changed and scfg.exclude == ["conv1"]
    several = RunConfig(target={"params": 0.7, "kv_cache": 0.5}).resolved().search_config([])
    assert several.budgets == {"params": 0.7, "kv_cache": 0.5} and several.resource == "params"
    width_only = RunConfig(search_dims="width").resolved().search_config([])
    assert (width_only.search_width, width_only.search_depth) == (True, False)


def test_the_table_places_declared_options_and_appends_new_ones() -> None:
    declared = declared_options(SearchConfig)
    rows = (_Place("target"),)
    table = _table(rows, declared)
    assert table[0].name == "target" and len(table) == len(declared)
    by_group = [o.group for o in table]
    assert by_group.index("run") > by_group.index("search")  # fuse_norms: after the search group
    with pytest.raises(ConfigError, match="does not declare"):
        _table((_Place("no_such_option"),), declared)
