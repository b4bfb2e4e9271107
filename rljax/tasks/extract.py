"""Answer extraction from model text, in linear time.

Rewards run on arbitrary model output, so every extractor here is a single
left-to-right pass (``str.find`` scans, or one ``finditer`` over a pattern
without nested quantifiers): an adversarial completion of n characters costs
O(n). The lazy regex ``<answer>(.*?)</answer>`` that these replace restarts its
scan at every opening tag, which is O(n^2) when no closing tag follows.

Modes (``extract(text, mode)``):
  none:        the whole text.
  answer_tag:  the content of the last complete ``<answer>...</answer>``
               (stripped), the rule of reasoning-gym's ``extract_answer``.
  boxed:       the content of the last ``\\boxed{...}`` whose braces balance.
  last_number: the last number (``-12``, ``1,234``, ``3.5``), as written.
A mode that finds nothing gives None, which every reward scores 0.
"""

from __future__ import annotations

import re
from typing import Optional

from rljax.tasks import _parse

MODES = ("none", "answer_tag", "boxed", "last_number")

# One token per brace, or a whole "\boxed{" opening; no quantifiers at all.
_BRACE_TOKEN_RE = re.compile(r"\\boxed\{|[{}]")


def last_tagged(text: str, open_tag: str, close_tag: str) -> Optional[str]:
    """The content of the last complete ``open_tag ... close_tag`` pair.

    Pairs are taken left to right exactly as ``re.finditer`` takes the lazy
    ``open(.*?)close`` (DOTALL): an opening tag pairs with the first closing tag
    after it, and the next pair starts after that closing tag. Each scan starts
    where the previous one stopped, so the whole search is linear; and when an
    opening tag has no closing tag after it, no later one can have one either,
    so the search stops there instead of trying every later opening tag.
    """
    found = None
    pos = 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            break
        body = start + len(open_tag)
        end = text.find(close_tag, body)
        if end < 0:
            break
        found = (body, end)
        pos = end + len(close_tag)
    return None if found is None else text[found[0]:found[1]]


def answer_tag(text: str) -> Optional[str]:
    """The stripped content of the last complete ``<answer>...</answer>``.

    Equal to reasoning-gym's ``extract_answer(text)`` (its lazy regex
    ``<answer>\\s?(.*?)\\s?</answer>`` then ``strip``) on every input, in
    linear instead of quadratic time.
    """
    content = last_tagged(text, "<answer>", "</answer>")
    return None if content is None else content.strip()


def last_boxed(text: str) -> Optional[str]:
    """The content of the last ``\\boxed{...}`` (by opening) whose braces balance.

    ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``. One pass over the brace
    tokens with a stack of open braces: O(n) time and memory. Stray closing
    braces are ignored; a ``\\boxed{`` never closed is not an answer.
    """
    stack: list[Optional[int]] = []  # content start of a \boxed{, else None
    best: Optional[tuple[int, int]] = None
    for match in _BRACE_TOKEN_RE.finditer(text):
        token = match.group()
        if token == "}":
            if not stack:
                continue
            start = stack.pop()
            if start is not None and (best is None or start > best[0]):
                best = (start, match.start())
        else:
            stack.append(match.end() if token != "{" else None)
    return None if best is None else text[best[0]:best[1]]


def last_number(text: str) -> Optional[str]:
    """The last number in the text as written ("1,234", "-7", "3.5"), or None.

    Unicode minus signs count as "-". The number pattern is the one the
    arithmetic rewards use (``_parse``), which has no nested quantifiers.
    """
    numerals = _parse._NUMBER_RE.findall(_parse.normalize_operators(text))
    return numerals[-1] if numerals else None


_EXTRACTORS = {
    "none": lambda text: text,
    "answer_tag": answer_tag,
    "boxed": last_boxed,
    "last_number": last_number,
}


def check_mode(field: str, mode: str) -> None:
    """Raises ValueError naming ``field`` unless ``mode`` is one of ``MODES``."""
    if mode not in _EXTRACTORS:
        raise ValueError(f"{field}={mode!r} is not an extraction mode; valid "
                         f"modes: {', '.join(MODES)}")


def extract(text: str, mode: str) -> Optional[str]:
    """The answer region of ``text`` under ``mode`` (see the module docstring)."""
    check_mode("extract", mode)
    return _EXTRACTORS[mode](text)
