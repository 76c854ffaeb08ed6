"""Requests checked where the server decodes them, before any interceptor or
handler runs: bytes that are not the method's message (naming the string field that is
not UTF-8, when that is why), and enum values its schema does not define,
are the client's error (INVALID_ARGUMENT, naming the message or the field),
never UNKNOWN or INTERNAL from deep inside a handler.

gRPC calls the request deserializer outside every handler, and a raise
there reaches the client as UNKNOWN. So the deserializer returns a
`BadRequest` in place of the message, and the error interceptor
(interceptors.py) turns it into INVALID_ARGUMENT when the handler would
receive it. Proto3 enums are open: an undefined number parses, and only
fails later, when code names it.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from flywheel.errors import InvalidArgument
from flywheel.runtime.proto_utf8 import find_invalid_utf8


@dataclass(frozen=True)
class BadRequest:
    """Stands in for a request that failed the checks; `reason` is what the client is told."""

    reason: str


def checked(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """`deserialize`, answering a `BadRequest` where it would raise or the message breaks its schema."""
    if deserialize is None:
        return None
    message_type = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
    name = message_type.full_name if message_type is not None else "request"

    def parse(data: bytes) -> Any:
        try:
            message = deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, or whatever else garbage makes the runtime raise
            where = find_invalid_utf8(message_type, data) if message_type is not None else None
            if where:
                return BadRequest(f"{where}: not valid UTF-8")
            return BadRequest(f"the request bytes are not a valid {name}: {exc}")
        if isinstance(message, Message):
            problem = undefined_enum(message)
            if problem:
                return BadRequest(problem)
        return message

    return parse


def admit(request: Any) -> Any:
    """A unary request as the handler may take it; InvalidArgument for a `BadRequest`."""
    if isinstance(request, BadRequest):
        raise InvalidArgument(request.reason)
    return request


async def admit_each(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request stream whose first bad message fails the call (those before it were delivered)."""
    async for request in requests:
        yield admit(request)


def undefined_enum(message: Message, path: str = "") -> str:
    """The first enum field (at any depth) holding a number its enum does not define, as an error; "" if none."""
    if not _has_enums(message.DESCRIPTOR):
        return ""
    for field, value in message.ListFields():
        name = f"{path}{field.name}"
        if _is_map(field):
            entry = field.message_type.fields_by_name["value"]
            for key, item in value.items():
                problem = _check_one(entry, item, f"{name}[{key!r}]")
                if problem:
                    return problem
        elif field.is_repeated:
            for i, item in enumerate(value):
                problem = _check_one(field, item, f"{name}[{i}]")
                if problem:
                    return problem
        else:
            problem = _check_one(field, value, name)
            if problem:
                return problem
    return ""


def _check_one(field: FieldDescriptor, value: Any, name: str) -> str:
    if field.type == FieldDescriptor.TYPE_ENUM and value not in field.enum_type.values_by_number:
        known = ", ".join(v.name for v in field.enum_type.values)
        return f"{name}: {value} is not a {field.enum_type.name} value (one of {known})"
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return undefined_enum(value, f"{name}.")
    return ""


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


@functools.cache
def _has_enums(descriptor: Descriptor, _seen: frozenset[str] = frozenset()) -> bool:
    """Whether a message of this type can hold an enum anywhere (most cannot: they are skipped)."""
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_ENUM:
            return True
        if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.full_name not in _seen:
            if _has_enums(field.message_type, _seen | {descriptor.full_name}):
                return True
    return False
