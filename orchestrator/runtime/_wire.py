"""Wire encoding: a JSON header plus raw buffer frames. No pickle, ever.

A message is a list of ZeroMQ frames. Frame 0 is a UTF-8 JSON object (the
header); every other frame is a raw buffer referenced from the header's value
tree by index. Plain JSON values travel as themselves; everything else is a
tagged object ``{"__t": tag, ...}``:

- ``bytes``: ``{"__t": "bytes", "f": frame, "n": nbytes}``
- ``tensor``: ``{"__t": "tensor", "d": dtype, "s": shape, "f": frame, "n": nbytes}``
  (any dtype; the frame is the tensor's contiguous storage viewed as bytes)
- ``tuple``: ``{"__t": "tuple", "v": [...]}``
- ``dict`` with non-string keys (or a ``"__t"`` key): ``{"__t": "dict", "v": [[k, v], ...]}``
- ``model`` (pydantic): ``{"__t": "model", "c": "module:QualName", "v": {field: value}}``
- ``handle`` (mesh or actor handle): ``{"__t": "handle", "v": descriptor}``

Decoding never imports anything and never runs code named by a message: a
model class is resolved only if its module is already imported (otherwise the
fields arrive as a dict and the endpoint's type hints rebuild the model), and
torch is imported only when a tensor descriptor arrives. Every declared size
is checked against the actual frame; any mismatch raises ``WireError``.
"""

from __future__ import annotations

import ctypes
import json
import math
import sys
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticSerializationError, from_json, to_json

from ._errors import WireError

__all__ = ["SCALARS", "SCALAR_TYPES", "decode", "dumps", "encode", "loads", "register_handle_decoder"]

SCALARS = (int, float, str, bool, type(None))
SCALAR_TYPES = frozenset(SCALARS)  # for checking many values at once: `SCALAR_TYPES.issuperset(map(type, xs))`
_SMALL_COPY = 1 << 16  # frames below this are copied into aligned, writable memory
_handle_decoders: dict[str, Callable[[dict[str, Any]], Any]] = {}
_dtypes: dict[str, Any] | None = None


def register_handle_decoder(kind: str, fn: Callable[[dict[str, Any]], Any]) -> None:
    """Register how a handle descriptor of ``kind`` becomes an object again."""
    _handle_decoders[kind] = fn


# Headers are encoded and parsed by pydantic-core's JSON (several times faster than the
# json module on a small header), with the json module as the reference: a header it
# cannot write (a lone surrogate in a string) is written by the json module, and a frame
# it refuses is judged, and the error worded, by the json module. Both write NaN and
# Infinity as the json module does, and read back the same values.
_encoder = json.JSONEncoder(separators=(",", ":"), check_circular=False)
_decoder = json.JSONDecoder()


def dumps(header: dict[str, Any]) -> bytes:
    try:
        return to_json(header, inf_nan_mode="constants")
    except PydanticSerializationError:
        return _encoder.encode(header).encode()


def loads(frame: bytes) -> dict[str, Any]:
    try:
        header = from_json(frame, allow_inf_nan=True)
    except ValueError:
        try:
            header = _decoder.decode(bytes(frame).decode())
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise WireError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header must be a JSON object")
    return header


def _torch_dtypes() -> dict[str, Any]:
    global _dtypes
    if _dtypes is None:
        import torch

        names = [
            "float32",
            "float64",
            "float16",
            "bfloat16",
            "float8_e4m3fn",
            "float8_e5m2",
            "float8_e4m3fnuz",
            "float8_e5m2fnuz",
            "int8",
            "int16",
            "int32",
            "int64",
            "uint8",
            "uint16",
            "uint32",
            "uint64",
            "bool",
            "complex64",
            "complex128",
        ]
        _dtypes = {n: getattr(torch, n) for n in names if hasattr(torch, n)}
    return _dtypes


def encode(value: Any, frames: list[Any], *, where: str = "value") -> Any:
    """Encode ``value`` into a JSON-able tree, appending raw buffers to ``frames``.

    Raises ``TypeError`` naming the position (``where``) of the first value that
    cannot travel. Buffers are referenced, not copied: do not mutate a tensor or
    bytearray until the call that carries it has been answered.
    """
    t = type(value)
    if t in SCALARS:
        return value
    if t is list:
        # A list of plain values (token ids, most often) travels as it is: checking the
        # types is one C-level pass, not a call and an error label per element.
        if all(type(v) in SCALARS for v in value):
            return value
        return [encode(v, frames, where=f"{where}[{i}]") for i, v in enumerate(value)]
    if t is dict:
        if all(type(k) is str for k in value) and "__t" not in value:
            # Plain values are taken as they are, without a call or an error label each.
            return {
                k: v if type(v) in SCALARS else encode(v, frames, where=f"{where}[{k!r}]") for k, v in value.items()
            }
        return {
            "__t": "dict",
            "v": [
                [encode(k, frames, where=f"{where} key"), encode(v, frames, where=f"{where}[{k!r}]")]
                for k, v in value.items()
            ],
        }
    if t is tuple:
        return {"__t": "tuple", "v": [encode(v, frames, where=f"{where}[{i}]") for i, v in enumerate(value)]}
    if t in (bytes, bytearray, memoryview):
        buf = memoryview(value)
        if not buf.c_contiguous:
            buf = memoryview(buf.tobytes())
        buf = buf.cast("B") if buf.ndim != 1 or buf.format != "B" else buf
        frames.append(buf)
        return {"__t": "bytes", "f": len(frames), "n": buf.nbytes}
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return _encode_tensor(value, frames, where)
    if isinstance(value, BaseModel):
        return _encode_model(value, frames, where)
    wire = getattr(value, "__flotilla_wire__", None)
    if wire is not None:
        return {"__t": "handle", "v": wire()}
    # int/str/float subclasses (IntEnum, StrEnum, numpy float64) travel as their plain value.
    for base in (int, float, str):
        if isinstance(value, base):
            return base(value)
    raise TypeError(
        f"{where}: cannot send a value of type {t.__module__}.{t.__qualname__} "
        "(allowed: JSON types, bytes, torch tensors, pydantic models, lists/tuples/"
        "dicts of these, mesh and actor handles)"
    )


def _encode_tensor(value: Any, frames: list[Any], where: str) -> dict[str, Any]:
    import torch

    if value.layout != torch.strided or value.is_quantized:
        raise TypeError(f"{where}: only dense tensors can be sent (got layout {value.layout})")
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in _torch_dtypes():
        raise TypeError(f"{where}: tensor dtype {value.dtype} cannot be sent")
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.is_conj() or t.is_neg():  # a lazy conjugate or negative view: its bytes are not its values
        t = t.resolve_conj().resolve_neg()
    shape = list(t.shape)
    if t.numel() == 0:
        return {"__t": "tensor", "d": dtype, "s": shape, "f": None, "n": 0}
    # A zero-copy byte view of the storage (ctypes, so numpy is not needed): a contiguous
    # tensor's bytes start at its data pointer, so no reshape or view to bytes first (each
    # torch call costs microseconds on a small tensor). The view holds the tensor, so the
    # storage stays alive while ZeroMQ still queues the frame.
    view = (ctypes.c_uint8 * (t.numel() * t.element_size())).from_address(t.data_ptr())
    view._tensor = t  # type: ignore[attr-defined]
    buf = memoryview(view).cast("B")
    frames.append(buf)
    return {"__t": "tensor", "d": dtype, "s": shape, "f": len(frames), "n": buf.nbytes}


_models: dict[type[BaseModel], tuple[str, int]] = {}  # class -> (its path, its number of fields)


def _encode_model(value: BaseModel, frames: list[Any], where: str) -> dict[str, Any]:
    cls = type(value)
    info = _models.get(cls)
    if info is None:
        info = _models[cls] = (f"{cls.__module__}:{cls.__qualname__}", len(cls.model_fields))
    # A model's fields are its instance dict (extra fields and private attributes live
    # elsewhere): when they are all plain values, the dict travels as it is, checked in C.
    held = value.__dict__
    if len(held) == info[1]:
        if SCALAR_TYPES.issuperset(map(type, held.values())):
            return {"__t": "model", "c": info[0], "v": dict(held)}
        items: Any = held.items()
    else:  # not all fields set (`model_construct`): as the class declares them
        items = ((name, getattr(value, name)) for name in cls.model_fields)
    fields: dict[str, Any] = {}
    for name, v in items:
        if type(v) in SCALARS:  # most fields: no call, no error label
            fields[name] = v
            continue
        try:
            fields[name] = encode(v, frames, where=f"{where}.{name}")
        except TypeError:
            # Model fields may hold types pydantic can serialize (enums, datetimes,
            # paths); the model's own validation rebuilds them on arrival.
            from pydantic_core import PydanticSerializationError, to_jsonable_python

            try:
                fields[name] = to_jsonable_python(v)
            except PydanticSerializationError:
                raise TypeError(
                    f"{where}.{name}: cannot send a value of type {type(v).__module__}.{type(v).__qualname__}"
                ) from None
    return {"__t": "model", "c": info[0], "v": fields}


class _Frames:
    """The frames of one message, each usable exactly once."""

    __slots__ = ("frames", "used")

    def __init__(self, frames: list[Any]) -> None:
        self.frames = frames
        self.used = 0

    def take(self, index: Any, nbytes: Any, where: str) -> memoryview:
        if type(index) is not int or not 1 <= index < len(self.frames):
            raise WireError(
                f"{where}: frame index {index!r} out of range (message has {len(self.frames) - 1} data frames)"
            )
        frame = self.frames[index]
        if frame is None:
            raise WireError(f"{where}: frame {index} referenced twice")
        self.frames[index] = None
        self.used += 1
        buf = frame if isinstance(frame, memoryview) else getattr(frame, "buffer", None)
        if buf is None:
            buf = memoryview(frame)
        if type(nbytes) is not int or nbytes != buf.nbytes:
            raise WireError(f"{where}: declared {nbytes!r} bytes but frame {index} has {buf.nbytes}")
        return buf


def decode(tree: Any, frames: list[Any]) -> Any:
    """Rebuild the value tree from a header and its data frames (frames[0] is the header).

    Raises ``WireError`` for any inconsistency, including unreferenced frames.
    """
    fr = _Frames(list(frames))
    out = _decode(tree, fr, "value", 0)
    if fr.used != len(frames) - 1:
        raise WireError(f"message has {len(frames) - 1} data frames but references {fr.used}")
    return out


def _decode(x: Any, fr: _Frames, where: str, depth: int) -> Any:
    t = type(x)
    if t in SCALARS:
        return x
    if depth > 200:
        raise WireError(f"{where}: nesting too deep")
    if t is list:
        if all(type(v) in SCALARS for v in x):
            return x  # freshly parsed JSON: nothing to rebuild
        return [_decode(v, fr, where, depth + 1) for v in x]
    if t is not dict:
        raise WireError(f"{where}: unexpected JSON value of type {t.__name__}")
    tag = x.get("__t")
    if tag is None:
        if SCALAR_TYPES.issuperset(map(type, x.values())):
            return x  # freshly parsed JSON of plain values: nothing to rebuild
        return {k: _decode(v, fr, where, depth + 1) for k, v in x.items()}
    if tag == "bytes":
        return bytes(fr.take(x.get("f"), x.get("n"), where))
    if tag == "tensor":
        return _decode_tensor(x, fr, where)
    if tag == "tuple":
        items = x.get("v")
        if type(items) is not list:
            raise WireError(f"{where}: malformed tuple")
        return tuple(_decode(v, fr, where, depth + 1) for v in items)
    if tag == "dict":
        items = x.get("v")
        if type(items) is not list or not all(type(p) is list and len(p) == 2 for p in items):
            raise WireError(f"{where}: malformed dict")
        try:
            return {_decode(k, fr, where, depth + 1): _decode(v, fr, where, depth + 1) for k, v in items}
        except TypeError as exc:  # unhashable key
            raise WireError(f"{where}: bad dict key: {exc}") from None
    if tag == "model":
        return _decode_model(x, fr, where, depth)
    if tag == "handle":
        desc = x.get("v")
        kind = desc.get("kind") if type(desc) is dict else None
        decoder = _handle_decoders.get(kind) if type(kind) is str else None
        if decoder is None:
            raise WireError(f"{where}: unknown handle kind {kind!r}")
        try:
            return decoder(desc)
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"{where}: malformed handle: {exc!r}") from None
    raise WireError(f"{where}: unknown tag {tag!r}")


def _decode_tensor(x: dict[str, Any], fr: _Frames, where: str) -> Any:
    dtypes = _torch_dtypes()
    name, shape, n = x.get("d"), x.get("s"), x.get("n")
    if type(name) is not str or name not in dtypes:
        raise WireError(f"{where}: unknown tensor dtype {name!r}")
    if type(shape) is not list or not all(type(s) is int and s >= 0 for s in shape):
        raise WireError(f"{where}: bad tensor shape {shape!r}")
    import torch

    dtype = dtypes[name]
    expected = math.prod(shape) * dtype.itemsize
    if n != expected:
        raise WireError(f"{where}: tensor {name}{shape} needs {expected} bytes, header says {n!r}")
    if expected == 0:
        if x.get("f") is not None:
            raise WireError(f"{where}: empty tensor must not reference a frame")
        return torch.empty(shape, dtype=dtype)
    buf = fr.take(x.get("f"), n, where)
    if n < _SMALL_COPY or buf.readonly:
        # A fresh bytearray is aligned for every dtype: read it as the dtype at once.
        out = torch.frombuffer(bytearray(buf), dtype=dtype)
        return out if len(shape) == 1 else out.reshape(shape)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # zero-copy; keeps the frame alive
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()  # ZeroMQ buffers are 8-byte aligned: only complex128 copies
    return raw.view(dtype).reshape(shape)


def _decode_model(x: dict[str, Any], fr: _Frames, where: str, depth: int) -> Any:
    path, fields = x.get("c"), x.get("v")
    if type(path) is not str or type(fields) is not dict:
        raise WireError(f"{where}: malformed model")
    if SCALAR_TYPES.issuperset(map(type, fields.values())):
        values = fields  # freshly parsed JSON of plain values: nothing to rebuild
    else:
        values = {k: v if type(v) in SCALARS else _decode(v, fr, f"{where}.{k}", depth + 1) for k, v in fields.items()}
    cls = _classes.get(path) or _loaded_class(path)
    if cls is None:
        return values
    try:
        return cls.model_validate(values)
    except Exception as exc:
        raise WireError(f"{where}: invalid {path}: {exc}") from None


def _loaded_class(path: str) -> type[BaseModel] | None:
    module, _, qual = path.partition(":")
    obj: Any = sys.modules.get(module)
    for part in qual.split("."):
        if obj is None or part.startswith("__"):
            return None
        # vars(), not getattr(): a module __getattr__ (lazy imports) must not run for a message
        obj = vars(obj).get(part) if hasattr(obj, "__dict__") else None
    if isinstance(obj, type) and issubclass(obj, BaseModel):
        _classes[path] = obj
        return obj
    return None


_classes: dict[str, type[BaseModel]] = {}
"""Model classes found by path (only classes already imported here are ever found; a path
found once is not looked up again)."""
