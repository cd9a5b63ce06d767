"""A data-only encoding for control messages (no pickle, no code on decode).

Control messages are the records of :mod:`roundel.common.control.messages`,
holding nested tuples, lists and dicts of None, bool, int (any size), float,
str and bytes, plus roundel's own records (``Request``, ``Entry``, ``Batch``,
``CachedBatch``, ``TunedParams``: :mod:`roundel.common.control.records`) and
enums (``OpKind``, ``ReduceOp``). Each value is one
tag byte followed by its body; containers give their item count, strings and
byte strings their length, records their encoded length and field count.

Decoding builds only those types. Records are rebuilt from fields that must
match the record's annotated types, so a frame can never name a class or a
function, and any malformed input raises ``DecodeError``.
"""

from __future__ import annotations

import numbers
import struct
import types
import typing

from roundel.common.control import messages
from roundel.common.control.records import Batch, CachedBatch, Entry, OpKind, Request, TunedParams
from roundel.ops import ReduceOp

MAX_DEPTH = 64

_I64 = struct.Struct("!q")
_F64 = struct.Struct("!d")
_U32 = struct.Struct("!I")
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1

_NONE, _TRUE, _FALSE = b"N", b"T", b"F"
_INT, _BIGINT, _FLOAT = b"i", b"I", b"d"
_STR, _BYTES = b"s", b"b"
_TUPLE, _LIST, _DICT = b"t", b"l", b"m"
_RECORD_TAGS = {Request: b"R", Entry: b"E", Batch: b"B", CachedBatch: b"C", TunedParams: b"P",
                messages.Submit: b"S", messages.Waits: b"W", messages.Heartbeat: b"H", messages.Bye: b"Y",
                messages.Dispatch: b"D", messages.Tune: b"U", messages.Abort: b"A", messages.Merged: b"G",
                messages.Relayed: b"L", messages.Joined: b"J", messages.Lost: b"X", messages.Deliver: b"V"}
_ENUM_TAGS = {OpKind: b"o", ReduceOp: b"r"}

# sequence fields whose items must be of these record types (beyond what the annotations say)
_ITEM_TYPES = {(Batch, "entries"): (Entry,), (messages.Submit, "full"): (Request,),
               (messages.Dispatch, "batches"): (Batch, CachedBatch)}

# Steady state sends the same records every step. Requests re-sent as the same (immutable)
# object reuse their encoding; a Request or Entry whose exact bytes were decoded before is
# reused. Each cache holds at most _CACHE_LIMIT records of at most _CACHED_BODY_LIMIT bytes.
_ENCODING_CACHED = {Request}
_DECODING_CACHED = {Request, Entry}
_CACHE_LIMIT = 4096
_CACHED_BODY_LIMIT = 1024
_encodings: dict[int, tuple] = {}


class DecodeError(ValueError):
    """The bytes are not a well-formed control message."""


# ------------------------------------------------------------------ encoding
def encode(message) -> bytes:
    """Return ``message`` as bytes; raises TypeError for a value this format cannot carry."""
    out: list[bytes] = []
    _encode(message, out, 0)
    return b"".join(out)


def _encode(value, out: list, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TypeError(f"control message nested deeper than {MAX_DEPTH} levels")
    encoder = _ENCODERS.get(type(value))
    if encoder is None:
        value, encoder = _coerce(value)
    encoder(value, out, depth)


def _encode_none(value, out, depth):
    out.append(_NONE)


def _encode_bool(value, out, depth):
    out.append(_TRUE if value else _FALSE)


def _encode_int(value, out, depth):
    if _I64_MIN <= value <= _I64_MAX:
        out.append(_INT + _I64.pack(value))
        return
    body = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
    out.append(_BIGINT + _U32.pack(len(body)))
    out.append(body)


def _encode_float(value, out, depth):
    out.append(_FLOAT + _F64.pack(value))


def _encode_str(value, out, depth):
    body = value.encode("utf-8", "surrogatepass")
    out.append(_STR + _U32.pack(len(body)))
    out.append(body)


def _encode_bytes(value, out, depth):
    body = bytes(value)
    out.append(_BYTES + _U32.pack(len(body)))
    out.append(body)


def _sequence_encoder(tag: bytes):
    def encode_items(value, out, depth):
        out.append(tag + _U32.pack(len(value)))
        depth += 1
        for item in value:
            _encode(item, out, depth)
    return encode_items


def _encode_dict(value, out, depth):
    out.append(_DICT + _U32.pack(len(value)))
    depth += 1
    for key, item in value.items():
        _encode(key, out, depth)
        _encode(item, out, depth)


def _record_encoder(cls, tag: bytes):
    remember = cls in _ENCODING_CACHED

    def encode_record(value, out, depth):
        if remember:
            cached = _encodings.get(id(value))
            if cached is not None and cached[0] is value:
                out.append(cached[1])
                return
        parts = [bytes((len(value),))]
        depth += 1
        for item in value:  # the common field types inline: records are most of a message
            kind = type(item)
            if item is None:
                parts.append(_NONE)
            elif kind is str:
                text = item.encode("utf-8", "surrogatepass")
                parts.append(_STR + _U32.pack(len(text)) + text)
            elif kind is int and _I64_MIN <= item <= _I64_MAX:
                parts.append(_INT + _I64.pack(item))
            else:
                _encode(item, parts, depth)
        body = b"".join(parts)
        encoded = tag + _U32.pack(len(body)) + body
        if remember and len(body) <= _CACHED_BODY_LIMIT and _immutable(value):
            _bounded_put(_encodings, id(value), (value, encoded))
        out.append(encoded)
    return encode_record


def _immutable(value) -> bool:
    """True when ``value`` holds only immutable data (so a cached copy can never go stale)."""
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _bounded_put(cache: dict, key, value) -> None:
    if len(cache) >= _CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def _enum_encoder(tag: bytes):
    def encode_enum(value, out, depth):
        out.append(tag + _I64.pack(value))
    return encode_enum


_ENCODERS: dict[type, typing.Callable[[typing.Any, list, int], None]] = {
    type(None): _encode_none, bool: _encode_bool, int: _encode_int, float: _encode_float,
    str: _encode_str, bytes: _encode_bytes, bytearray: _encode_bytes, memoryview: _encode_bytes,
    tuple: _sequence_encoder(_TUPLE), list: _sequence_encoder(_LIST), dict: _encode_dict,
    **{cls: _record_encoder(cls, tag) for cls, tag in _RECORD_TAGS.items()},
    **{cls: _enum_encoder(tag) for cls, tag in _ENUM_TAGS.items()},
}

_PLAIN_BASES: tuple[type, ...] = (str, list, dict)  # the plain types whose subclasses _coerce turns plain


def _coerce(value):
    """Plain stand-ins for NumPy scalars and subclasses of the plain types (torch.Size, OrderedDict...)."""
    if isinstance(value, numbers.Integral):
        return int(value), _encode_int
    if isinstance(value, numbers.Real):
        return float(value), _encode_float
    for plain in _PLAIN_BASES:
        if isinstance(value, plain):
            return plain(value), _ENCODERS[plain]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):  # a record type this codec does not know
        return tuple(value), _ENCODERS[tuple]
    raise TypeError(f"a control message cannot carry a {type(value).__module__}.{type(value).__qualname__} "
                    "(only None, bool, int, float, str, bytes, tuple, list, dict and roundel's "
                    "control message, Request/Entry/Batch/CachedBatch/TunedParams records and enums)")


# ------------------------------------------------------------------ decoding
def decode(data) -> object:
    """Return the message encoded in ``data``; raises DecodeError if it is malformed in any way."""
    data = bytes(data)
    try:
        value, end = _decode(data, 0, 0)
    except DecodeError:
        raise
    except (struct.error, IndexError, UnicodeDecodeError, TypeError, ValueError) as exc:
        raise DecodeError(f"malformed control message: {exc}") from None
    if end != len(data):
        raise DecodeError(f"malformed control message: {len(data) - end} stray bytes after the message")
    return value


def _decode(data: bytes, pos: int, depth: int):
    if depth > MAX_DEPTH:
        raise DecodeError(f"control message nested deeper than {MAX_DEPTH} levels")
    decoder = _DECODERS.get(data[pos])
    if decoder is None:
        raise DecodeError(f"unknown tag byte 0x{data[pos]:02x} at offset {pos} in a control message")
    return decoder(data, pos + 1, depth)


def _constant(value):
    def decode_constant(data, pos, depth):
        return value, pos
    return decode_constant


def _decode_int(data, pos, depth):
    return _I64.unpack_from(data, pos)[0], pos + 8


def _sized(data, pos) -> tuple[int, int]:
    """The length prefix at ``pos`` and where the body ends, checked against the buffer."""
    (size,) = _U32.unpack_from(data, pos)
    end = pos + 4 + size
    if end > len(data):
        raise DecodeError(f"a control message field claims {size} bytes but the frame is shorter")
    return pos + 4, end


def _decode_bigint(data, pos, depth):
    start, end = _sized(data, pos)
    return int.from_bytes(data[start:end], "big", signed=True), end


def _decode_float(data, pos, depth):
    return _F64.unpack_from(data, pos)[0], pos + 8


def _decode_str(data, pos, depth):
    start, end = _sized(data, pos)
    return data[start:end].decode("utf-8", "surrogatepass"), end


def _decode_bytes(data, pos, depth):
    start, end = _sized(data, pos)
    return data[start:end], end


def _count(data, pos) -> int:
    (count,) = _U32.unpack_from(data, pos)
    if count > len(data) - pos - 4:  # every item takes at least one byte
        raise DecodeError(f"a control message container claims {count} items but the frame is shorter")
    return count


def _decode_items(data, pos, depth) -> tuple[list, int]:
    count = _count(data, pos)
    pos += 4
    depth += 1
    items = []
    for _ in range(count):
        item, pos = _decode(data, pos, depth)
        items.append(item)
    return items, pos


def _decode_tuple(data, pos, depth):
    items, pos = _decode_items(data, pos, depth)
    return tuple(items), pos


def _decode_dict(data, pos, depth):
    count = _count(data, pos)
    pos += 4
    depth += 1
    result = {}
    for _ in range(count):
        key, pos = _decode(data, pos, depth)
        value, pos = _decode(data, pos, depth)
        try:
            result[key] = value
        except TypeError:
            raise DecodeError(f"a control message dict has an unhashable key of type {type(key).__name__}") from None
    return result, pos


def _field_checks(cls) -> list[tuple[str, tuple, tuple[type, ...] | None]]:
    """(name, accepted types, accepted item types or None) per field, from the record's annotations."""
    hints = typing.get_type_hints(cls)
    return [(name, _accepted_types(hints.get(name, typing.Any)), _ITEM_TYPES.get((cls, name)))
            for name in cls._fields]


def _accepted_types(hint) -> tuple:
    """What isinstance() must accept for a field annotated ``hint`` (``float`` takes ints too)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    accepted = tuple(object if option is typing.Any else typing.get_origin(option) or option for option in options)
    return accepted + (int,) if float in accepted else accepted


def _record_decoder(cls):
    checks = _field_checks(cls)
    decoded: dict[bytes, tuple] = {}
    remember = cls in _DECODING_CACHED

    def decode_record(data, pos, depth):
        start, end = _sized(data, pos)
        body = data[start:end] if remember and end - start <= _CACHED_BODY_LIMIT else None
        record = decoded.get(body) if body is not None else None
        if record is not None:
            return record, end
        count = data[start] if start < end else 0
        if count != len(checks):
            raise DecodeError(f"a {cls.__name__} record has {count} fields; this roundel expects "
                              f"{len(checks)} (are all ranks running the same roundel version?)")
        pos = start + 1
        depth += 1
        fields = []
        for name, accepted, item_type in checks:
            value, pos = _decode(data, pos, depth)
            if not isinstance(value, accepted):
                raise DecodeError(f"{cls.__name__}.{name} cannot be a {type(value).__name__}")
            if item_type is not None and not all(type(item) in item_type for item in value):
                raise DecodeError(f"{cls.__name__}.{name} may only hold "
                                  f"{' or '.join(t.__name__ for t in item_type)} records")
            fields.append(value)
        if pos != end:
            raise DecodeError(f"a {cls.__name__} record's fields do not fill its declared length")
        record = cls._make(fields)
        if body is not None and _immutable(record):
            _bounded_put(decoded, body, record)
        return record, end
    return decode_record


def _enum_decoder(cls):
    def decode_enum(data, pos, depth):
        (value,) = _I64.unpack_from(data, pos)
        try:
            return cls(value), pos + 8
        except ValueError:
            raise DecodeError(f"{value} is not a {cls.__name__}") from None
    return decode_enum


_DECODERS = {
    _NONE[0]: _constant(None), _TRUE[0]: _constant(True), _FALSE[0]: _constant(False),
    _INT[0]: _decode_int, _BIGINT[0]: _decode_bigint, _FLOAT[0]: _decode_float,
    _STR[0]: _decode_str, _BYTES[0]: _decode_bytes,
    _TUPLE[0]: _decode_tuple, _LIST[0]: _decode_items,
    _DICT[0]: _decode_dict,
    **{tag[0]: _record_decoder(cls) for cls, tag in _RECORD_TAGS.items()},
    **{tag[0]: _enum_decoder(cls) for cls, tag in _ENUM_TAGS.items()},
}
