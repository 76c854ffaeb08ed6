"""Finds the string field holding invalid UTF-8 in a raw protobuf message.

protobuf refuses such a message as a whole ("error parsing message"); an
agent sending one deserves to be told which field it got wrong. This walks
the wire format with the message's descriptor and returns a path such as
`prompts[2].text`.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from flywheel.varint import VarintError, read_varint


def find_invalid_utf8(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path of the first string field that is not UTF-8, or None."""
    counts: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = read_varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = read_varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                length, pos = read_varint(data, pos)
                payload = data[pos : pos + length]
                pos += length
                field = descriptor.fields_by_number.get(number)
                if field is None:
                    continue
                index = counts.get(number, 0)
                counts[number] = index + 1
                is_repeated = field.is_repeated
                name = f"{prefix}{field.name}" + (f"[{index}]" if is_repeated else "")
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        payload.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE:
                    found = find_invalid_utf8(field.message_type, payload, name + ".")
                    if found:
                        return found
            else:
                return None
    except VarintError:
        return None
    return None
