"""gpulib: GPUs, vGPUs and SR-IOV functions for virtual machines on KVM hosts.

Kept free of imports on purpose: the hooks import this package on every VM
start, and the no-GPU path must cost no more than the interpreter itself.
The version is written into gpulib/_version.py when gpulib is built
(packaging/version: the release number and the development serial);
`gpulib.version()` reads it back.
"""


def version() -> str:
    """This gpulib's version, as its build wrote it; "0+unknown" in a source
    tree that was never built (setup.py, scripts/setup and the packages write
    it)."""
    try:
        from gpulib._version import VERSION  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return "0+unknown"
    return str(VERSION)
