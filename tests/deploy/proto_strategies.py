"""Hypothesis strategies for any protobuf message, built from its descriptor at run time: every
field (new fields included, without touching this file), extreme and invalid values, unicode,
occasionally huge repeated fields."""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    # The edges and small values are where validation bugs live; the rest is noise.
    edges = [low, high, 0, 1, -1 if low < 0 else 2, high // 2]
    small = st.integers(-3, 300).filter(lambda v: low <= v <= high)
    return st.one_of(st.sampled_from(edges), small, st.integers(low, high))


_TEXT = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(min_codepoint=0x80), max_size=40),  # non-ASCII only
    st.sampled_from(["", " ", "\x00", "\ufeff", "🙂" * 50, "a" * 5000, "\u202e\u0301"]),
)


def _scalar(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    kind = field.type
    if kind in _INT_RANGES:
        return _integers(*_INT_RANGES[kind])
    if kind == FieldDescriptor.TYPE_FLOAT:
        return st.floats(width=32)  # NaN and ±inf included
    if kind == FieldDescriptor.TYPE_DOUBLE:
        return st.floats()
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_STRING:
        return _TEXT
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if kind == FieldDescriptor.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.integers(-5, 1000))  # open enums
    assert kind == FieldDescriptor.TYPE_MESSAGE
    return message_strategy(field.message_type, depth + 1)


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)  # protobuf >= 6; older: label
    if repeated is None:
        repeated = field.label == FieldDescriptor.LABEL_REPEATED
    return bool(repeated)


def _is_map(field: FieldDescriptor) -> bool:
    """A ``map<K, V>`` field: on the wire a repeated message of (key, value) entries."""
    return field.type == FieldDescriptor.TYPE_MESSAGE and bool(
        field.message_type.GetOptions().map_entry
    )


def _field_value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    element = _scalar(field, depth)
    if not _is_repeated(field):
        return element
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return st.lists(element, max_size=4)
    # Huge: one drawn value repeated thousands of times (drawing each would be slow).
    huge = st.integers(1000, 5000).flatmap(lambda n: st.builds(lambda v: [v] * n, element))
    return st.one_of(st.lists(element, max_size=6), huge)


def message_strategy(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of ``descriptor``'s type: each field unset or set to a drawn value."""
    cls = GetMessageClass(descriptor)
    if depth > 3:
        return st.just(cls())
    fields = {f.name: st.one_of(st.none(), _field_value(f, depth)) for f in descriptor.fields}

    def build(values: dict[str, Any]) -> Message:
        message = cls()
        for name, value in values.items():
            if value is None:
                continue
            field = descriptor.fields_by_name[name]
            target = getattr(message, name) if _is_repeated(field) else None
            if target is not None and _is_map(field):
                value_field = field.message_type.fields_by_name["value"]
                for entry in value:  # drawn (key, value) entry messages
                    if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                        target[entry.key].CopyFrom(entry.value)
                    else:
                        target[entry.key] = entry.value
            elif target is not None and field.type == FieldDescriptor.TYPE_MESSAGE:
                for item in value:
                    target.add().CopyFrom(item)
            elif target is not None:
                target.extend(value)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(message, name).CopyFrom(value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries(fields).map(build)
