"""Verifiable rewards: the final answer of a completion parsed and checked against the dataset's `answer` column, in
TRL's reward-function signature (a float per completion, None for a row the function does not score); math answers
judged as math (accuracy_reward, math-verify's judgement, against TRL's `solution` column), and the \\boxed{} format.
The scripts offer them by name (`--reward_funcs answer_accuracy number_only`); as
`rloo_utils/verifiable.py:answer_accuracy` they are an example of a file-given reward to copy. How to write one, and
the pitfalls they handle: docs/verifiable.md."""

import re
import sys
from fractions import Fraction
from typing import Optional

from rloo_utils.data import content_text
from rloo_utils.math_judge import TIMEOUT, judge_answers, math_judge

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


def gold_text(gold) -> Optional[str]:
    """A gold answer as math-verify reads it: text as it is, a number as written (7, 0.5); None for a row without
    one (missing). Anything else is a mistake in the data: ValueError, naming it."""
    if missing(gold):
        return None
    if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
        raise ValueError(
            f"the gold answer {gold!r:.60} is a {type(gold).__name__}, not text or a number: fix the dataset's "
            "solution (or answer) column"
        )
    return gold if isinstance(gold, str) else repr(gold)


UNPARSED_GOLDS_SAID = set()  # the gold answers accuracy_reward has said it reads nothing in


def accuracy_reward(completions, solution=None, answer=None, log_extra=None, log_metric=None, **kwargs):
    """TRL's accuracy_reward, bounded: 1.0 where math-verify judges the completion's answer equal to the gold answer,
    else 0.0; None for a row without a gold answer, or with one math-verify finds no answer in. The gold is the
    `solution` column (TRL's), else `answer` (ours), as TRL parses it: LaTeX in $...$ or \\boxed{}, or a plain
    expression (0.5, 1/2, 7). The completion's answer: its \\boxed{} (the last; boxes listed together, "\\boxed{1},
    \\boxed{2}", are one answer), else LaTeX after "final answer is" or "answer:", units dropped; without either, 0.0.
    Equal as math-verify's verify has it (1/2 = 0.5 = \\dfrac{1}{2}; sets in any order; x = 2 for 2; 50\\% for 0.5).
    Each gold and each completion has math_judge.TIMEOUT seconds in a worker process (a pathological answer scores
    0.0; a gold that takes longer: None), counted (log_metric accuracy_reward/unjudged) and said on stderr."""
    golds = solution if solution is not None else answer
    if golds is None:
        raise ValueError("accuracy_reward reads the gold answer from a column `solution` (TRL's) or `answer`: give one")
    golds = [gold_text(g) for g in golds]
    texts = [completion_text(c) for c in completions]
    judged = judge_answers(golds, texts, math_judge())
    unparsed, slow_golds, slow_answers = judged["unparsed_golds"], judged["unjudged_golds"], judged["unjudged_answers"]
    new = [g for g in unparsed if g not in UNPARSED_GOLDS_SAID]
    if new:  # once for each gold: a dataset's rows come back every epoch
        print(
            f"accuracy_reward: math-verify reads no answer in the gold answer {new[0]!r:.80}"
            + (f" and {len(new) - 1} more" if len(new) > 1 else "")
            + ", whose rows are not scored (None): write a gold as LaTeX in $...$ or \\boxed{}, or as a plain number",
            file=sys.stderr,
        )
        UNPARSED_GOLDS_SAID.update(new)
    if slow_golds or slow_answers:
        text, why = (slow_answers or slow_golds)[0]
        print(
            f"accuracy_reward: math-verify did not judge {len(slow_answers)} of {len(texts)} completions (scored 0.0) "
            f"and {len(slow_golds)} of {judged['golds']} gold answers (their rows None) within {TIMEOUT:g} s, e.g. "
            f"...{text[-60:]!r} ({why})",
            file=sys.stderr,
        )
    if log_metric is not None:
        log_metric("accuracy_reward/unjudged", len(slow_answers) + len(slow_golds))
        log_metric("accuracy_reward/unparsed_golds", len(unparsed))
    if log_extra is not None:
        log_extra("gold_parsed", judged["gold_parsed"])
        log_extra("answer_parsed", judged["answer_parsed"])
    return judged["rewards"]


accuracy_reward.needs_one_column_of = ("solution", "answer")  # check_reward_columns: a dataset must give one


def boxed_format(completions, solution=None, answer=None, **kwargs) -> list[Optional[float]]:
    """A format reward: 1.0 where the completion's last \\boxed{ closes (its braces balanced, as math-verify counts
    them) around something, right or wrong, else 0.0 (no box, an empty one, one cut off); None for rows without a gold
    answer in `solution` or `answer` (another task's prompt). Without either column: the format alone."""
    golds = solution if solution is not None else answer if answer is not None else [0] * len(completions)
    return [None if missing(g) else float(closed_box(completion_text(c))) for c, g in zip(completions, golds)]


def closed_box(text: str) -> bool:
    """Whether the text's last \\boxed{ (spaces allowed before the brace) closes around something not blank."""
    start = text.rfind("\\boxed")
    if start < 0:
        return False
    rest = text[start + len("\\boxed") :].lstrip()
    if not rest.startswith("{"):
        return False
    depth = 0
    for end, char in enumerate(rest):
        depth += (char == "{") - (char == "}")
        if depth == 0:
            return bool(rest[1:end].strip())
    return False


REWARD_FUNCS = {
    "answer_accuracy": answer_accuracy,
    "gsm8k_accuracy": gsm8k_accuracy,
    "number_only": number_only,
    "accuracy_reward": accuracy_reward,
    "boxed_format": boxed_format,
}
