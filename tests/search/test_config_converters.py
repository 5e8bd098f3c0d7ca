"""Every option of :class:`~dmscale.SearchConfig` has one validation, its converter: the library
refuses exactly what the converter (the command line's and the config file's check) refuses,
with an error that names the field, and keeps the converted value."""

from __future__ import annotations

from dataclasses import fields

import pytest

import dmscale as dms
from dmscale.core.errors import ConfigError
from dmscale.search.config import _BUDGET_FIELDS, _converter

# values of every kind a user might pass by mistake (or on purpose, as a config file spells them)
PROBES = (None, True, False, 0, 1, 3, -2, 0.0, 0.5, 1.0, 1.5, -0.1, float("nan"), "", "auto", "yes", "0.5",
          "8", "exp", "taylor", "soft", "block", "layer1,layer2", ["layer1"], (0.9, 1.0), object())

CONVERTED = [f for f in fields(dms.SearchConfig) if _converter(f) is not None and f.name not in _BUDGET_FIELDS]


def test_the_options_with_a_converter_are_the_fields_that_need_one() -> None:
    names = {f.name for f in CONVERTED}
    assert {"schedule", "settle", "settle_hold", "align", "min_width", "fuse_norms", "width_temperature",
            "gate_factory", "verify", "keep_width"} <= names
    # the budget fields are validated together, once, by Budgets.of
    assert not names & set(_BUDGET_FIELDS)


@pytest.mark.parametrize("f", CONVERTED, ids=lambda f: f.name)
def test_the_library_refuses_what_the_converter_refuses(f) -> None:
    convert = _converter(f)
    for value in PROBES:
        if value is None and f.default is None:
            assert getattr(dms.SearchConfig(**{f.name: None}), f.name) is None
            continue
        try:
            want = convert(value)
        except ConfigError as err:
            with pytest.raises(ConfigError, match=f"^{f.name}: ") as got:
                dms.SearchConfig(**{f.name: value})
            assert str(err) in str(got.value)
            continue
        if want is None and f.default is not None:  # an option's auto: a run resolves it, the library needs the value
            with pytest.raises(ConfigError, match=f"^{f.name}: expected a value"):
                dms.SearchConfig(**{f.name: value})
            continue
        assert getattr(dms.SearchConfig(**{f.name: value}), f.name) == want, (f.name, value)
