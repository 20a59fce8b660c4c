"""Errors that reach a user, each with the exit code an entry point returns.

Exit codes (documented in gpulib(1) and the hooks' man pages):
  0  success
  1  the operation failed (kernel refused, device missing, nothing available)
  2  bad input or usage (malformed XML, bad UUID, unknown option)
  3  busy: the state lock could not be taken in time
  4  state problem (state file from a newer version, unwritable state)
"""

from __future__ import annotations

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_BUSY = 3
EXIT_STATE = 4


class GpulibError(Exception):
    """Base class: the message is one line meant for an operator."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str) -> None:
        # Errors end up on one stderr line the CloudStack agent and libvirt
        # show verbatim: fold anything multi-line.
        super().__init__(" ".join(str(message).split()))

    @property
    def message(self) -> str:
        return str(self.args[0])


class InputError(GpulibError):
    """The caller gave something malformed: fix the input and retry."""

    exit_code = EXIT_USAGE


class DeviceError(GpulibError):
    """A device is missing, busy, or the kernel refused an operation."""


class NotAvailableError(DeviceError):
    """Nothing free satisfies a request (no instances left, pool empty)."""


class ConfigError(GpulibError):
    """A bad value in gpulib.conf (names file, section and key)."""

    exit_code = EXIT_USAGE


class StateError(GpulibError):
    """The state file cannot be used as it is."""

    exit_code = EXIT_STATE


class LockTimeout(GpulibError):
    """Another gpulib process held the state lock for too long."""

    exit_code = EXIT_BUSY

