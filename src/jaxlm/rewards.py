"""Built-in reward functions for `training.objective=grpo` (`grpo.reward=jaxlm.rewards:NAME`), and the examples to
write one's own from. A reward function has the signature family of TRL's: it is called with keyword arguments
`prompts` (the prompts' text), `completions` (the completions' text), `completion_ids` (their token ids) and
every other field of the prompt records (e.g. `answer`), each a list with one entry per completion, and returns
one float per completion (None is not allowed: every completion gets a reward).
"""

from __future__ import annotations

import re

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:[.,]\d+)*")


def final_answer(text: str) -> str | None:
    """A completion's final answer: the content of its last \\boxed{...}, else its last number, else None."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _same(a: str, b) -> bool:
    b = str(b).strip()
    try:
        return float(a.replace(",", "")) == float(b.replace(",", ""))
    except ValueError:
        return a.strip() == b


def exact_answer(completions: list[str], answer: list, **_) -> list[float]:
    """1.0 where the completion's final answer (final_answer) equals the record's `answer` (numerically when
    both are numbers), else 0.0."""
    return [float(a is not None and _same(a, want)) for a, want in
            ((final_answer(c), w) for c, w in zip(completions, answer))]


def boxed_format(completions: list[str], **_) -> list[float]:
    """1.0 where the completion gives its answer in exactly one \\boxed{...} at its end, else 0.0."""
    return [float(len(_BOXED.findall(c)) == 1 and c.rstrip().endswith("}")) for c in completions]
