"""Instruction data (Alpaca's format) for ``--task text``: records read, checked and rendered
as prompt and response text.

A file of instruction records is a JSON array (``alpaca_data.json``, ``alpaca_5000.json``) or
JSON Lines, each record an object with ``instruction`` and ``output`` strings and an optional
``input`` string (empty or absent: no input). A record without them is refused with its index.
:func:`is_instruction_file` tells such a file from a file of documents (JSON Lines whose
records have the text field instead).

Rendering (:func:`render`): ``alpaca`` is Stanford Alpaca's prompt template (the one
LLM-Pruner and the DMS paper finetune with), the response being the record's output; ``chat``
is the tokenizer's own chat template with the instruction (and the input after a blank line)
as the user's turn and the output as the assistant's, the prompt ending where the assistant's
turn starts (``add_generation_prompt=True``).

Example:
    >>> prompt, response = render({"instruction": "Add 2 and 2.", "input": "", "output": "4"}, "alpaca")
    >>> print(prompt + response)
    Below is an instruction that describes a task. Write a response that appropriately completes the request.
    <BLANKLINE>
    ### Instruction:
    Add 2 and 2.
    <BLANKLINE>
    ### Response:
    4
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dmscale.core.errors import DataError

__all__ = ["ALPACA_PROMPT", "ALPACA_PROMPT_NO_INPUT", "PROMPT_FORMATS", "read_instructions",
           "is_instruction_file", "render"]

# Stanford Alpaca's templates (its train.py PROMPT_DICT)
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
PROMPT_FORMATS = ("auto", "alpaca", "chat")
_FIELDS = ("instruction", "output")


def _first_record(path: Path) -> Any:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                try:
                    return json.loads(line)
                except ValueError:
                    return None
    return None


def is_instruction_file(data: str | None) -> bool:
    """Whether ``--data`` names a file of instruction records: a ``.json`` file that starts as
    a JSON array and names an ``instruction`` field in its first 64 KiB, or a ``.jsonl`` file
    whose first record has ``instruction`` and ``output``."""
    if not data:
        return False
    p = Path(data).expanduser()
    if not p.is_file():
        return False
    if p.suffix.lower() == ".json":
        with open(p, encoding="utf-8", errors="replace") as fh:
            head = fh.read(1 << 16)
        return head.lstrip().startswith("[") and '"instruction"' in head
    first = _first_record(p) if p.suffix.lower() == ".jsonl" else None
    return isinstance(first, dict) and all(k in first for k in _FIELDS)


def read_instructions(path: str | Path) -> list[dict[str, str]]:
    """The records of an instruction file, each ``{"instruction", "input", "output"}``.

    Raises:
        DataError: not JSON, not a list of objects, or a record without a string
            ``instruction`` / ``output`` (naming its index), or no record at all.
    """
    p = Path(path).expanduser()
    try:
        if p.suffix.lower() == ".jsonl":
            rows = [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            rows = json.loads(p.read_text(encoding="utf-8"))
    except ValueError as err:
        raise DataError(f"--data {p}: not JSON ({err}); instruction data is a JSON array or JSON Lines "
                        "of {\"instruction\", \"input\", \"output\"} records") from None
    if not isinstance(rows, list) or not rows:
        raise DataError(f"--data {p}: expected a non-empty JSON array of instruction records, got "
                        f"{type(rows).__name__ if not isinstance(rows, list) else 'an empty array'}")
    out = []
    for i, row in enumerate(rows):
        bad = [k for k in _FIELDS if not isinstance(row, dict) or not isinstance(row.get(k), str)]
        if bad or (isinstance(row, dict) and not isinstance(row.get("input", ""), str)):
            have = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"--data {p}: record {i} has no string {' / '.join(bad or ['input'])} (its fields: "
                            f"{have}); every record needs 'instruction' and 'output' strings, 'input' optional")
        out.append({"instruction": row["instruction"], "input": row.get("input") or "", "output": row["output"]})
    return out


def render(record: dict[str, str], prompt_format: str, tokenizer: Any = None) -> tuple[str, str]:
    """``(prompt, response)`` text of ``record`` in ``prompt_format`` (``alpaca`` or
    ``chat``, see the module docs); ``chat`` needs the tokenizer with its chat template.

    Raises:
        DataError: ``chat`` and the tokenizer has no chat template, or the template renders
            the prompt as something other than the start of the whole conversation.
    """
    if prompt_format == "alpaca":
        template = ALPACA_PROMPT if record["input"] else ALPACA_PROMPT_NO_INPUT
        return template.format(**record), record["output"]
    if prompt_format != "chat":
        raise DataError(f"prompt_format must be 'alpaca' or 'chat', got {prompt_format!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError("--prompt-format chat: the tokenizer has no chat template; use --prompt-format alpaca")
    user = record["instruction"] + (f"\n\n{record['input']}" if record["input"] else "")
    turns = [{"role": "user", "content": user}]
    prompt = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    whole = tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": record["output"]}],
                                          tokenize=False)
    if not whole.startswith(prompt):
        raise DataError("--prompt-format chat: the tokenizer's chat template does not render the prompt as the "
                        "start of the conversation, so the response cannot be told apart; use --prompt-format alpaca")
    return prompt, whole[len(prompt):]
