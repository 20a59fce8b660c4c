"""The files of a simulated host, read and written as its kernel and drivers
would: shared by the fake-host builder (`fakehost`), the simulated kernel,
its MIG driver and its nvidia-smi, below all of them."""

from __future__ import annotations

import json
import os


def write_file(path: str, content: str, mode: int = 0o644) -> None:
    """`path` holding `content`, with `mode` whatever the umask (its
    directories made as needed). Straight system calls: a large host is some
    hundred thousand of these files, and Python's file objects cost twice the
    creation itself."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, flags, 0o600)
    try:
        data = content.encode("utf-8")
        while data:
            data = data[os.write(fd, data):]
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


# In a type's directory: the attribute files its devices have (JSON, name ->
# regular expression of accepted values). The kernel keeps this in the driver.
MDEV_ATTRS_SPEC = ".sim-mdev-attrs"


def mdev_attr_spec(type_dir: str) -> dict[str, str]:
    try:
        with open(os.path.join(type_dir, MDEV_ATTRS_SPEC), encoding="utf-8") as fh:
            spec = json.load(fh)
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in spec.items()} if isinstance(spec, dict) else {}


def make_attr_files(mdev_dir: str, type_dir: str) -> None:
    """A new device's attribute files (empty), as its type's driver adds them."""
    for name in mdev_attr_spec(type_dir):
        path = os.path.join(mdev_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_file(path, "", 0o644)


def read_attribute(path: str, default: str = "") -> str:
    """An attribute file's text, stripped (`default` when it cannot be read):
    through gpulib's reading layer, so a FIFO or a huge file in a simulated
    tree does not hang the simulator either."""
    from gpulib.sysfs import ATTRIBUTE_MAX, ReadFailure, read_text

    text = read_text(path, ATTRIBUTE_MAX)
    return default if isinstance(text, ReadFailure) else text.strip()


def rewrite_attribute(path: str, text: str) -> None:
    """Replace an attribute file's text, keeping its mode. A plain rewrite:
    attribute files are tiny, and only the one process writes them while
    gpulib holds its state lock or the caller serialises."""
    mode = os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644
    tmp = f"{path}.sim-tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def relative_symlink(target_abs: str, link_abs: str) -> None:
    """A relative symlink at link_abs pointing to target_abs, as sysfs has them."""
    os.makedirs(os.path.dirname(link_abs), exist_ok=True)
    rel = os.path.relpath(target_abs, os.path.dirname(link_abs))
    if os.path.lexists(link_abs):
        os.unlink(link_abs)
    os.symlink(rel, link_abs)
