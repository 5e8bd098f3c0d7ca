"""``dmscale.errors``: every error class, each a :class:`DMScaleError` and the built-in a user
catches; and no bare ``raise ValueError`` left in the package (a refusal names its class)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import dmscale as dms
import dmscale.core.errors as core_errors
import dmscale.errors as public_errors

SRC = Path(dms.__file__).parent
BARE = re.compile(r"\braise\s+ValueError\b")

DEFINED = {name: obj for name, obj in vars(core_errors).items()
           if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == core_errors.__name__}

# the built-in each class derives from besides DMScaleError (ValueError for the rest)
BUILTIN = {"MissingDependencyError": ImportError, "WriteError": OSError, "MissingFileError": FileNotFoundError}


def bare_value_errors(root: Path) -> list[str]:
    """``path:line`` of every ``raise ValueError`` in the Python files under ``root``."""
    return [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if BARE.search(line)]


def test_no_bare_value_error_in_the_package():
    assert bare_value_errors(SRC) == []


def test_the_grep_finds_a_bare_value_error(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "mod.py").write_text("def f(x):\n    if x:\n        raise ValueError('x')\n")
    (tmp_path / "ok.py").write_text("class E(ValueError):\n    pass\n\n\ndef g():\n    raise E('y')\n")
    assert bare_value_errors(tmp_path) == ["pkg/mod.py:3"]


def test_star_import_gives_every_class():
    names: dict[str, object] = {}
    exec("from dmscale.errors import *", names)  # noqa: S102 - the statement users write
    got = {n for n in names if not n.startswith("__")}
    assert got == set(DEFINED) == set(public_errors.__all__) == set(core_errors.__all__)
    assert all(names[n] is DEFINED[n] for n in DEFINED)


@pytest.mark.parametrize("name", sorted(DEFINED))
def test_each_class_is_a_dmscale_error_and_the_builtin_that_fits(name):
    cls = DEFINED[name]
    assert issubclass(cls, dms.DMScaleError)
    if name == "DMScaleError":
        assert cls.__bases__ == (Exception,)  # not a ValueError: an ImportError or OSError child must not be one
        return
    builtin = BUILTIN.get(name, ValueError)
    assert issubclass(cls, builtin)
    if name in ("MissingDependencyError", "WriteError"):
        assert not issubclass(cls, ValueError)  # `except ValueError` does not swallow them
    err = cls("the message")
    assert str(err) == "the message"


def test_write_and_dependency_errors_are_caught_as_the_builtin():
    with pytest.raises(OSError, match="disk full"):
        raise public_errors.WriteError("disk full")
    with pytest.raises(ImportError, match="pip install"):
        raise public_errors.MissingDependencyError("pip install 'dmscale[deploy]'")
    with pytest.raises(FileNotFoundError):
        raise public_errors.MissingFileError("no such file")


def test_errors_is_a_public_namespace():
    assert dms.errors is public_errors
    assert dms.DMScaleError is public_errors.DMScaleError
