"""One change a command made or planned, as its report lists it (restore,
reconcile, pool apply, the definitions followed)."""

from __future__ import annotations


class Outcome:
    def __init__(self, kind: str, ident: str, action: str, ok: bool, detail: str = "") -> None:
        self.kind = kind
        self.ident = ident
        self.action = action
        self.ok = ok
        self.detail = detail

    def as_dict(self) -> dict[str, object]:
        return {"kind": self.kind, "id": self.ident, "action": self.action, "ok": self.ok,
                "detail": self.detail}

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAILED"
        extra = f": {self.detail}" if self.detail else ""
        return f"{status:6s} {self.action} {self.kind} {self.ident}{extra}"
