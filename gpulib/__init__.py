"""gpulib: GPUs, vGPUs and SR-IOV functions for virtual machines on KVM hosts.

Kept free of imports on purpose: the hooks import this package on every VM
start, and the no-GPU path must cost no more than the interpreter itself.
The version lives in setup.cfg only; `gpulib.version()` reads it back.
"""


def version() -> str:
    """The installed version (setup.cfg is the one place it is written)."""
    try:
        from importlib.metadata import version as _dist_version

        return _dist_version("gpulib")
    except Exception:  # running from a source tree that was never installed
        import configparser
        import os

        cfg = configparser.ConfigParser()
        cfg.read(os.path.join(os.path.dirname(os.path.dirname(__file__)), "setup.cfg"))
        return cfg.get("metadata", "version", fallback="0+unknown")
