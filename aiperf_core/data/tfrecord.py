"""TFRecord files and tf.train.Example messages, read and written without TensorFlow.

A TFRecord file is a sequence of records, each framed as
    uint64 length (little endian) | uint32 masked CRC-32C of the length bytes | data | uint32 masked CRC-32C of data.
The data of an ImageNet shard is a serialized tf.train.Example:
    Example { Features features = 1 }
    Features { map<string, Feature> feature = 1 }          (map entries: key = 1, value = 2)
    Feature { oneof { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3 } }
    BytesList { repeated bytes value = 1 }   FloatList { repeated float value = 1 [packed] }
    Int64List { repeated int64 value = 1 [packed] }
Only these few messages are needed, so they are encoded and decoded here by hand.
"""

from __future__ import annotations

import struct
from typing import BinaryIO, Iterator, Mapping, Sequence

from aiperf_core.data.crc32c import masked_crc32c
from aiperf_core.errors import AiperfError

HEADER = struct.Struct("<QI")
FOOTER = struct.Struct("<I")


class CorruptRecord(AiperfError):
    """A record whose framing or checksum is wrong."""


# -- framing -----------------------------------------------------------------------------------


def frame(data: bytes) -> bytes:
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + FOOTER.pack(masked_crc32c(data))


def read_header(fh: BinaryIO, where: str) -> int | None:
    """The length of the record starting at fh's position, or None at a clean end of file."""
    head = fh.read(HEADER.size)
    if not head:
        return None
    if len(head) < HEADER.size:
        raise CorruptRecord(f"{where}: truncated record header")
    length, crc = HEADER.unpack(head)
    if masked_crc32c(head[:8]) != crc:
        raise CorruptRecord(f"{where}: bad length checksum")
    return length


def check_data(data: bytes, footer: bytes, length: int, where: str) -> bytes:
    if len(data) < length or len(footer) < FOOTER.size:
        raise CorruptRecord(f"{where}: truncated record")
    if masked_crc32c(data) != FOOTER.unpack(footer)[0]:
        raise CorruptRecord(f"{where}: bad data checksum")
    return data


def read_at(fh: BinaryIO, offset: int, length: int, where: str) -> bytes:
    """The data of the record whose data starts at `offset` (after its header), checksum checked."""
    fh.seek(offset)
    blob = fh.read(length + FOOTER.size)
    return check_data(blob[:length], blob[length:], length, where)


def scan(fh: BinaryIO, where: str) -> Iterator[tuple[int, bytes]]:
    """(data offset, data) of every record in order. A broken header ends the file (the rest cannot
    be framed); a record with a bad data checksum raises CorruptRecord, after which scanning can go on."""
    while True:
        start = fh.tell()
        length = read_header(fh, f"{where} @{start}")
        if length is None:
            return
        offset = fh.tell()
        data = fh.read(length)
        footer = fh.read(FOOTER.size)
        yield offset, check_data(data, footer, length, f"{where} @{start}")


# -- protobuf wire format ----------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64s are 10-byte two's complement
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise CorruptRecord("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CorruptRecord("varint too long")


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _fields(buf: bytes) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) of a message: ints for varints, bytes for length-delimited."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise CorruptRecord("truncated field")
            value, pos = buf[pos:pos + size], pos + size
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        else:
            raise CorruptRecord(f"unsupported wire type {wire}")
        yield number, wire, value


Feature = list  # list[bytes] | list[int] | list[float]


def encode_example(features: Mapping[str, Sequence[bytes] | Sequence[int] | Sequence[float]]) -> bytes:
    entries = []
    for key, values in features.items():
        values = list(values)
        if all(isinstance(v, (bytes, bytearray)) for v in values):
            body = _field(1, b"".join(_field(1, bytes(v)) for v in values))
        elif all(isinstance(v, int) for v in values):
            body = _field(3, _field(1, b"".join(_varint(v) for v in values)))
        elif all(isinstance(v, float) for v in values):
            body = _field(2, _field(1, struct.pack(f"<{len(values)}f", *values)))
        else:
            raise AiperfError(f"feature '{key}': values must be all bytes, all ints or all floats")
        entries.append(_field(1, _field(1, key.encode("utf-8")) + _field(2, body)))
    return _field(1, b"".join(entries))


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _decode_feature(buf: bytes) -> Feature:
    for number, _, payload in _fields(buf):
        if number == 1:  # BytesList
            return [bytes(v) for n, w, v in _fields(payload) if n == 1 and w == 2]
        if number == 2:  # FloatList, packed or not
            out: list = []
            for n, w, v in _fields(payload):
                if n == 1:
                    out.extend(struct.unpack(f"<{len(v) // 4}f", v) if w == 2 else struct.unpack("<f", v))
            return out
        if number == 3:  # Int64List, packed or not
            out = []
            for n, w, v in _fields(payload):
                if n != 1:
                    continue
                if w == 0:
                    out.append(_signed(v))
                else:
                    pos = 0
                    while pos < len(v):
                        value, pos = _read_varint(v, pos)
                        out.append(_signed(value))
            return out
    return []


def decode_example(data: bytes) -> dict[str, Feature]:
    """The features of a serialized tf.train.Example, by key."""
    features: dict[str, Feature] = {}
    for number, wire, payload in _fields(data):
        if number != 1 or wire != 2:
            continue
        for n, w, entry in _fields(payload):
            if n != 1 or w != 2:
                continue
            key, value = None, b""
            for en, ew, ev in _fields(entry):
                if en == 1 and ew == 2:
                    key = bytes(ev).decode("utf-8", "replace")
                elif en == 2 and ew == 2:
                    value = ev
            if key is not None:
                features[key] = _decode_feature(value)
    return features
