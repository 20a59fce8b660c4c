"""Every file gpulib reads or writes on a host, under one injected root.

`Sysfs` is the only object that writes to sysfs. Which kernel carries out a
write (the real one, or the simulator in `gpulib.sim`) is chosen at the entry
point (`gpulib.context`), so no other module knows whether the host is real.

Paths given to this module are relative to the root ("sys/bus/pci/devices").
Reads use os.open/os.read: discovery reads thousands of tiny attribute files
and the buffered `open()` machinery costs several times more per file.

Every read in gpulib goes through `read_file` (or `Sysfs`, which uses it;
`read_file_unless` for a cache keyed on a file's identity), by one set of
rules, because one odd file must never stop a command:

* opened non-blocking: a FIFO (or any file whose open or read would wait for
  a writer) in place of an attribute or a configuration file never hangs;
* only regular files are read (sysfs attributes are regular files too): a
  directory, FIFO, socket or device node is refused;
* bounded in size by the kind of file (`ATTRIBUTE_MAX`, `TEXT_MAX`,
  `DOCUMENT_MAX`): a 10 MB `vendor` file is refused, not parsed;
* below `sys/`, the last component is never followed (attributes are never
  symlinks; a link there is a loop or a trick); elsewhere links are followed,
  but below a root other than `/` only inside that root;
* errors are values (`ReadFailure`), never exceptions: the caller decides
  what a failure costs (a field, a device, a command).

`Sysfs` logs each failed path once, with its reason, and keeps the list
(`failures`) so that discovery can attach them to the device they belong to.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from collections.abc import Sequence

from gpulib import logger

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Optional, Union

    # A kernel carries out a write to an attribute file: (absolute path, data).
    KernelWrite = Callable[[str, str], None]
    # Whether a caller already holds a file's content, judged by the file's
    # status (a cache keyed on device, inode, size and mtime).
    AlreadyRead = Callable[[os.stat_result], bool]

log = logger.get(__name__)


# Size bounds by kind of file. A sysfs attribute is at most one page (64 KiB
# on arm64/ppc64le kernels); configuration and /proc text (cpuinfo of a
# 512-thread host is ~1.3 MB); documents: pci.ids (1.3 MB today), libvirt
# domain XML, gpulib's state.
ATTRIBUTE_MAX = 64 * 1024
TEXT_MAX = 4 * 1024 * 1024
DOCUMENT_MAX = 32 * 1024 * 1024
# A number in an attribute: 64-bit values have at most 20 digits (plus 0x, sign).
_NUMBER_MAX_CHARS = 24

_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_MISSING = (errno.ENOENT, errno.ENOTDIR)


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, for a message ("a FIFO")."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device node"
    return "not a regular file"


class ReadFailure:
    """Why a file could not be read: the value a read returns instead of data."""

    __slots__ = ("errno", "path", "reason")

    def __init__(self, path: str, code: int, reason: str) -> None:
        self.path = path
        self.errno = code
        self.reason = reason

    @property
    def missing(self) -> bool:
        """The file (or a directory above it) does not exist: usually not an error."""
        return self.errno in _MISSING

    def __repr__(self) -> str:
        return f"ReadFailure({self.path!r}, {self.reason!r})"

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def _failure(path: str, exc: OSError, follow: bool = True) -> ReadFailure:
    code = exc.errno or errno.EIO
    if code == errno.ELOOP and not follow:
        return ReadFailure(path, code, "a symlink where a file belongs")
    return ReadFailure(path, code, os.strerror(code))


def _content(fd: int, st: os.stat_result, path: str, limit: int) -> Union[bytes, ReadFailure]:
    """What the open file `fd` (status `st`) holds, by the module's rules.
    Raises OSError from the read."""
    if not stat.S_ISREG(st.st_mode):
        return ReadFailure(path, errno.EINVAL, f"{file_kind(st.st_mode)}, not a file")
    # sysfs and /proc report sizes of 4096 or 0: the bound is checked on
    # what is read, and st_size only refuses early what is plainly too big.
    if st.st_size > limit:
        return ReadFailure(path, errno.EFBIG, f"larger than {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            return ReadFailure(path, errno.EFBIG, f"larger than {limit} bytes")
        chunks.append(chunk)
        # Read whole, without the read that finds the end: st_size is a
        # regular file's size, and a sysfs attribute's most (a page), so
        # nothing follows once that much is read. A size of 0 (/proc) says
        # nothing: read on to the end. A report reads thousands of files.
        if 0 < st.st_size <= size:
            return b"".join(chunks)


def read_file(path: str, limit: int = TEXT_MAX, follow: bool = True) -> Union[bytes, ReadFailure]:
    """The content of the regular file at `path`, or why it cannot be read.

    Never blocks on a FIFO, never reads more than `limit` bytes, never raises
    OSError. `follow=False` refuses a symlink as the last component.
    """
    # Inline, not shared with read_file_unless: discovery makes thousands of these calls.
    try:
        fd = os.open(path, _OPEN_FLAGS if follow else _OPEN_FLAGS | os.O_NOFOLLOW)
    except OSError as exc:
        return _failure(path, exc, follow)
    try:
        return _content(fd, os.fstat(fd), path, limit)
    except OSError as exc:
        return _failure(path, exc)
    finally:
        os.close(fd)




def read_file_unless(path: str, known: AlreadyRead, limit: int = TEXT_MAX, follow: bool = True
                     ) -> Union[tuple[os.stat_result, Optional[bytes]], ReadFailure]:
    """`read_file` for a cache keyed on the file's identity: the status of the
    file opened, and its content, or None when `known(status)` says the caller
    has it already. The status is the open file's own (fstat), so a file
    replaced by rename meanwhile is never taken for the one cached."""
    try:
        fd = os.open(path, _OPEN_FLAGS if follow else _OPEN_FLAGS | os.O_NOFOLLOW)
    except OSError as exc:
        return _failure(path, exc, follow)
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and known(st):
            return st, None
        data = _content(fd, st, path, limit)
        return data if isinstance(data, ReadFailure) else (st, data)
    except OSError as exc:
        return _failure(path, exc)
    finally:
        os.close(fd)


def read_text(path: str, limit: int = TEXT_MAX, follow: bool = True) -> Union[str, ReadFailure]:
    """`read_file` decoded as UTF-8 (undecodable bytes replaced)."""
    data = read_file(path, limit, follow)
    if isinstance(data, ReadFailure):
        return data
    return data.decode("utf-8", "replace")


def real_kernel_write(path: str, data: str) -> None:
    """Write an attribute the way `echo data > path` does, in one write(2)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


class Sysfs:
    """Reads and writes below one root directory (`/` on a real host)."""

    def __init__(self, root: str = "/", kernel_write: Optional[KernelWrite] = None,
                 simulated: bool = False) -> None:
        self.root = os.path.join(os.path.abspath(root), "")
        self._kernel_write = kernel_write or real_kernel_write
        self.simulated = simulated
        # Paths that could not be read or listed (root-relative) and why, in
        # the order met; each is logged once.
        self.failures: list[tuple[str, str]] = []
        self._failed: set[str] = set()

    def __repr__(self) -> str:
        return f"Sysfs(root={self.root!r}, simulated={self.simulated})"

    # -- paths ---------------------------------------------------------------
    def path(self, rel: str) -> str:
        """Absolute path of `rel` below the root."""
        return self.root + rel.lstrip("/")

    def relative(self, abspath: str) -> str:
        """Inverse of `path` for a path inside the root."""
        if abspath.startswith(self.root):
            return abspath[len(self.root):]
        if abspath + "/" == self.root:
            return ""
        raise ValueError(f"{abspath} is outside {self.root}")

    # -- reads ---------------------------------------------------------------
    def failed(self, rel: str, reason: str) -> None:
        """Note that `rel` could not be used (logged the first time only)."""
        if rel in self._failed:
            return
        self._failed.add(rel)
        self.failures.append((rel, reason))
        log.warning("cannot read %s: %s", self.root + rel, reason)

    def read_result(self, rel: str, limit: Optional[int] = None) -> Union[bytes, ReadFailure]:
        """Raw content or why not (see the module's rules). Nothing is logged.

        The default bound is `ATTRIBUTE_MAX` below `sys/`, `TEXT_MAX` elsewhere.
        """
        if rel.startswith("sys/"):
            return read_file(self.root + rel, ATTRIBUTE_MAX if limit is None else limit,
                             follow=False)
        path = self._outside_sys(rel)
        if isinstance(path, ReadFailure):
            return path
        return read_file(path, TEXT_MAX if limit is None else limit)

    def read_unless(self, rel: str, known: AlreadyRead, limit: int = DOCUMENT_MAX
                    ) -> Union[tuple[os.stat_result, Optional[bytes]], ReadFailure]:
        """`read_file_unless` of a file outside `sys/` (a libvirt status file
        that a cache keyed on its identity may hold already). Nothing is logged."""
        path = self._outside_sys(rel)
        if isinstance(path, ReadFailure):
            return path
        return read_file_unless(path, known, limit)

    def _outside_sys(self, rel: str) -> Union[str, ReadFailure]:
        """The absolute path to open for `rel`, a path outside `sys/`."""
        if self.root == "/":
            return self.root + rel
        # Below another root (a test tree, a snapshot), a link such as
        # etc/os-release -> /usr/lib/os-release is followed inside it:
        # nothing is ever read from the real host.
        real = self.resolve_in_root(rel)
        if real is None:  # absent, or a link that dangles, loops or leaves the root
            return ReadFailure(self.root + rel, errno.ENOENT, os.strerror(errno.ENOENT))
        return self.root + real

    def read_bytes(self, rel: str, limit: Optional[int] = None) -> Optional[bytes]:
        """Raw content; None if the file does not exist or cannot be read
        (a failure other than absence is logged once and kept in `failures`)."""
        data = self.read_result(rel, limit)
        if isinstance(data, ReadFailure):
            if not data.missing:
                self.failed(rel, data.reason)
            return None
        return data

    def read(self, rel: str, limit: Optional[int] = None) -> Optional[str]:
        """Attribute text without the trailing newline, or None if absent or unreadable."""
        data = self.read_bytes(rel, limit)
        if data is None:
            return None
        return data.decode("utf-8", "replace").strip()

    def read_int(self, rel: str, base: int = 10, low: Optional[int] = None,
                 high: Optional[int] = None) -> Optional[int]:
        """An integer attribute; None if absent, unreadable, not a number or
        outside [low, high] (a malformed value never reaches any output)."""
        text = self.read(rel)
        if text is None:
            return None
        return self._number(rel, text, base, low, high)

    def _number(self, rel: str, text: str, base: int, low: Optional[int],
                high: Optional[int]) -> Optional[int]:
        """`read_int`'s reading of the text of `rel`."""
        if len(text) > _NUMBER_MAX_CHARS:
            self.failed(rel, f"not a number ({len(text)} characters)")
            return None
        try:
            value = int(text, base)
        except ValueError:
            return None
        if (low is not None and value < low) or (high is not None and value > high):
            self.failed(rel, f"{value} is out of range")
            return None
        return value

    def read_counts(self, rel_dir: str, names: Sequence[str], high: int) -> list[Optional[int]]:
        """`read_int(f"{rel_dir}/{name}", low=0, high=high)` for each of `names`
        (paths below `rel_dir`), by the same rules and with the same failures
        noted, for the thousands of small numbers of one parent's vGPU types
        (`available_instances`): `rel_dir` is looked up once and each file
        opened from it, not from the root again through the device's link."""
        if not rel_dir.startswith("sys/"):
            return [self.read_int(f"{rel_dir}/{n}", low=0, high=high) for n in names]
        try:
            dfd = os.open(self.root + rel_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:  # each file then says what is wrong (absent: no note)
            return [self.read_int(f"{rel_dir}/{n}", low=0, high=high) for n in names]
        try:
            return self._counts_at(dfd, rel_dir, names, high)
        finally:
            os.close(dfd)

    def _counts_at(self, dfd: int, rel_dir: str, names: Sequence[str], high: int
                   ) -> list[Optional[int]]:
        """`read_counts`' reads, `names` below the open directory `dfd`: one
        loop without a call per file, as thousands of files are its point;
        anything but a plain number in a plain file goes the ordinary way
        (`_count_at`), which notes what is wrong as every read does."""
        out: list[Optional[int]] = []
        flags = _OPEN_FLAGS | os.O_NOFOLLOW  # below sys/: the last component never followed
        open_, read, close = os.open, os.read, os.close
        for name in names:
            try:
                fd = open_(name, flags, dir_fd=dfd)
            except OSError:
                out.append(self._count_at(dfd, rel_dir, name, high))
                continue
            try:
                # A first read shorter than asked is the whole file: sysfs
                # hands an attribute over in one read, and a regular file
                # ends there. Without an fstat (a real attribute's size is
                # 4096, which would ask for a read more to find its end):
                # three system calls a file, not five.
                data = read(fd, 64)
                done = 0 < len(data) < 64
            except OSError:
                done = False
            finally:
                close(fd)
            # int() of the bytes themselves, no decoding of thousands of
            # numbers; anything else (longer than a number may be, not a
            # number to int(), out of range) goes the ordinary way, which
            # reads it by the rules of every read and notes what is wrong.
            if done and len(data) <= _NUMBER_MAX_CHARS:
                try:
                    value = int(data)
                except ValueError:
                    value = -1
                if 0 <= value <= high:
                    out.append(value)
                    continue
            out.append(self._count_at(dfd, rel_dir, name, high))
        return out

    def _count_at(self, dfd: int, rel_dir: str, name: str, high: int) -> Optional[int]:
        """`read_int` of `name` below the open directory `dfd`, by the module's rules."""
        try:
            fd = os.open(name, _OPEN_FLAGS | os.O_NOFOLLOW, dir_fd=dfd)
        except OSError as exc:
            data: Union[bytes, ReadFailure] = _failure(f"{self.root}{rel_dir}/{name}", exc,
                                                       follow=False)
        else:
            try:
                data = _content(fd, os.fstat(fd), f"{self.root}{rel_dir}/{name}",
                                ATTRIBUTE_MAX)
            except OSError as exc:
                data = _failure(f"{self.root}{rel_dir}/{name}", exc)
            finally:
                os.close(fd)
        if isinstance(data, ReadFailure):
            if not data.missing:
                self.failed(f"{rel_dir}/{name}", data.reason)
            return None
        return self._number(f"{rel_dir}/{name}", data.decode("utf-8", "replace").strip(), 10,
                            0, high)

    def read_id(self, rel: str, bits: int = 16) -> Optional[int]:
        """A hexadecimal id attribute (`0x10de`): None unless it fits in `bits`."""
        return self.read_int(rel, 16, 0, (1 << bits) - 1)

    def listdir_result(self, rel: str) -> Union[list[str], ReadFailure]:
        """Entries of a directory, or why it cannot be listed."""
        try:
            return os.listdir(self.root + rel)
        except OSError as exc:
            code = exc.errno or errno.EIO
            return ReadFailure(self.root + rel, code, os.strerror(code))

    def listdir(self, rel: str) -> list[str]:
        """Entries of a directory; [] if it does not exist or cannot be listed
        (a failure other than absence is logged once)."""
        names = self.listdir_result(rel)
        if isinstance(names, ReadFailure):
            if not names.missing:
                self.failed(rel, names.reason)
            return []
        return names

    def exists(self, rel: str) -> bool:
        return os.path.lexists(self.root + rel)

    def isdir(self, rel: str) -> bool:
        return os.path.isdir(self.root + rel)

    def link_name(self, rel: str) -> Optional[str]:
        """Last component of a symlink's target (`driver` -> "nvidia")."""
        try:
            return os.path.basename(os.readlink(self.root + rel))
        except OSError:
            return None

    def resolve(self, rel: str) -> str:
        """Root-relative canonical path of `rel` (links followed)."""
        try:
            real = os.path.realpath(self.root + rel)
        except OSError as exc:  # a symlink loop on some Python versions
            raise ValueError(f"{rel}: {exc.strerror}") from None
        return self.relative(real)

    def resolve_in_root(self, rel: str) -> Optional[str]:
        """`rel` with symlinks followed, staying inside the root.

        Absolute link targets are taken as below the root (a snapshot or a
        test tree holds links like /usr/bin/gpulib); None for a broken link,
        a loop, or a path that would leave the root.
        """
        path = posixpath.normpath(rel.lstrip("/"))
        for _ in range(16):
            try:
                st = os.lstat(self.root + path)
            except OSError:
                return None
            if not stat.S_ISLNK(st.st_mode):
                return path
            try:
                target = os.readlink(self.root + path)
            except OSError:
                return None
            if target.startswith("/"):
                path = posixpath.normpath(target.lstrip("/"))
            else:
                path = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
            if path == ".." or path.startswith("../"):
                return None
        return None

    # -- the one writer --------------------------------------------------------
    def write(self, rel: str, data: str, expected: tuple[int, ...] = ()) -> None:
        """Write an attribute; OSError carries the kernel's errno.

        A failure with an errno in `expected` is one the caller handles as a
        normal outcome (EEXIST of a vGPU another tool created): logged at
        info, not as a warning.
        """
        path = self.root + rel
        log.info("write %r to %s", data, path)
        try:
            self._kernel_write(path, data)
        except OSError as exc:
            log.log(logger.INFO if exc.errno in expected else logger.WARNING,
                    "write %r to %s failed: %s", data, path,
                    os.strerror(exc.errno or errno.EIO))
            raise
