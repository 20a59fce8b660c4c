"""One rule for what a vGPU profile or type name means (gpulib.profiles), and
every caller held to it: metadata requests and `attach --profile`, pools'
`profile =` (and the doctor's judgement of them), `vf set-type`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpulib import profiles
from gpulib.domain import VgpuRequest
from tests.hosts import a10_host, simulated, t4_host

T4 = "0000:3b:00.0"

# Names as drivers write them, and spellings of them an operator types.
_NAMES = st.sampled_from(["GRID T4-2Q", "NVIDIA A10-6Q", "NVIDIA H100-1-10C", "i915 GVTg_V5_4"])


def _respell(draw: st.DrawFn, name: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(name), max_size=len(name)))
    text = "".join(c.swapcase() if f else c for c, f in zip(name, flips))
    blanks = draw(st.sampled_from([" ", "  ", "\t"]))
    return blanks.join(text.split()) if draw(st.booleans()) else f" {text} "


@st.composite
def _spellings(draw: st.DrawFn) -> tuple[str, str]:
    name = draw(_NAMES)
    return name, _respell(draw, name)


@settings(max_examples=200, deadline=None)
@given(_spellings(), st.sampled_from(["nvidia-231", "nvidia-594"]))
def test_a_profile_is_its_name_in_any_case_and_spacing(pair: tuple[str, str],
                                                       type_id: str) -> None:
    name, typed = pair
    assert profiles.same_name(name, typed)
    request = VgpuRequest(typed, None)
    assert request.matches_type(type_id, name)
    assert request.matches_vendor(594, name)
    # Another name is another type, whatever the case.
    assert not request.matches_type(type_id, name + "X")
    assert not profiles.same_name(name, None) and not profiles.same_name(None, None)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=10 ** 9 - 1), st.sampled_from(["", "nvidia-", "NVIDIA-"]),
       st.sampled_from(["", " "]))
def test_a_vendor_type_id_is_its_number_with_or_without_the_prefix(
        number: int, prefix: str, pad: str) -> None:
    text = f"{pad}{prefix}{number}{pad}"
    assert profiles.vendor_number(text) == number
    assert VgpuRequest(None, f"nvidia-{number}").matches_vendor(number, None)
    assert profiles.same_id(str(number), number)
    # An mdev type id is its directory name, exactly.
    assert profiles.same_id(f"nvidia-{number}", f"nvidia-{number}")
    assert not profiles.same_id(f"nvidia-{number}", str(number))


@pytest.mark.parametrize("text", ["", "nvidia-", "594x", "../594", "\u00b2", "-1",
                                  "nvidia-\u0665\u0669\u0664", "1" * 10])
def test_what_is_no_vendor_type_id(text: str) -> None:
    assert profiles.vendor_number(text) is None


def test_equivalent_types_are_named_alike_the_id_is_a_hint() -> None:
    # The same name under another id (another driver branch): equivalent.
    assert profiles.equivalent("593", "NVIDIA A10-4Q", 600, "nvidia a10-4q")
    assert profiles.equivalent("nvidia-233", "GRID T4-8Q", "nvidia-299", "GRID T4-8Q")
    # The same id under another name: another type.
    assert not profiles.equivalent("593", "NVIDIA A10-4Q", 593, "NVIDIA A10-8Q")
    assert not profiles.equivalent("nvidia-233", "GRID T4-8Q", "nvidia-233", "GRID T4-4Q")
    # A name unknown on either side: the id decides.
    assert profiles.equivalent("593", None, 593, "NVIDIA A10-4Q")
    assert profiles.equivalent("nvidia-233", "GRID T4-8Q", "nvidia-233", None)
    assert not profiles.equivalent("nvidia-233", "GRID T4-8Q", "nvidia-232", None)
    # The creatable type a record asks for: by name, its own number first.
    creatable = {592: "NVIDIA A10-3Q", 600: "NVIDIA A10-4Q", 601: "NVIDIA A10-4Q"}
    assert profiles.pick(creatable, "601", "nvidia a10-4q") == 601
    assert profiles.pick(creatable, "593", "NVIDIA A10-4Q") == 600
    assert profiles.pick(creatable, "592", "NVIDIA A10-8Q") is None
    assert profiles.pick(creatable, "592", None) == 592
    assert profiles.pick(creatable, "593", None) is None


# -- the callers -------------------------------------------------------------------------------

def _state(root: str) -> dict[str, Any]:
    return json.loads(Path(root, "var/lib/gpulib/state.json").read_text())  # type: ignore[no-any-return]


def test_attach_profile_in_any_case(tmp_path: Path) -> None:
    from gpulib.attach import Wanted, plan_attach
    from gpulib.config import Config
    from gpulib.domain import parse_domain

    host = t4_host(str(tmp_path))
    ctx = simulated(host)
    xml = ("<domain type='kvm'><name>att-1</name>"
           "<uuid>4c7e5a91-8d2f-4b64-a1e9-6f0b4d8c2e75</uuid>"
           "<devices><emulator>/usr/bin/qemu-system-x86_64</emulator></devices></domain>")
    change = plan_attach(ctx, Config.load(ctx.config_path), xml,
                         Wanted(profile="grid  t4-8q", count=1))
    dom = parse_domain(change.after)
    assert [(r.type_id, r.name) for r in dom.device_types()] == [("nvidia-233", "GRID T4-8Q")]
    # The same profile asked for again in another spelling: one request item.
    again = plan_attach(ctx, Config.load(ctx.config_path), change.after,
                        Wanted(profile="GRID T4-8Q", count=1))
    request = parse_domain(again.after).metadata_request()
    assert request is not None and [v.count for v in request.vgpus] == [2]


def test_pool_profile_in_any_case_and_the_doctor_agrees(tmp_path: Path) -> None:
    from gpulib import doctor
    from gpulib.config import Config
    from gpulib.hostview import discover_host
    from gpulib.lifecycle import open_store
    from gpulib.pools import apply

    host = t4_host(str(tmp_path))
    host.write_file("etc/gpulib/gpulib.conf",
                    f"[pool t4]\nparents = {T4}\nprofile = grid t4-4q\ncount = 2\n")
    ctx = simulated(host)
    report = doctor.run(ctx, only=["mdev"])
    assert not [r for r in report.results_for("mdev") if r.subject == "pool t4"]
    config = Config.load(ctx.config_path)
    store = open_store(ctx, config)

    def change(state: Any) -> None:
        outcomes = apply(ctx, config, state, discover_host(ctx, config, state=state))
        assert all(o.ok for o in outcomes), outcomes

    store.update(change)
    members = [r for r in _state(host.root)["vgpus"].values() if r["pool"] == "t4"]
    assert [r["type_id"] for r in members] == ["nvidia-232", "nvidia-232"]


def test_vendor_pool_profile_and_type_in_any_spelling(tmp_path: Path) -> None:
    from gpulib.config import Config
    from gpulib.hostview import discover_host
    from gpulib.pools import plan

    host = a10_host(str(tmp_path))
    ctx = simulated(host)
    for line in ("profile = nvidia a10-6q", "type = NVIDIA-594", "type = nvidia-594"):
        host.write_file("etc/gpulib/gpulib.conf",
                        f"[pool a10]\nparents = all\n{line}\ncount = 1\n")
        config = Config.load(ctx.config_path)
        p = plan(config.pools["a10"], discover_host(ctx, config))
        assert {tid for _, _, tid, _ in p.vf_parents} == {594}, line
