"""Final-answer extraction and comparison for math-style tasks.

`final_answer(text)` takes the last `\\boxed{...}` (braces balanced, so
`\\boxed{\\frac{1}{2}}` works), else the last number in the text.
`reference_answer(answer)` accepts GSM8K's "... #### 42" form as well as plain
values. `answers_match` compares numerically when both sides are numbers
(so "1,000", "1000.0" and "1e3" agree), else as normalised strings.
"""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mathrm|mbox)\{([^{}]*)\}")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None  # unbalanced: the completion was cut off


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def final_answer(text: str) -> tuple[str | None, bool]:
    """(answer, whether it came from a \\boxed{}); answer None when nothing is found."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed, True
    return last_number(text), False


def reference_answer(answer: Any) -> str:
    """The comparable part of a dataset's answer field (GSM8K: after '####')."""
    text = str(answer)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    boxed = last_boxed(text)
    return boxed if boxed is not None else text.strip()


def normalize(answer: str) -> str:
    s = answer.strip().strip("$").strip()
    s = _TEXT.sub(r"\1", s)
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = s.replace(" ", "").rstrip(".")
    return s.lower()


def as_number(answer: str) -> float | None:
    s = normalize(answer).replace(",", "")
    m = re.fullmatch(r"\(?(-?[\d.]+(?:e[-+]?\d+)?)\)?/\(?(-?[\d.]+)\)?", s)
    try:
        if m:
            return float(m.group(1)) / float(m.group(2))
        return float(s.rstrip("%"))
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(given: str | None, reference: Any) -> bool:
    if given is None:
        return False
    ref = reference_answer(reference)
    a, b = as_number(given), as_number(ref)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    return normalize(given) == normalize(ref)
