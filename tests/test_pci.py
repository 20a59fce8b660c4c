from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpulib.errors import InputError
from gpulib.pci import PciAddress

addresses = st.builds(PciAddress, st.integers(0, 0xFFFF), st.integers(0, 0xFF),
                      st.integers(0, 0x1F), st.integers(0, 7))


@given(addresses)
def test_address_round_trips_through_every_form(a: PciAddress) -> None:
    assert PciAddress.parse(str(a)) == a
    assert PciAddress.parse(a.lspci) == a
    lv = a.libvirt()
    assert PciAddress.from_libvirt(lv["domain"], lv["bus"], lv["slot"], lv["function"]) == a


@given(addresses)
def test_lspci_form_has_domain_only_when_not_zero(a: PciAddress) -> None:
    assert a.lspci.count(":") == (1 if a.domain == 0 else 2)


@pytest.mark.parametrize("bad", ["", "3b:00", "0000:3b:00.8", "0000:3b:20.0", "zz:00.0",
                                 "10000:00:00.0", "0000:3b:00.0\n", "../00:00.0"])
def test_bad_addresses_are_refused(bad: str) -> None:
    with pytest.raises(InputError):
        PciAddress.parse(bad)


@pytest.mark.parametrize("fields", [("0x0000", "0x100", "0x00", "0x0"),
                                    ("0x0000", "0x3b", "0x20", "0x0"),
                                    ("0x0000", "0x3b", "0x00", "0x8"),
                                    ("0x0000", "bus", "0x00", "0x0")])
def test_libvirt_fields_out_of_range_are_refused(fields: tuple[str, str, str, str]) -> None:
    with pytest.raises(InputError):
        PciAddress.from_libvirt(*fields)


@pytest.mark.guard_selftest
def test_the_session_guard_stops_reads_of_the_real_sys() -> None:
    from gpulib.sysfs import Sysfs

    with pytest.raises(AssertionError, match="touched the real host"):
        Sysfs("/").read("sys/bus/pci/devices/0000:00:00.0/vendor")
