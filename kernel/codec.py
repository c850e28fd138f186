"""How records cross process boundaries, and how external bytes become values.

Records are plain Python values. Between Spark tasks, into Redis backups and into keyed state
they travel as MessagePack: fast (a C extension), compact and safe, because decoding never
executes code (unlike pickle). Tuples survive the trip (as an extension type) because keyed
elements are ``(key, value)`` tuples and users rely on that; so do the panes of windowed
combines (:class:`~onceflow.kernel.windows.Pane`), the user's dataclasses, named tuples and
pydantic models (their class name and fields; see :mod:`onceflow.kernel.record_types`), and
``datetime`` and ``date`` values (as ISO text: a naive ``datetime`` stays naive, an aware one
keeps its UTC offset); the json codec writes those as ISO text too.

External payloads (Kafka values, file lines) are decoded by a :class:`ValueCodec` chosen per
source or sink: JSON, UTF-8 text, raw bytes or MessagePack.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

import msgpack

from onceflow.kernel import changes, record_types
from onceflow.kernel.errors import CodecError
from onceflow.kernel.windows import Pane

# Change (change data capture) is a record type every worker can read: registered on import
_RECORD_TYPES_OF_ONCEFLOW = (changes.Change,)
_EXT_TUPLE = 1
_EXT_PANE = 2
_EXT_RECORD = 3  # a dataclass, named tuple or pydantic model (see kernel.record_types)
_EXT_DATETIME = 4  # ISO text
_EXT_DATE = 5  # ISO text


def _to_builtin(obj: Any) -> Any:  # noqa: PLR0911 - one return per supported type
    """Map subclasses of supported types onto the types themselves (msgpack strict mode)."""
    if isinstance(obj, tuple):
        if type(obj) is not tuple and hasattr(type(obj), "_fields"):  # a named tuple
            return _record(obj)
        return msgpack.ExtType(_EXT_TUPLE, _pack_nested([*obj]))
    if isinstance(obj, Pane):
        return msgpack.ExtType(_EXT_PANE, _pack_nested(obj.as_list()))
    if isinstance(obj, bool):
        return bool(obj)
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, bytes | bytearray | memoryview):
        return bytes(obj)
    if isinstance(obj, dict):
        return dict(obj)
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, datetime):
        return msgpack.ExtType(_EXT_DATETIME, obj.isoformat().encode())
    if isinstance(obj, date):
        return msgpack.ExtType(_EXT_DATE, obj.isoformat().encode())
    return _record(obj)


def _record(obj: Any) -> msgpack.ExtType:
    """A dataclass, named tuple or pydantic model: its class name and fields."""
    found = record_types.fields_of(obj)
    if found is None:
        name = type(obj).__name__
        msg = (
            f"cannot encode a value of type {name!r}: records must be built from None, bool, "
            "int, float, str, bytes, list, tuple, dict, datetime, date, dataclasses, named "
            "tuples and pydantic models; convert it (for example with str()) before it leaves "
            "your function"
        )
        raise CodecError(msg)
    return msgpack.ExtType(_EXT_RECORD, _pack_nested([found[0], found[1]]))


def _ext_hook(code: int, data: bytes) -> Any:
    if code == _EXT_TUPLE:
        return tuple(decode(data))
    if code == _EXT_PANE:
        return Pane(*decode(data))
    if code == _EXT_RECORD:
        name, fields = decode(data)
        return record_types.build(name, fields)
    if code == _EXT_DATETIME:
        return datetime.fromisoformat(data.decode())
    if code == _EXT_DATE:
        return date.fromisoformat(data.decode())
    msg = f"unknown MessagePack extension type {code}; the data was not written by Onceflow"
    raise CodecError(msg)


class _Packers(threading.local):
    """One packer per nesting depth and thread: a packer cannot be re-entered mid-pack."""

    def __init__(self) -> None:
        self.stack: list[msgpack.Packer] = []
        self.depth = 0

    def at(self, depth: int) -> msgpack.Packer:
        while len(self.stack) <= depth:
            self.stack.append(
                msgpack.Packer(use_bin_type=True, strict_types=True, default=_to_builtin)
            )
        return self.stack[depth]


_packers = _Packers()


def _pack_nested(items: list[Any]) -> bytes:
    depth = _packers.depth + 1
    _packers.depth = depth
    try:
        return _packers.at(depth).pack(items)  # type: ignore[no-any-return]
    finally:
        _packers.depth = depth - 1


def encode(value: Any) -> bytes:
    """Encode one record value; raises :class:`CodecError` for unsupported types."""
    try:
        return _packers.at(0).pack(value)  # type: ignore[no-any-return]
    except CodecError:
        _reset()
        raise
    except OverflowError as exc:
        _reset()
        msg = f"cannot encode value: an integer is outside the 64-bit range ({exc}); send it as str"
        raise CodecError(msg) from exc
    except (TypeError, ValueError) as exc:
        _reset()
        msg = f"cannot encode value: {exc}"
        raise CodecError(msg) from exc


def encode_many(values: Sequence[Any]) -> list[bytes]:
    """:func:`encode` of every value, in one loop of the packer's (no call of ours per value).

    Raises :class:`CodecError` if one of them cannot be encoded (encode them one by one to
    learn which).
    """
    try:
        return list(map(_packers.at(0).pack, values))
    except CodecError:
        _reset()
        raise
    except (OverflowError, TypeError, ValueError) as exc:
        _reset()
        msg = f"cannot encode value: {exc}"
        raise CodecError(msg) from exc


def _reset() -> None:
    """Drop packers after a failure: a failed pack can leave a packer's buffer dirty."""
    _packers.stack.clear()
    _packers.depth = 0


def decode(data: bytes) -> Any:
    """Decode bytes written by :func:`encode`."""
    try:
        return msgpack.unpackb(data, ext_hook=_ext_hook, strict_map_key=False, raw=False)
    except CodecError:
        raise
    except Exception as exc:
        msg = f"cannot decode a {len(data)}-byte Onceflow record: {exc}"
        raise CodecError(msg) from exc


@dataclass(frozen=True)
class ValueCodec:
    """A named pair of functions between external bytes and record values.

    ``prepare``, if any, runs on the driver before a run that writes with the codec (a schema
    registry codec registers or looks up its schema there, see
    :mod:`onceflow.connectors.registry`).
    """

    name: str
    decode: Callable[[bytes], Any]
    encode: Callable[[Any], bytes]
    prepare: Callable[[], None] | None = None
    # Many values at once, as ``decode`` would give each (the source's hot path); may raise
    # where ``decode`` would raise for one of them.
    decode_many: Callable[[list[bytes]], list[Any]] | None = None

    def decode_all(self, values: list[bytes | None]) -> list[Any]:
        """Every value decoded (None stays None); raises if one cannot be."""
        if self.decode_many is not None and None not in values:
            return self.decode_many(values)  # type: ignore[arg-type]
        decode = self.decode
        return [decode(v) if v is not None else None for v in values]


_orjson: Any
try:
    import orjson as _orjson
except ImportError:  # pragma: no cover - a dependency; json alone gives the same values
    _orjson = None

# Integers orjson would read as floats, past 64 bits: below -2**63 (a minus and 19 digits or
# more) or above 2**64 - 1 (20 digits or more); json reads those. orjson reads every other
# number as json does (a 19-digit timestamp in nanoseconds among them; checked in
# tests/kernel/test_codec.py), and a run of digits in a string only takes the slower path.
# The test: digits made zeros, a minus kept, everything else a space, then a search for either
# run (a 2.7 KB Debezium event: 1.9 µs, against 24 µs for a regular expression; 71 bytes:
# 0.35 against 0.7 µs).
_DIGITS_AS_ZEROS = bytes(
    0x30 if 0x30 <= b <= 0x39 else b if b == 0x2D else 0x20 for b in range(256)
)
_LONG_RUNS = (b"0" * 20, b"-" + b"0" * 19)


def _json_decode(data: bytes) -> Any:
    """JSON to a value, as ``json.loads`` reads it.

    orjson reads valid JSON to the same values ~6x faster (3.8 -> 0.6 µs for a small
    object); whatever it refuses (NaN, Infinity, a byte-order mark, lone surrogates, bad
    JSON) goes to ``json.loads``, which accepts what it always did and raises as it always did,
    and integers past 64 bits are left to ``json`` (orjson makes floats of them). Anything
    but bytes (text, say) goes to ``json.loads`` as well.
    """
    if (
        _orjson is not None
        and type(data) is bytes
        and not _long_run(data.translate(_DIGITS_AS_ZEROS))
    ):
        try:
            return _orjson.loads(data)
        except _orjson.JSONDecodeError:
            pass
    return json.loads(data)


_RUN_OF_19 = b"0" * 19  # in every long run: most text has none, and one search says so


def _long_run(shape: bytes) -> bool:
    """Whether digits-as-zeros text holds an integer past 64 bits (see :data:`_LONG_RUNS`).

    One search for 19 digits first (0.09 µs a record over a batch of 1,000 small events,
    against 0.12 for both runs): only text with such a run is searched for either.
    """
    return _RUN_OF_19 in shape and (_LONG_RUNS[0] in shape or _LONG_RUNS[1] in shape)


def _json_decode_many(values: list[bytes]) -> list[Any]:
    """JSON values decoded as :func:`_json_decode` decodes each, in one orjson call apiece.

    The check for long numbers runs once over all the values (a run of digits across two
    values only sends them to the slower path, never to a wrong value).
    """
    loads = _orjson.loads if _orjson is not None else None
    if loads is None or _long_run(b"".join(values).translate(_DIGITS_AS_ZEROS)):
        return [_json_decode(v) for v in values]
    try:
        return list(map(loads, values))
    except (_orjson.JSONDecodeError, TypeError):
        return [_json_decode(v) for v in values]


def _json_record(value: Any) -> Any:
    """A dataclass or pydantic model as a JSON object (a named tuple is an array, as in json).

    A ``datetime`` or ``date`` is its ISO text.
    """
    if isinstance(value, date):
        return value.isoformat()
    found = record_types.fields_of(value)
    if found is None:
        msg = f"Object of type {type(value).__name__} is not JSON serializable"
        raise TypeError(msg)
    return found[1]


def _orjson_default(value: Any) -> Any:
    """What orjson cannot write itself, as :func:`json.dumps` writes it.

    A named tuple (a tuple subclass) as an array, a dataclass or model by :func:`_json_record`.
    """
    if isinstance(value, tuple):
        return list(value)
    return _json_record(value)


# Dataclasses and datetimes go through the default (json writes no datetime; dataclasses by
# their fields as record_types says), not through orjson's own rules.
_ORJSON_OPTIONS = 0
if _orjson is not None:
    _ORJSON_OPTIONS = _orjson.OPT_PASSTHROUGH_DATACLASS | _orjson.OPT_PASSTHROUGH_DATETIME


def _json_encode(value: Any) -> bytes:
    """A value as compact JSON text, UTF-8, as ``json.dumps`` writes it.

    orjson writes the same JSON ~15x faster (measured: 13.9 -> 0.9 µs for a small object on a
    loaded machine). What it refuses (keys that are not text, integers past 64 bits, lone
    surrogates) or writes otherwise (NaN and infinities as ``null``: any output holding
    ``null`` is written again) goes to ``json``, which writes it, or raises, as it always did.
    Floats may be spelt differently (``1.5e-7`` for ``1.5e-07``): the same numbers.
    """
    if _orjson is not None:
        try:
            out: bytes = _orjson.dumps(value, default=_orjson_default, option=_ORJSON_OPTIONS)
        except (TypeError, _orjson.JSONEncodeError):
            pass
        else:
            if b"null" not in out:
                return out
    try:
        return json.dumps(
            value, separators=(",", ":"), ensure_ascii=False, default=_json_record
        ).encode()
    except (TypeError, ValueError) as exc:  # bytes, sets, dicts with tuple keys, cycles, ...
        msg = f"the json codec cannot write a {type(value).__name__}: {exc}"
        raise CodecError(msg) from exc


def _utf8_decode(data: bytes) -> str:
    return data.decode("utf-8")


def _utf8_encode(value: Any) -> bytes:
    if not isinstance(value, str):
        msg = f"the utf-8 codec writes str values, got {type(value).__name__}; map to str first"
        raise CodecError(msg)
    return value.encode("utf-8")


def _raw_decode(data: bytes) -> bytes:
    return bytes(data)


def _raw_encode(value: Any) -> bytes:
    if not isinstance(value, bytes | bytearray):
        msg = f"the raw codec writes bytes values, got {type(value).__name__}; encode first"
        raise CodecError(msg)
    return bytes(value)


CODECS: dict[str, ValueCodec] = {
    "json": ValueCodec("json", _json_decode, _json_encode, decode_many=_json_decode_many),
    "utf-8": ValueCodec("utf-8", _utf8_decode, _utf8_encode),
    "raw": ValueCodec("raw", _raw_decode, _raw_encode),
    "msgpack": ValueCodec("msgpack", decode, encode),
}


def value_codec(name: str) -> ValueCodec:
    """Look up a codec by name (``json``, ``utf-8``, ``raw`` or ``msgpack``)."""
    key = name.lower().replace("utf8", "utf-8").replace("bytes", "raw")
    try:
        return CODECS[key]
    except KeyError:
        known = ", ".join(sorted(CODECS))
        msg = f"unknown codec {name!r}; use one of: {known}"
        if key in ("avro", "protobuf"):
            kind = "Avro" if key == "avro" else "Protobuf"
            msg = (
                f"codec {name!r} needs a schema registry: pass codec=onceflow.codecs.{kind}("
                f"registry=URL, ...) (pip install 'onceflow[{key}]'); named codecs are: {known}"
            )
        raise CodecError(msg) from None
