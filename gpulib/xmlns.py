"""gpulib's XML namespace, importable without lxml (the hooks' fast path needs it)."""

GPULIB_NS = "http://gpulib.org/xmlns/domain/1"


def may_concern_gpulib(xml: str) -> bool:
    """Whether a domain XML text can concern gpulib at all, without parsing it.

    A domain without a `<hostdev` and without gpulib's namespace comes back
    byte-identical from the transformer and costs no XML parser.
    """
    return "<hostdev" in xml or GPULIB_NS in xml
