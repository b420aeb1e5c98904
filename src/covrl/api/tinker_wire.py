"""The protobuf messages of Tinker's REST API that `covrl serve` reads and writes, in plain Python.

Tinker's SDK (0.38) sends `forward_backward` requests as protobuf (`application/x-protobuf`, optionally zstd
compressed) and accepts the results of `sample` and `forward_backward` only as protobuf; everything else is
JSON. The field numbers below are the SDK's schema (package `tinker_public`); this module reads and writes the
wire format itself, so the server needs neither the SDK nor the protobuf runtime. Tested against the SDK's own
encoder and decoder (tests/api/test_tinker_server.py).

Wire format: each field is a varint key `number << 3 | wire_type`; wire type 0 is a varint, 1 eight bytes,
2 a length-prefixed payload (strings, bytes, sub-messages, packed repeated numbers), 5 four bytes.
"""

from __future__ import annotations

import contextlib
import struct
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

__all__ = ["WireDatum", "WireError", "decode_forward_backward_request", "encode_forward_backward_output",
           "encode_sample_response"]

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
_NUMPY = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}
_STOP_REASON = {"stop": 0, "length": 1}
# the names of ForwardBackwardRequest's and its parts' fields, for messages about a malformed one
_REQUEST_FIELDS = {1: "model_id", 2: "seq_id", 3: "data", 4: "loss_fn", 5: "loss_fn_config", 6: "forward_only",
                   7: "loss_fn_config"}
_DATUM_FIELDS = {1: "model_input.chunks", 2: "loss_fn_inputs"}
_TENSOR_FIELDS = {1: "data", 2: "sparse", 3: "dtype", 4: "shape"}
MAX_SPARSE_VALUES = 1 << 24    # a sparse tensor's dense size: a few bytes must not ask for gigabytes


class WireError(ValueError):
    """A protobuf payload that is not a well-formed message of the expected kind."""


# ------------------------------------------------------------------------------------------------ reading

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def _fields(buf: bytes, where: str, names: dict[int, str] | None = None) -> dict[int, list]:
    """Field number -> the values met, in order (ints for varints / fixed widths, bytes for payloads). A malformed
    message is a WireError naming `where` and, once its key is read, the field."""
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise WireError(f"{where}: a number where a sub-message (length-delimited) belongs")
    out: dict[int, list] = defaultdict(list)
    pos = 0
    while pos < len(buf):
        try:
            key, pos = _varint(buf, pos)
        except WireError as err:
            raise WireError(f"{where}: {err} at byte {pos}") from None
        number, wire = key >> 3, key & 7
        label = f"{where}.{(names or {}).get(number, f'field {number}')}"
        try:
            if wire == 0:
                value, pos = _varint(buf, pos)
            elif wire == 1:
                value, pos = buf[pos:pos + 8], pos + 8
            elif wire == 2:
                size, pos = _varint(buf, pos)
                value, pos = buf[pos:pos + size], pos + size
            elif wire == 5:
                value, pos = buf[pos:pos + 4], pos + 4
            else:
                raise WireError(f"unsupported wire type {wire}")
        except WireError as err:
            raise WireError(f"{label}: {err}") from None
        if pos > len(buf):
            raise WireError(f"{label}: payload runs past the end of the message")
        out[number].append(value)
    return out


@contextlib.contextmanager
def _within(where: str):
    """Any error reading the part `where` names becomes a WireError naming it."""
    try:
        yield
    except WireError as err:
        if str(err).startswith(where):
            raise
        raise WireError(f"{where}: {err}") from None
    except (ValueError, TypeError, IndexError, OverflowError, struct.error) as err:
        raise WireError(f"{where}: {err}") from None


def _payload(value, where: str) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise WireError(f"{where}: a number where a length-delimited value belongs")
    return bytes(value)


def _last(fields: dict[int, list], number: int, default=None):
    values = fields.get(number)
    return values[-1] if values else default


def _text(value: bytes | None, where: str = "text") -> str:
    if value is None:
        return ""
    try:
        return _payload(value, where).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"{where}: not UTF-8 text") from None


def _packed_ints(values: list) -> list[int]:
    """A repeated int64 field, packed (one payload of varints) or not (one varint per element)."""
    out: list[int] = []
    for v in values:
        if isinstance(v, int):
            out.append(v)
            continue
        pos = 0
        while pos < len(v):
            n, pos = _varint(v, pos)
            out.append(n)
    return [n - (1 << 64) if n >= 1 << 63 else n for n in out]


def _tensor(buf: bytes, where: str) -> np.ndarray:
    f = _fields(buf, where, _TENSOR_FIELDS)
    with _within(where):
        dtype = _last(f, 3, 0)
        if dtype not in _NUMPY:
            raise WireError(f"{where}.dtype: {dtype} is not float32, int64 or int32")
        shape = _packed_ints(f.get(4, []))
        if any(n < 0 for n in shape):
            raise WireError(f"{where}.shape: {shape} has a negative size")
        if 2 in f:
            sparse = f"{where}.sparse"
            csr = _fields(_last(f, 2), sparse)
            values = np.frombuffer(_payload(_last(csr, 1, b""), sparse), dtype=_NUMPY[dtype])
            crow = np.frombuffer(_payload(_last(csr, 2, b""), sparse), dtype=np.int64)
            col = np.frombuffer(_payload(_last(csr, 3, b""), sparse), dtype=np.int64)
            if len(shape) != 2 or len(crow) != shape[0] + 1:
                raise WireError(f"{where}: a sparse tensor needs a 2-D shape and rows + 1 row offsets")
            if shape[0] * shape[1] > MAX_SPARSE_VALUES:
                raise WireError(f"{where}.shape: {shape} is over {MAX_SPARSE_VALUES} values")
            dense = np.zeros(shape, dtype=_NUMPY[dtype])
            for row in range(shape[0]):
                dense[row, col[crow[row]:crow[row + 1]]] = values[crow[row]:crow[row + 1]]
            return dense
        array = np.frombuffer(_payload(_last(f, 1, b""), f"{where}.data"), dtype=_NUMPY[dtype]).copy()
        if shape:
            if int(np.prod(shape)) != array.size:
                raise WireError(f"{where}: {array.size} values do not fill shape {shape}")
            array = array.reshape(shape)
        return array


@dataclass
class WireDatum:
    """One Datum of a forward_backward request: the model input's tokens and the loss inputs by name."""
    tokens: list[int]
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)


def _map_entries(values: list, where: str) -> list[tuple[str, bytes | int | None]]:
    entries = []
    for raw in values:
        e = _fields(raw, where, {1: "key", 2: "value"})
        entries.append((_text(_last(e, 1), f"{where}.key"), _last(e, 2)))
    return entries


def decode_forward_backward_request(buf: bytes) -> dict:
    """`ForwardBackwardRequest` -> {model_id, seq_id, loss_fn, loss_fn_config, forward_only, data: [WireDatum]}.
    A model input chunk that is not text (an image, audio) is refused by name: covrl's models read tokens. A
    malformed message is a WireError naming the field (`data[0].loss_fn_inputs['weights']: ...`)."""
    f = _fields(buf, "ForwardBackwardRequest", _REQUEST_FIELDS)
    data = []
    for i, raw in enumerate(f.get(3, [])):
        d = _fields(raw, f"data[{i}]", _DATUM_FIELDS)
        tokens: list[int] = []
        for j, raw_chunk in enumerate(d.get(1, [])):
            where = f"data[{i}].model_input.chunks[{j}]"
            chunk = _fields(raw_chunk, where)
            if 1 not in chunk:
                kind = "an image" if 2 in chunk else "audio" if 3 in chunk else "an unknown chunk"
                raise WireError(f"data[{i}].model_input: {kind}; covrl's models take text (token) chunks only")
            text = _fields(_last(chunk, 1), f"{where}.tokens")
            with _within(f"{where}.tokens"):
                raw_tokens = _payload(_last(text, 1, b""), f"{where}.tokens")
                tokens.extend(np.frombuffer(raw_tokens, dtype=np.int32).tolist())
        inputs = {name: _tensor(value or b"", f"data[{i}].loss_fn_inputs[{name!r}]")
                  for name, value in _map_entries(d.get(2, []), f"data[{i}].loss_fn_inputs")}
        data.append(WireDatum(tokens, inputs))
    config: dict[str, float | str] = {}
    for name, value in _map_entries(f.get(5, []), "loss_fn_config"):
        where = f"loss_fn_config[{name!r}]"
        with _within(where):
            config[name] = struct.unpack("<d", _payload(value, where))[0] if value is not None else 0.0
    for name, value in _map_entries(f.get(7, []), "loss_fn_config"):     # v2 wins where both are set
        where = f"loss_fn_config[{name!r}]"
        v = _fields(value or b"", where)
        with _within(where):
            config[name] = (_text(_last(v, 2), where) if 2 in v
                            else struct.unpack("<d", _payload(_last(v, 1, bytes(8)), where))[0])
    seq_id, forward_only = _last(f, 2, 0), _last(f, 6, 0)
    for name, value in (("seq_id", seq_id), ("forward_only", forward_only)):
        if not isinstance(value, int):
            raise WireError(f"ForwardBackwardRequest.{name}: a length-delimited value where a number belongs")
    return {"model_id": _text(_last(f, 1), "ForwardBackwardRequest.model_id"), "seq_id": seq_id, "data": data,
            "loss_fn": _text(_last(f, 4), "ForwardBackwardRequest.loss_fn"), "loss_fn_config": config or None,
            "forward_only": bool(forward_only)}


# ------------------------------------------------------------------------------------------------ writing

def _put_varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(number: int, payload: bytes) -> bytes:
    return _put_varint(number << 3 | 2) + _put_varint(len(payload)) + payload


def _int_field(number: int, value: int) -> bytes:
    return _put_varint(number << 3) + _put_varint(int(value))


def _double_field(number: int, value: float) -> bytes:
    return _put_varint(number << 3 | 1) + struct.pack("<d", float(value))


def encode_sample_response(sequences: list[tuple[str, list[int], list[float] | None]],
                           prompt_logprobs: list[float | None] | None = None) -> bytes:
    """`SampleResponse`: each sequence (stop reason "stop" | "length", tokens, log-probs); `prompt_logprobs` one
    per prompt token (None, the first, is sent as NaN, which the SDK reads back as None)."""
    out = bytearray()
    for stop_reason, tokens, logprobs in sequences:
        seq = _int_field(1, _STOP_REASON[stop_reason]) + _len_field(2, np.asarray(tokens, np.int32).tobytes())
        if logprobs is not None:
            seq += _len_field(3, np.asarray(logprobs, np.float32).tobytes())
        out += _len_field(1, seq)
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        out += _len_field(2, np.asarray(values, np.float32).tobytes())
    return bytes(out)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float],
                                   output_type: str = "ArrayRecord") -> bytes:
    """`ForwardBackwardOutput`: one ArrayRecord of every datum's outputs (field -> 1-D float32 per datum,
    concatenated with byte offsets), and the metrics."""
    names = sorted({name for row in outputs for name in row})
    record = _len_field(1, output_type.encode()) + _int_field(3, len(outputs))
    for name in names:
        parts = [np.asarray(row[name], np.float32).reshape(-1) for row in outputs]
        offsets = np.cumsum([0] + [p.nbytes for p in parts]).astype(np.int64)
        batched = (_len_field(1, b"".join(p.tobytes() for p in parts)) + _len_field(2, offsets.tobytes())
                   + _int_field(3, DTYPE_FLOAT32))
        record += _len_field(2, _len_field(1, name.encode()) + _len_field(2, batched))
    out = _len_field(1, output_type.encode()) + _len_field(2, record)
    for key, value in metrics.items():
        out += _len_field(3, _len_field(1, str(key).encode()) + _double_field(2, value))
    return out
