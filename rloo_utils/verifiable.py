"""Verifiable rewards: the final answer of a completion parsed and checked against the dataset's `answer` column, in
TRL's reward-function signature (a float per completion, None for a row the function does not score). The scripts offer
them by name (`--reward_funcs answer_accuracy number_only`); as `rloo_utils/verifiable.py:answer_accuracy` they are an
example of a file-given reward to copy. How to write one, and the pitfalls they handle: docs/verifiable.md."""

import re
from fractions import Fraction
from typing import Optional

from rloo_utils.data import content_text

# A number as people write it: a sign (ASCII or Unicode minus), digits with optional thousands commas (grouped in
# threes; "1,2,3" is three numbers), an optional decimal part, or a bare one (".5"). Not preceded by a digit, nor by a
# digit and a point, so "8-3" reads as 8 and 3 (not 8 and -3) and "1.5" as one number; a trailing period ("is 12.") is
# the sentence's, not the number's.
NUMBER_BODY = r"[-\u2212]?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])\.\d+)"
NUMBER = re.compile(r"(?<!\d)(?<!\d\.)" + NUMBER_BODY)
# GSM8K's convention (its solutions end "#### 72"), and veRL's strict parse of a completion: the number after "####"
# (a dollar sign allowed before it); each whitespace run is matched once, so a long one cannot make it slow
FINAL_MARK = re.compile(r"####\s*(?:\$\s*)?(" + NUMBER_BODY + ")")


def to_number(text: str) -> Optional[Fraction]:
    """A number as written ("1,234", "-5", "2.50", "\u22123") -> an exact Fraction, so that 12, 12.0 and 12.00 are
    equal; None where it is not one."""
    text = text.replace(",", "").replace("\u2212", "-").strip()
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def completion_text(completion) -> str:
    """A completion is a string, or chat messages (conversational data): the text of the last one."""
    return completion if isinstance(completion, str) else content_text(completion[-1]["content"])


def last_number(text: str) -> Optional[Fraction]:
    """The last number in the text: what most answers end with ("... so the answer is 12."); None if it has none."""
    numbers = NUMBER.findall(text)
    return to_number(numbers[-1]) if numbers else None


def marked_number(text: str) -> Optional[Fraction]:
    """The number after the last "####" (GSM8K's final-answer mark); None where the text has no marked number."""
    marked = FINAL_MARK.findall(text)
    return to_number(marked[-1]) if marked else None


def whole_number(text: str) -> Optional[Fraction]:
    """The text as one number, a trailing period allowed ("12.", "3/4", "1e5", "1,000"); None where it is more."""
    text = text.strip().removesuffix(".").strip()
    if not text or any(c.isspace() for c in text) or ("," in text and not NUMBER.fullmatch(text)):
        return None  # "1,2,3" is three numbers, not 123
    return to_number(text)


def final_answer(text: str) -> Optional[Fraction]:
    """A completion's final answer: the whole text where it is one number, else the number after its last "####",
    else its last number (veRL's "flexible" parse); None where it holds no number."""
    for parse in (whole_number, marked_number, last_number):
        number = parse(text)
        if number is not None:
            return number
    return None


def missing(answer) -> bool:
    """A row without an answer: None, empty, NaN (a missing value in a table), which no function here scores."""
    return (
        answer is None
        or (isinstance(answer, float) and answer != answer)
        or (isinstance(answer, str) and not answer.strip())
    )


def reference_answer(answer) -> Optional[Fraction]:
    """The dataset's answer: a number, or text holding one (read as final_answer reads a completion: a GSM8K solution
    is the number after its "####"); None for a row without one (missing). An answer that holds no number is a mistake
    in the data, not a row to skip: ValueError, naming it."""
    if missing(answer):
        return None
    if isinstance(answer, int) and not isinstance(answer, bool):
        return Fraction(answer)
    number = final_answer(repr(answer) if isinstance(answer, float) else str(answer))  # repr: 0.1 is 1/10
    if number is None:
        raise ValueError(f"the answer {answer!r} holds no number to compare with: fix the dataset's answer column")
    return number


def answer_accuracy(completions, answer, **kwargs) -> list[Optional[float]]:
    """1.0 where the completion's final answer (final_answer: the whole text as a number, else the number after its last
    "####", else its last number) equals the dataset's `answer`, else 0.0; None for rows without one. Numbers compare
    as numbers: 1,000 = 1000 = 1000.0, 3/4 = 0.75."""
    rewards = []
    for completion, reference in zip(completions, answer):
        reference = reference_answer(reference)
        if reference is None:
            rewards.append(None)
            continue
        rewards.append(float(final_answer(completion_text(completion)) == reference))
    return rewards


def gsm8k_accuracy(completions, answer, **kwargs) -> list[Optional[float]]:
    """GSM8K's strict score (veRL's gsm8k.py, method "strict"; what its published accuracies are): 1.0 where the
    number after the completion's last "####" equals the answer; a completion without "####" scores 0.0."""
    rewards = []
    for completion, reference in zip(completions, answer):
        reference = reference_answer(reference)
        rewards.append(None if reference is None else float(marked_number(completion_text(completion)) == reference))
    return rewards


def number_only(completions, answer=None, **kwargs) -> list[Optional[float]]:
    """A format reward: 1.0 where the completion is a number and nothing else (a trailing period allowed), right or
    wrong, else 0.0; None for rows without an answer (a prompt of another task in the same dataset)."""
    answers = answer if answer is not None else [0] * len(completions)
    rewards = []
    for completion, reference in zip(completions, answers):
        if missing(reference):  # the value itself is not read: another task's answer may be a word
            rewards.append(None)
            continue
        text = completion_text(completion).strip().removesuffix(".").strip()
        rewards.append(float(bool(NUMBER.fullmatch(text))))
    return rewards


REWARD_FUNCS = {"answer_accuracy": answer_accuracy, "gsm8k_accuracy": gsm8k_accuracy, "number_only": number_only}
