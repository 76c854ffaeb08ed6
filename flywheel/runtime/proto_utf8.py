"""Finds the string field holding invalid UTF-8 in a raw protobuf message.

protobuf refuses such a message as a whole ("error parsing message"); an
agent sending one deserves to be told which field it got wrong. This walks
the wire format with the message's descriptor and returns a path such as
`prompts[2].text`.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from flywheel.varint import LEN, WireError, iter_fields


def find_invalid_utf8(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path of the first string field that is not UTF-8, or None."""
    counts: dict[int, int] = {}
    try:
        for number, wire_type, _, start, end in iter_fields(data):
            field = descriptor.fields_by_number.get(number)
            if wire_type != LEN or field is None:
                continue
            index = counts.get(number, 0)
            counts[number] = index + 1
            name = f"{prefix}{field.name}" + (f"[{index}]" if field.is_repeated else "")
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    data[start:end].decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = find_invalid_utf8(field.message_type, data[start:end], name + ".")
                if found:
                    return found
    except WireError:
        return None
    return None
