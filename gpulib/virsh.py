"""libvirt's persistent domain definitions, through the `virsh` client.

Only the CLI's `attach`/`detach` use this: the hooks never talk to libvirt
(a hook calling back into libvirtd deadlocks it). virsh rather than the
libvirt Python binding because gpulib takes no dependency beyond lxml, click
and pyudev; every libvirt host has virsh (libvirt-clients,
libvirt-client), and `virsh dumpxml` / `virsh define` are exactly the
operations an administrator would run by hand.

The connection: `--connect URI` when given, else whatever virsh picks
(`LIBVIRT_DEFAULT_URI`, then its own default).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from typing import NamedTuple, Optional

from gpulib import logger
from gpulib.errors import DeviceError, GpulibError, InputError

log = logger.get(__name__)

# virsh answers in milliseconds; a hung libvirtd must not hang the CLI forever.
VIRSH_TIMEOUT = 60.0


class LibvirtError(GpulibError):
    """virsh failed for a reason other than the ones the CLI names itself."""


class DomainInfo(NamedTuple):
    name: str
    state: str  # as virsh prints it: "running", "shut off", "paused", ...
    persistent: bool

    @property
    def running(self) -> bool:
        return self.state not in ("shut off", "crashed")


class Virsh:
    """A few virsh commands against one connection."""

    def __init__(self, uri: Optional[str] = None, program: str = "virsh",
                 timeout: float = VIRSH_TIMEOUT) -> None:
        self.uri = uri
        self.program = program
        self.timeout = timeout

    @property
    def where(self) -> str:
        return self.uri or os.environ.get("LIBVIRT_DEFAULT_URI") or "virsh's default connection"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        exe = shutil.which(self.program)
        if exe is None:
            raise DeviceError(f"{self.program} not found: gpulib attach/detach edit domains "
                              "through it (install libvirt-clients or libvirt-client)")
        argv = [exe, *(["-c", self.uri] if self.uri else []), *args]
        # virsh translates its labels ("Persistent:"): parse them in C.
        env = dict(os.environ, LC_ALL="C")
        log.debug("running %s", " ".join(argv))
        try:
            return subprocess.run(argv, capture_output=True, text=True, env=env,
                                  timeout=self.timeout, check=False)
        except subprocess.TimeoutExpired:
            raise LibvirtError(f"virsh {args[0]} did not answer within {self.timeout:.0f} s "
                               f"({self.where})") from None

    @staticmethod
    def _message(res: subprocess.CompletedProcess[str]) -> str:
        lines = [ln.strip() for ln in res.stderr.splitlines() if ln.strip()]
        text = "; ".join(ln[len("error: "):] if ln.startswith("error: ") else ln for ln in lines)
        return text or f"exit status {res.returncode}"

    def _check_domain(self, res: subprocess.CompletedProcess[str], name: str) -> None:
        if res.returncode == 0:
            return
        message = self._message(res)
        if "failed to get domain" in message or "Domain not found" in message:
            raise InputError(f"no VM named {name!r} in libvirt ({self.where})")
        raise LibvirtError(f"virsh: {message}")

    def dominfo(self, name: str) -> DomainInfo:
        res = self._run("dominfo", "--domain", name)
        self._check_domain(res, name)
        fields = {}
        for line in res.stdout.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key.strip()] = value.strip()
        return DomainInfo(fields.get("Name", name), fields.get("State", "unknown"),
                          fields.get("Persistent", "no") == "yes")

    def dumpxml_inactive(self, name: str) -> str:
        """The persistent definition, with its secrets (a VNC password): what
        is defined again must lose nothing."""
        res = self._run("dumpxml", "--inactive", "--security-info", "--domain", name)
        self._check_domain(res, name)
        return res.stdout

    def define(self, xml: str) -> None:
        fd, path = tempfile.mkstemp(prefix="gpulib-domain-", suffix=".xml")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(xml)
            res = self._run("define", "--file", path)
        finally:
            os.unlink(path)
        if res.returncode != 0:
            raise LibvirtError(f"virsh define refused the new definition: {self._message(res)}")
