"""Records as users write them: dataclasses, named tuples and pydantic models.

A value of such a class crosses a stage boundary (a shuffle, a backup, keyed state) as its
class's name and its fields; the receiving worker builds the same class again. Which classes
may be built is decided by the pipeline, never by the data: the classes its functions can
see (the globals of every user function and of every combine function, found when the
pipeline is lowered) travel with each stage and are registered in the worker before a record
is read, and a class of a module the worker has already imported may be built too. A name
that matches none of these is an error naming the class: decoding never imports a module and
never builds anything but a record class (unlike pickle, which runs what the data says).

A class is built the way its fields were read: a dataclass through its ``__init__`` (so its
``__post_init__`` runs; fields with ``init=False`` are set after), a named tuple from its
fields in order, a pydantic model with ``model_construct`` (its data was valid when made).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from onceflow.kernel.errors import CodecError

_known: dict[str, type] = {}
_lock = threading.Lock()


def is_record_type(cls: Any) -> bool:
    """A dataclass, named tuple or pydantic model class."""
    if not isinstance(cls, type):
        return False
    if dataclasses.is_dataclass(cls):
        return True
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return True
    return hasattr(cls, "model_fields") and hasattr(cls, "model_construct")


def type_name(cls: type) -> str:
    """``module:qualified name``: what a record's class is called in its encoded form."""
    return f"{cls.__module__}:{cls.__qualname__}"


def register(classes: Iterable[type]) -> None:
    """Let records of these classes be built here (later registrations of a name win)."""
    with _lock:
        for cls in classes:
            _known[type_name(cls)] = cls


def fields_of(value: Any) -> tuple[str, dict[str, Any]] | None:
    """``(class name, fields)`` of a record value; None for any other value.

    The value's class is registered: a value made in this process can be read back in it.
    """
    cls = type(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif isinstance(value, tuple) and hasattr(cls, "_fields"):
        fields = dict(zip(cls._fields, value, strict=True))
    elif hasattr(cls, "model_fields") and hasattr(cls, "model_construct"):
        fields = {name: getattr(value, name) for name in cls.model_fields}
    else:
        return None
    name = type_name(cls)
    if _known.get(name) is not cls:
        register([cls])
    return name, fields


def build(name: str, fields: dict[str, Any]) -> Any:
    """The record of class ``name`` with these fields (see the module docstring)."""
    cls = _known.get(name) or _imported(name)
    if cls is None:
        msg = (
            f"a record of class {name.partition(':')[2]!r} (module {name.partition(':')[0]!r}) "
            "cannot be read here: define the class at the top level of the pipeline file or "
            "of a module it imports, where the pipeline's functions see it"
        )
        raise CodecError(msg)
    try:
        return _construct(cls, fields)
    except (TypeError, ValueError) as exc:
        msg = f"cannot rebuild a {cls.__qualname__} from its fields: {exc}"
        raise CodecError(msg) from exc


def _construct(cls: type, fields: dict[str, Any]) -> Any:
    if dataclasses.is_dataclass(cls):
        init = {f.name for f in dataclasses.fields(cls) if f.init}
        obj = cls(**{k: v for k, v in fields.items() if k in init})
        for k, v in fields.items():
            if k not in init:
                object.__setattr__(obj, k, v)
        return obj
    if issubclass(cls, tuple):
        return cls(*(fields[f] for f in cls._fields))  # type: ignore[attr-defined]
    return cls.model_construct(**fields)  # type: ignore[attr-defined]


def _imported(name: str) -> type | None:
    """A record class of a module already imported here (never imports one)."""
    module_name, _, qualname = name.partition(":")
    obj: Any = sys.modules.get(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if not is_record_type(obj):
        return None
    register([obj])
    return obj  # type: ignore[no-any-return]


def visible_types(functions: Iterable[Any]) -> tuple[type, ...]:
    """The record classes user functions can see: their globals' and closures' (recursively).

    A combine function (an object) is looked at through its methods.
    """
    found: dict[str, type] = {}
    seen: set[int] = set()
    todo = list(functions)
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        if not callable(fn) or isinstance(fn, type):
            continue
        code_owner: Callable[..., Any] | None = fn if hasattr(fn, "__globals__") else None
        if code_owner is None:  # an object: its class's methods (a CombineFn, a partial)
            todo.append(getattr(fn, "func", None))  # functools.partial
            todo.extend(v for v in vars(type(fn)).values() if hasattr(v, "__globals__"))
            continue
        for value in code_owner.__globals__.values():
            if is_record_type(value) and not value.__module__.startswith("onceflow."):
                found[type_name(value)] = value
        for cell in code_owner.__closure__ or ():
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if is_record_type(content):
                found[type_name(content)] = content
            elif callable(content):
                todo.append(content)
    return tuple(found[k] for k in sorted(found))
