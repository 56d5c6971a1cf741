"""Options given as a JSON object on the command line, as TRL's dict options are (--chat_template_kwargs,
--generation_kwargs, --lr_scheduler_kwargs): their type (JsonObject), whose numbers are refused past the range of a
float, and NaN and Infinity, which JSON does not have, refused too."""

import json
import math
import sys
from typing import Annotated, Optional

import tyro


def finite_json_number(text: str) -> float:
    """A JSON number as a float, refused past float64 (1e400 would parse as inf); NaN and Infinity, which Python's json
    accepts but JSON does not, are refused by json_object."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past the range of a float: give a finite number")
    return value


def finite_json_int(text: str) -> int:
    """A JSON integer, refused past the range of a float (every option takes it as one)."""
    if abs(value := int(text)) > sys.float_info.max:
        raise ValueError(f"{text[:20]}... ({len(text)} digits) is past the range of a float: give a finite number")
    return value


def not_a_json_number(word: str):
    raise ValueError(f"{word} is not a JSON number: give a finite number")


def json_object(text: str) -> dict:
    try:
        value = json.loads(
            text, parse_float=finite_json_number, parse_int=finite_json_int, parse_constant=not_a_json_number
        )
    except json.JSONDecodeError as e:
        raise ValueError(f"{text!r} is not JSON ({e.msg}); give an object such as '{{\"key\": 1}}'") from None
    except ValueError as e:
        raise ValueError(f"{text if len(text) <= 80 else text[:60] + '...'!r}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{text!r} is not a JSON object; give one such as '{{\"key\": 1}}'")
    return value


# An option that takes keyword arguments as a JSON object (TRL's dict options, e.g. --chat_template_kwargs)
JsonObject = Annotated[
    Optional[dict],
    tyro.constructors.PrimitiveConstructorSpec(
        nargs=1,
        metavar="JSON",
        instance_from_str=lambda words: json_object(words[0]),
        is_instance=lambda value: value is None or isinstance(value, dict),
        str_from_instance=lambda value: [json.dumps(value)],
    ),
]
