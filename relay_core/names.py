"""The names of objects a handler made, read without running the handler's code.

An error's class, a result's, a backoff's delay: ``type(x).__name__`` goes
through the class's metaclass, which may make ``__name__`` anything, or
raise. The worker reads those names while it records the attempt, and an
exception there ended the slot's thread, or the lease watch's, with the job
held.
"""

from __future__ import annotations

#: The longest class name kept: a class made at run time may have any name.
MAX_TYPE_NAME_CHARS = 200

_CLASS_NAME = type.__dict__["__name__"]


def type_name(value: object) -> str:
    """The name of ``value``'s class as the class itself holds it (type's own descriptor, which no
    metaclass overrides), at most MAX_TYPE_NAME_CHARS."""
    return _CLASS_NAME.__get__(type(value))[:MAX_TYPE_NAME_CHARS]


def shown(value: object) -> str:
    """``repr(value)`` where it can be made, else its class's name: a repr is the value's own code
    (``repr`` itself refuses one that returns no string)."""
    try:
        return repr(value)
    except BaseException:
        return f"a {type_name(value)} that cannot be shown"
