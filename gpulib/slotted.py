"""Small records with slots, equality and repr over their fields, without
dataclasses.

`gpulib metrics` runs every doctor check once a minute, and importing
dataclasses (it loads inspect, ast and dis) and generating a class's methods
cost it about 10 ms of its 100 ms budget. These two bases give the same
behaviour for the few records the doctor and the boot configuration need:
a subclass lists its fields in `_fields` (declaration order, as repr shows
them) and writes its own typed `__init__`.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, ClassVar, Optional



class Slotted:
    """A mutable record: equal to a record of the same class with equal
    fields; unhashable, as a mutable dataclass."""

    __slots__ = ()
    _fields: ClassVar[tuple[str, ...]] = ()
    # The fields equality (and a frozen record's hash) looks at, when not all.
    _compared: ClassVar[Optional[tuple[str, ...]]] = None

    def _key(self) -> tuple[Any, ...]:
        names = self._fields if self._compared is None else self._compared
        return tuple(getattr(self, f) for f in names)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Slotted)
        return self._key() == other._key()

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in self._fields)
        return f"{type(self).__name__}({fields})"

    __hash__ = None  # type: ignore[assignment]  # mutable: unhashable


class FrozenSlotted(Slotted):
    """An immutable record, hashable over the fields it compares."""

    __slots__ = ()

    def _set(self, name: str, value: Any) -> None:
        """Give a field its value (in `__init__` only)."""
        object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"cannot assign to field {name!r}: {type(self).__name__} "
                             "is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"cannot delete field {name!r}: {type(self).__name__} "
                             "is immutable")

    def __hash__(self) -> int:  # type: ignore[override]  # frozen: hashable again
        return hash(self._key())
