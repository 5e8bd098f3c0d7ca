"""The built-in tasks of the ``dmscale`` command and their models.

:mod:`.registry` holds the :class:`~dmscale.tasks.registry.Task` base class and the tables
``--task`` and ``--model`` are looked up in; it imports no task. Each task module registers
itself (``@register_task``, ``@register_models``) and this package imports them all, so
``import dmscale.tasks`` is what makes the built-ins available: image classification
(:mod:`.image` in memory, :mod:`.imagefolder` read lazily through a DataLoader), detection
(:mod:`.detect`), character-level language modelling (:mod:`.language`), text files with a
Hugging Face model (:mod:`.text`, :mod:`.hf_model`), the user's own ``--model module:factory``
(:mod:`.user_models`); plain reference models live in :mod:`.models`, distillation terms in
:mod:`.distill`, the weights a run starts from (``--weights``, ``--pretrained``) in
:mod:`.start_weights` and :mod:`.pretrained`.

Layer rule: ``tasks`` imports :mod:`dmscale.config`, :mod:`dmscale.integrations`,
:mod:`dmscale.data` and the layers below; only :mod:`dmscale.run` and the CLI import it.
"""

from dmscale.tasks import detect, hf_model, image, imagefolder, instruct, language, text, user_models  # noqa: F401  (they register themselves)

__all__: list[str] = []
