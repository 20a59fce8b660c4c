"""Regular expressions compiled on first use.

The hooks import a dozen modules on every VM start; compiling every
module-level pattern at import costs them milliseconds, most of it for
patterns that path never uses.
"""

from __future__ import annotations

import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class _LazyPattern:
    __slots__ = ("_args", "_compiled")

    def __init__(self, pattern: str, flags: int) -> None:
        self._args = (pattern, flags)
        self._compiled: re.Pattern[str] | None = None

    def __getattr__(self, name: str) -> Any:
        if self._compiled is None:
            self._compiled = re.compile(*self._args)
        return getattr(self._compiled, name)


def lazy(pattern: str, flags: int = 0) -> re.Pattern[str]:
    """Behaves as re.compile(pattern, flags), compiled when first used."""
    # A stand-in that answers as the pattern does (typing.cast without typing).
    return _LazyPattern(pattern, flags)  # type: ignore[return-value]
