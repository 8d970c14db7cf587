"""Answer extraction and light normalisation for math rewards (pure Python, no sympy, linear time).

A response's final answer is the content of its LAST complete ``\\boxed{...}`` (or ``\\fbox{...}``; nested braces
are matched, escaped ``\\{``/``\\}`` do not count) or of its LAST line opening with ``Answer:`` (the DAPO prompt
format; markdown marks and "Final" may precede it), whichever starts later in the text. ``Answer: \\boxed{5}``
therefore yields ``5``. A last ``\\boxed{`` that is never closed (truncated generation) yields no answer rather
than an earlier, intermediate box.

Deliberate choices (documented because graders differ here):

* No credit for unanchored answers: a response without ``\\boxed{}`` and without an ``Answer:`` line has no answer
  (math-verify's default would grade the last number in the text). This is the reward's ``extraction="strict"``;
  ``extraction="lenient"`` skips this module and uses math-verify's own extraction (``gtpo.reward.grader``).
* Size caps: only the last ``MAX_RESPONSE_CHARS`` characters of a response are searched (the answer sits at the
  end; a 1 MB response costs milliseconds), and an extracted answer longer than ``MAX_ANSWER_CHARS`` is rejected
  as ``too_long`` (no benchmark gold is longer than ~100 characters; long candidates only feed sympy blow-ups).
"""

from __future__ import annotations

import re

__all__ = [
    "MAX_ANSWER_CHARS",
    "MAX_RESPONSE_CHARS",
    "clean_answer",
    "extract_answer",
    "last_answer_line",
    "last_boxed",
    "normalize_for_vote",
]

# ~64k tokens of tail is searched; answers sit at the end of a response.
MAX_RESPONSE_CHARS = 262_144
# Longest accepted extracted answer (and gold); longer strings are graded as incorrect ("too_long").
MAX_ANSWER_CHARS = 1_000

_BOX_COMMANDS = ("\\boxed", "\\fbox")
# "Answer:" opening a line (after optional markdown marks / "Final"), as the DAPO prompt asks; prose such as
# "we may check our answer: ..." mid-line is not an answer line
_ANSWER_LINE = re.compile(r"^[ \t>*#_]*(?:final[ \t]+)?answer[ \t*_]*[:：]", re.IGNORECASE | re.MULTILINE)
_TRAILING_PUNCT = re.compile(r"[\s.,;。]+$")


def _match_braces(text: str, open_pos: int, limit: int) -> int | None:
    """Index of the ``}`` closing the ``{`` at ``open_pos``; None if unclosed or longer than ``limit`` chars."""
    depth = 0
    i = open_pos
    end = min(len(text), open_pos + limit + 2)
    while i < end:
        ch = text[i]
        if ch == "\\":
            # an escaped character (\{, \}, \\) never opens or closes a group
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str, limit: int = MAX_ANSWER_CHARS) -> tuple[str | None, int, str]:
    """Content of the last ``\\boxed{}``/``\\fbox{}`` in ``text``.

    Returns:
        (content or None, start index of the command or -1, status) with status ``ok`` / ``none`` / ``unclosed``
        / ``too_long``. ``\\boxed 5`` (no braces) yields the next whitespace-delimited token.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None, -1, "none"
    cmd_len = len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox")
    i = start + cmd_len
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] == "{":
        close = _match_braces(text, i, limit)
        if close is None:
            # distinguish "never closed" from "closed but huge" so the reason is accurate
            status = "too_long" if _match_braces(text, i, len(text)) is not None else "unclosed"
            return None, start, status
        return text[i + 1 : close], start, "ok"
    if i > start + cmd_len:
        # "\boxed 5": TeX takes the next token
        m = re.match(r"[^\s$]+", text[i : i + limit + 1])
        if m and len(m.group(0)) <= limit:
            return m.group(0), start, "ok"
    # "\boxedx" or a bare "\boxed" at the end is not a box
    return None, start, "none"


def last_answer_line(text: str) -> tuple[str | None, int]:
    """Rest of the line after the last line-initial ``Answer:`` (case-insensitive; ``**Final Answer:**`` too),
    and its start index (-1 if none)."""
    last = None
    for match in _ANSWER_LINE.finditer(text):
        last = match
    if last is None:
        return None, -1
    line_end = text.find("\n", last.end())
    content = text[last.end() : line_end if line_end >= 0 else len(text)]
    return content, last.start()


# A whole answer that is one number inside a text-mode or bold command; math-verify reads \text{5.50} as text.
_TEXT_WRAPPED_NUMBER = re.compile(
    r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\{\s*([-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+))\s*\}"
)


def clean_answer(ans: str) -> str:
    """Strip markdown/math delimiters, percent and dollar signs, and trailing punctuation from an answer; a lone
    number in text, roman or bold type (``\\text{5.50}``, ``\\mathrm{5.50}``, ``\\textbf{5.50}``) is the number."""
    s = ans.strip()
    # markdown bold and math delimiters around the whole answer
    for left, right in (("**", "**"), ("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
    s = s.strip("*").strip()
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "")
    s = _TRAILING_PUNCT.sub("", s).strip().strip("$").strip()
    # a number set in text or bold type is the number, once the signs and punctuation around it are gone
    # (\text{5.50}, \textbf{\$5.50}, $\text{5.50}$.)
    wrapped = _TEXT_WRAPPED_NUMBER.fullmatch(s)
    return _TRAILING_PUNCT.sub("", wrapped.group(1)) if wrapped else s


def extract_answer(text: str) -> tuple[str | None, str]:
    """Final answer of a response.

    Returns:
        (answer or None, status) with status ``ok``, ``no_answer`` (no box / Answer line, or it is empty),
        ``unclosed`` (the last box never closes) or ``too_long``.
    """
    if len(text) > MAX_RESPONSE_CHARS:
        text = text[-MAX_RESPONSE_CHARS:]
    boxed, box_pos, box_status = last_boxed(text)
    line, line_pos = last_answer_line(text)
    if line is not None and line_pos > box_pos:
        # the Answer line comes last; it may itself hold a box
        inner, _, inner_status = last_boxed(line)
        if inner_status == "ok":
            line = inner
        elif inner_status in ("unclosed", "too_long"):
            return None, inner_status
        if len(line) > MAX_ANSWER_CHARS:
            return None, "too_long"
        ans = clean_answer(line)
        return (ans, "ok") if ans else (None, "no_answer")
    if box_status == "ok":
        ans = clean_answer(boxed)
        return (ans, "ok") if ans else (None, "no_answer")
    if box_status in ("unclosed", "too_long"):
        return None, box_status
    return None, "no_answer"


_VOTE_DROP = re.compile(r"\\left|\\right|\\displaystyle|\\[,;:! ]|\s+|\^\{?\\circ\}?|\\text\{\s*\}")
_VOTE_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def normalize_for_vote(ans: str | None) -> str:
    """Canonical string for majority voting: equal strings are one vote class (``""`` = no answer).

    String-level only (deterministic, fast): drops spacing macros, ``\\left``/``\\right``, degree marks and
    whitespace, maps ``\\dfrac``/``\\tfrac`` to ``\\frac`` and unwraps ``\\text{}``. ``1/2`` and ``0.5`` stay
    different classes.
    """
    if not ans:
        return ""
    s = ans.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    # spacing first, so ``\text {5}`` and ``\text{5}`` unwrap alike into one class
    s = _VOTE_DROP.sub("", s)
    s = _VOTE_TEXT.sub(r"\1", s)
    return _TRAILING_PUNCT.sub("", s)
