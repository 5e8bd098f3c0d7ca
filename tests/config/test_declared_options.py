"""An option is declared once, on its field: an option of the search on its
:class:`~dmscale.SearchConfig` field, any other option of the run on its field of
:class:`~dmscale.config.run_config.RunConfig` (declared in ``config/options.py``).

Each test adds one field (with its option metadata) to ``search/config.py`` or
``config/options.py`` in a copy of the package, changes no other file, and finds the option in
``dmscale search --help``, in ``--print-config``, in the run's ``config.yaml``, in the refusal
to change it on resume and in the resumed run (for the search's option: in the searcher's
configuration too).
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

import dmscale
from dmscale.cli.parser import INSPECT_OPTIONS
from dmscale.config.declare import (RESUME_MUTABLE_KEY, _Place, _table, flagged, run_option, searched,
                                    with_search_options)
from dmscale.config.options import OPTIONS, RESUME_MUTABLE
from dmscale.config.run_config import TASK_FIELDS, RunConfig
from dmscale.core.errors import ConfigError
from dmscale.core.options import declared_options
from dmscale.core.values import positive_int
from dmscale.search.config import SearchConfig

PACKAGE = Path(dmscale.__file__).parent
ANCHOR = '             "residual stream); comma-separated or repeated"))\n'
NEW_FIELD = ('    probe_knob: float = field(default=0.0, metadata=_search(\n'
             '        convert=nonneg_float, metavar="X", help="a probe option declared on SearchConfig alone"))\n')
# a run option of the training group, declared on RunConfig's fields (after --warmup)
RUN_ANCHOR = '        help="fraction of each phase with a linear learning-rate warm-up. auto: 0.02")\n'
NEW_RUN_FIELD = ('    probe_run: float = run_option(\n'
                 '        0.0, convert=nonneg_float, metavar="X", commands=_ALL_TRAIN, group="training",\n'
                 '        help="a probe option declared on RunConfig alone")\n')

# runs in the copy: help, print-config, a search stopped after 2 steps, a refused resume, a resume
SCRIPT = r"""
import contextlib, io, json, sys, torch
from dmscale.cli import main
from dmscale.config.run_config import load_run_config

run, flag = sys.argv[1], sys.argv[2]
key = flag[2:].replace("-", "_")
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
         "print": call("search", *tiny, flag, "0.25", "--print-config")[1]}
found["first"] = call("search", *tiny, flag, "0.25", "--stop-after", "2", "--out", run)[0]
found["config_yaml"] = open(run + "/config.yaml").read()
found["refused"] = call("search", "--resume", run, flag, "0.5")[:3:2]
found["resumed"] = call("search", "--resume", run, "--stop-after", "4")[0]
ck = torch.load(run + "/checkpoint.pt", weights_only=False)
found["searcher"] = ck["searcher"]["config"].get(key)
found["step"] = ck["step"]
found["loaded"] = getattr(load_run_config(run), key)
print(json.dumps(found))
"""


def _copy_with_field(tmp_path: Path, module: str = "search/config.py", anchor: str = ANCHOR,
                     new_field: str = NEW_FIELD) -> Path:
    """A copy of the package whose ``module`` declares one more field; nothing else changed."""
    root = tmp_path / "src"
    shutil.copytree(PACKAGE, root / "dmscale", ignore=shutil.ignore_patterns("__pycache__"))
    config = root / "dmscale" / module
    text = config.read_text(encoding="utf-8")
    assert text.count(anchor) == 1
    config.write_text(text.replace(anchor, anchor + new_field), encoding="utf-8")
    return root


def _run_script(tmp_path: Path, root: Path, flag: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "run"), flag], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


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
    found = _run_script(tmp_path, root, "--probe-knob")
    assert "--probe-knob X" in found["help"] and "a probe option declared on SearchConfig alone" in found["help"]
    entry = found["help"].split("\n  --probe-knob", 1)[1].split("\n  --", 1)[0]  # its lines in --help
    assert "(default: 0.0)" in entry
    assert "probe-knob: 0.25" in found["print"].splitlines()
    assert found["first"] == 0 and "probe_knob: 0.25" in found["config_yaml"].splitlines()
    rc, err = found["refused"]
    assert rc == 2 and "--probe-knob (run: 0.25, now: 0.5)" in err
    assert found["resumed"] == 0 and found["step"] == 4
    assert found["searcher"] == 0.25 and found["loaded"] == 0.25


def test_a_field_added_to_the_run_options_is_an_option_everywhere(tmp_path: Path) -> None:
    """The same for an option of the run: one field in ``config/options.py``, nothing else."""
    root = _copy_with_field(tmp_path, "config/options.py", RUN_ANCHOR, NEW_RUN_FIELD)
    assert _changed_files(PACKAGE, root / "dmscale") == ["config/options.py"]
    found = _run_script(tmp_path, root, "--probe-run")
    assert "--probe-run X" in found["help"] and "a probe option declared on RunConfig alone" in found["help"]
    entry = found["help"].split("\n  --probe-run", 1)[1].split("\n  --", 1)[0]
    assert "(default: 0.0)" in entry
    training = found["help"].split("\ntraining:\n", 1)[1].split("\n\n", 1)[0]  # its help group
    assert "--probe-run" in training
    assert "probe-run: 0.25" in found["print"].splitlines()
    assert found["first"] == 0 and "probe_run: 0.25" in found["config_yaml"].splitlines()
    rc, err = found["refused"]
    assert rc == 2 and "--probe-run (run: 0.25, now: 0.5)" in err
    assert found["resumed"] == 0 and found["step"] == 4
    assert found["searcher"] is None and found["loaded"] == 0.25  # a run option, not the searcher's


def test_every_searchconfig_option_reaches_the_run_config_and_back() -> None:
    """Each declared field is an option, a RunConfig field, and comes back into the SearchConfig
    a run builds (by name: a value other than the default survives the round trip)."""
    declared = declared_options(SearchConfig)
    assert {o.name for o in declared} <= {o.name for o in OPTIONS}
    changed = {"resource": "params", "target": 0.3, "resource_weight": 2.0, "schedule": "constant",
               "schedule_end": 0.5, "importance": "snip", "min_width": 2, "width_step": 2, "align": 4,
               "width_only_from": 0.7, "cost_forward": "exact", "settle": 0.2, "settle_hold": False,
               "budget_band": (0.9, 1.0), "layer_uniform": True, "fuse_norms": True, "depth_unit": "sublayer",
               "keep_depth": ["layer1.0"], "keep_width": ["residual"]}
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


def test_what_resume_retrain_and_inspect_take_is_declared_on_the_fields() -> None:
    """The options a resume may change, those a retrain takes from its search run and those of
    ``dmscale inspect`` are flags of their declarations (they were hand lists)."""
    assert RESUME_MUTABLE == {"stop_after", "checkpoint_every", "device", "threads", "workers", "quiet", "out",
                              "fuse_norms", "lm_eval", "lm_eval_data", "lm_eval_limit", "ppl", "ppl_protocol",
                              "ppl_limit",  # the LLM evaluation at the end: it changes no step
                              "search_trace"}  # what the search records, not what it computes
    assert set(TASK_FIELDS) == {"task", "data", "val_data", "text_field", "train_limit", "test_limit", "image_size",
                                "image_augment", "auto_augment", "augment", "seq_len", "model", "model_args",
                                "expand", "task_info", "seed", "prompt_format", "loss_on"}
    assert set(INSPECT_OPTIONS) == {
        "task", "data", "val_data", "text_field", "train_limit", "test_limit", "image_size", "seq_len", "model",
        "model_args", "expand", "resource", "target", "search_dims", "min_width", "width_step", "align", "exclude",
        "layer_uniform", "depth_unit", "keep_depth", "keep_width", "seed", "device", "threads", "out", "quiet", "batch_size", "pipeline",
        "optimizer", "precision", "shard", "teacher", "distill_weight", "distill_hidden", "prompt_format", "loss_on"}


def test_a_run_option_is_declared_once_and_the_options_follow_the_other_fields() -> None:
    declared = declared_options(SearchConfig)
    own = run_option(1, convert=positive_int, help="a run option", commands=("search",), group="data")

    def make(**body: object) -> type:
        return dataclass(with_search_options(declared)(
            type("Run", (), {"__annotations__": {k: "Any" for k in body}, **body})))

    run = make(command="search", seed=own, target=searched(resume_mutable=True))
    assert [f.name for f in fields(run)][:4] == ["command", "seed", "target", "resource"]  # its group next
    assert declared_options(run)[1] is next(o for o in declared if o.name == "target")
    assert flagged(run, RESUME_MUTABLE_KEY) == ("target",) and run().target == 0.5
    with pytest.raises(ConfigError, match="on the run configuration and on SearchConfig"):
        make(target=run_option(0.5, convert=positive_int, help="again", commands=("search",), group="search"))
    with pytest.raises(ConfigError, match="is not an option and follows the options"):
        make(seed=own, note=None)
