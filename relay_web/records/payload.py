"""The payload of a new job: any JSON value PostgreSQL's jsonb can store.

A bad value deep inside a payload is reported at the keys and indexes the
client wrote (``payload.items.3``), never at pydantic's names for the union
members it tried on the way.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import (
    Discriminator,
    Field,
    GetJsonSchemaHandler,
    StringConstraints,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, ErrorDetails, InitErrorDetails, PydanticCustomError
from typing_extensions import TypeAliasType

from .common import NO_NUL

_Key = Annotated[str, StringConstraints(pattern=NO_NUL)]

#: Each kind of JSON value, in the order a value is tested (bool first: True is an int in Python).
_JSON_KINDS = (("null", type(None)), ("bool", bool), ("int", int), ("float", float), ("str", str), ("list", list))


def _json_kind(value: Any) -> str:
    # Only the member of the value's own kind checks it, so a bad value gets
    # the one error that fits it, not one per member of the union. Parsed JSON
    # that is none of the others is an object.
    return next((kind for kind, cls in _JSON_KINDS if isinstance(value, cls)), "dict")


class _AnyOf:
    """Spell the union ``anyOf`` in JSON Schema: an integer is a JSON number too, so ``oneOf`` would refuse 5."""

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        """The tagged union's schema with its choices under ``anyOf``."""
        generated = handler(schema)
        if "oneOf" in generated:
            generated["anyOf"] = generated.pop("oneOf")
        return generated


#: Any JSON value PostgreSQL's jsonb can store: no NUL in any string or key.
PayloadValue = TypeAliasType(
    "PayloadValue",
    Annotated[
        Union[  # noqa: UP007 - a recursive alias needs the Union spelling
            Annotated[_Key, Tag("str")],
            Annotated[int, Tag("int")],
            Annotated[float, Field(allow_inf_nan=False), Tag("float")],
            Annotated[bool, Tag("bool")],
            Annotated[list["PayloadValue"], Tag("list")],
            Annotated[
                dict[_Key, "PayloadValue"], Field(json_schema_extra={"additionalProperties": False}), Tag("dict")
            ],
            Annotated[None, Tag("null")],
        ],
        Discriminator(_json_kind),
        _AnyOf,
    ],
)


def _client_path(error: ErrorDetails) -> InitErrorDetails:
    # pydantic places an error inside a payload after the member of each union
    # it chose: ("dict", "a", "list", 1, "float"), or ("dict", "k", "[key]")
    # for a bad key. The client wrote only the keys and indexes, every other
    # place, so the path keeps those alone.
    context = {**error.get("ctx", {}), "message": error["msg"]}
    return {
        "type": PydanticCustomError(error["type"], "{message}", context),
        "loc": tuple(error["loc"][1::2]),
        "input": error["input"],
    }


def _located_in_payload(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:
        return handler(value)
    except ValidationError as exc:
        raise ValidationError.from_exception_data(exc.title, [_client_path(e) for e in exc.errors()]) from None


#: The payload of a new job; errors name the keys and indexes where the client put the bad value.
Payload = Annotated[PayloadValue, WrapValidator(_located_in_payload)]
