"""``torch.compile`` never runs a graph compiled without DMS's hooks for a model that has them.

torch skips the guard on a module's empty hook dicts by default
(``torch._dynamo.config.skip_nnmodule_hook_guards``): a graph compiled for a plain model was
reused for a model of the same class after :func:`dmscale.prepare` attached its hooks, so the
compiled search ran without any mask (silently the plain model). Regression tests of the three
ways a user meets it.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dmscale as dms
from dmscale.tasks.models import SmallCNN


def _prepared(model: torch.nn.Module, x: torch.Tensor) -> dms.Searcher:
    searcher = dms.prepare(model, x[:1], dms.SearchConfig(resource="macs", target=0.5))
    with torch.no_grad():  # masks far from 1, so a model without them differs
        for a in searcher.structure_parameters():
            a.fill_(0.3)
    return searcher


@pytest.fixture
def setting():
    """A fresh process's compiler state: torch's default (hook guards skipped), nothing compiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=True):
        yield SmallCNN().eval(), torch.randn(4, 1, 28, 28)
    torch._dynamo.reset()


def test_a_plain_model_compiled_first_does_not_lend_its_graph_to_a_prepared_one(setting):
    base, x = setting
    plain, net = copy.deepcopy(base), base
    torch.compile(plain, backend="eager")(x)
    _prepared(net, x)
    eager = net(x)
    assert not torch.allclose(eager, plain(x), atol=1e-3)  # the masks matter
    torch.testing.assert_close(torch.compile(net, backend="eager")(x), eager)


def test_a_model_compiled_then_prepared_in_place_applies_the_masks(setting):
    net, x = setting
    compiled = torch.compile(net, backend="eager")
    before = compiled(x)
    _prepared(net, x)
    eager = net(x)
    assert not torch.allclose(eager, before, atol=1e-3)
    torch.testing.assert_close(compiled(x), eager)


def test_a_plain_teacher_compiled_after_the_student_does_not_replace_its_graph(setting):
    base, x = setting
    teacher, student = copy.deepcopy(base), base
    _prepared(student, x)
    run = torch.compile(student, backend="eager")
    eager = student(x)
    torch.testing.assert_close(run(x), eager)
    torch.testing.assert_close(torch.compile(teacher, backend="eager")(x), teacher(x))
    torch.testing.assert_close(run(x), eager)
    dms.detach(student)  # and without the hooks again, the plain function
    torch.testing.assert_close(run(x), teacher(x))
