"""gpulib's XML namespace, importable without lxml (the hooks' fast path needs it)."""

GPULIB_NS = "http://gpulib.org/xmlns/domain/1"


def looks_whole(xml: str) -> bool:
    """A cheap guard for the fast path: a domain document that was not cut short.

    Text that does not end in `</domain>` (truncated, junk appended, another
    document) goes through the full parser, which names what is wrong.
    """
    return xml.rstrip().endswith("</domain>") and "<domain" in xml


def may_concern_gpulib(xml: str) -> bool:
    """Whether a domain XML text can concern gpulib at all, without parsing it.

    A domain without a `<hostdev` and without gpulib's namespace comes back
    byte-identical from the transformer and costs no XML parser.
    """
    return "<hostdev" in xml or GPULIB_NS in xml
