"""`gpulib snapshot`: a tarball of what gpulib reads that replays the host as GPULIB_ROOT."""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import posixpath
import stat
import subprocess
import tarfile
from typing import Any

import pytest

from gpulib import cli, counters, mdev, nvidiasmi, report
from gpulib import doctor as dr
from gpulib import snapshot as snap
from gpulib.context import Context
from gpulib.entry import context_for_root
from gpulib.hostview import discover_host
from gpulib.pci import PciAddress
from gpulib.sim.fakehost import NVIDIA_SMI_CALLS, FakeHost
from gpulib.sim.hosts import DEMO_T4, build_demo, install_nvidia_smi
from tests.hookrun import BIN, hook_env
from tests.hosts import LIBVIRTD_PID, a10_host, healthy_host, tree_state
from tests.simhosts import HOSTS

PASSWORD = "s3cr3t-Pw"
RTX = "0000:3b:00.0"


def demo_with_secrets(tmp: str) -> FakeHost:
    """The healthy demo host (hooks, libvirtd) with secrets in the files gpulib reads."""
    host = healthy_host(tmp)
    host.write_file("etc/cloudstack/agent/agent.properties",
                    "keystore.passphrase=Ks-s3cr3t\nagent.hooks.basedir=/etc/cloudstack/agent/"
                    "hooks\nguid=0c1d2e3f\n")
    host.write_file(f"run/udev/data/+pci:{RTX}", "E:ID_VENDOR_FROM_DATABASE=NVIDIA Corporation\n")
    host.write_file("run/udev/data/+pci:0000:18:00.0", "E:ID_VENDOR_FROM_DATABASE=Intel\n")
    host.add_running_domain("i-2-33-VM", "0f6b2c1e-4d3a-4b5c-9e8f-7a6b5c4d3e2f", pid=5151,
                            pci=(RTX,), vnc_password=PASSWORD)
    # More secrets where gpulib reads files: the domain's disk auth, a conf file, a PEM.
    path = host.p("etc/libvirt/qemu/i-2-33-VM.xml")
    with open(path, encoding="utf-8") as fh:
        xml = fh.read()
    xml = xml.replace("  </devices>", "    <disk type='network'>\n      <auth username='admin'>\n"
                      "        <secret type='ceph' uuid='d5e6f7a8-cafe-4bad-beef-0123456789ab'/>\n"
                      "      </auth>\n    </disk>\n  </devices>")
    host.write_file("etc/libvirt/qemu/i-2-33-VM.xml", xml, 0o600)
    host.write_file("etc/modprobe.d/site.conf",
                    "options foo api_key=K3y-s3cr3t\n# token: T0k3n-s3cr3t\n")
    host.write_file("etc/gpulib/notes.pem", "-----BEGIN PRIVATE KEY-----\nMIIEv-s3cr3t\n"
                                            "-----END PRIVATE KEY-----\n")
    return host


def unpack(tarball: str, dest: str) -> str:
    with tarfile.open(tarball) as tf:
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, filter="data")
        else:  # Python < 3.9.17 / 3.10.12 / 3.11.4
            tf.extractall(dest)
    return dest


def member_bytes(tarball: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    with tarfile.open(tarball) as tf:
        for m in tf.getmembers():
            if m.isfile():
                fh = tf.extractfile(m)
                assert fh is not None
                out[m.name] = fh.read()
            else:
                out[m.name] = m.linkname.encode()
    return out


def document(root: str) -> dict[str, Any]:
    return report.document(discover_host(Context.for_root(root), learn=False))


@pytest.fixture(scope="module")
def demo_snapshot(tmp_path_factory: Any) -> tuple[FakeHost, str, dict[str, Any]]:
    """The demo host, its snapshot (before: the tree's state) and the tarball."""
    tmp = str(tmp_path_factory.mktemp("snap"))
    host = demo_with_secrets(tmp)
    before = tree_state(host.root)
    path, summary = snap.create(Context.for_root(host.root), os.path.join(tmp, "demo.tar.gz"))
    assert summary.functions > 0 and summary.files > 0 and summary.links > 0
    return host, path, {"before": before}


def test_replay_gives_the_same_discovery(demo_snapshot: Any, tmp_path: Any) -> None:
    host, tarball, _ = demo_snapshot
    root = unpack(tarball, str(tmp_path / "replay"))
    original = document(host.root)
    replayed = document(root)
    assert json.dumps(replayed, sort_keys=True) == json.dumps(original, sort_keys=True)
    assert len(original["gpus"]) == 10
    # the doctor sees the same healthy host: hooks, libvirtd's start, state...
    assert dr.run(Context.for_root(root)).summary() == {c: "ok" for c in dr.CHECK_IDS}


def test_replay_works_as_simulated_root(demo_snapshot: Any, tmp_path: Any) -> None:
    _, tarball, _ = demo_snapshot
    root = unpack(tarball, str(tmp_path / "replay"))
    ctx = context_for_root(root, simulate=True)
    made = mdev.create(ctx.sysfs, PciAddress.parse(DEMO_T4), "nvidia-232")
    assert made.parent == PciAddress.parse(DEMO_T4)
    doc = document(root)
    t4 = next(g for g in doc["gpus"] if g["address"] == DEMO_T4)
    assert made.uuid in {v["uuid"] for v in t4["vgpus"] if v["live"]}
    assert mdev.remove(ctx.sysfs, made.uuid)


def test_no_secret_in_the_tarball(demo_snapshot: Any) -> None:
    _, tarball, _ = demo_snapshot
    members = member_bytes(tarball)
    for name, data in members.items():
        for secret in (PASSWORD, "s3cr3t", "d5e6f7a8-cafe"):
            assert secret.encode() not in data, name
    with open(tarball, "rb") as fh:
        raw = gzip.decompress(fh.read())
    assert b"s3cr3t" not in raw and b"d5e6f7a8-cafe" not in raw
    running = members["run/libvirt/qemu/i-2-33-VM.xml"].decode()
    assert "passwd='SCRUBBED'" in running and "<hostdev" in running
    defined = members["etc/libvirt/qemu/i-2-33-VM.xml"].decode()
    assert "uuid='SCRUBBED'" in defined and "<uuid>0f6b2c1e-4d3a-4b5c-9e8f-7a6b5c4d3e2f" \
        in defined
    assert members["etc/modprobe.d/site.conf"] == \
        b"options foo api_key=SCRUBBED\n# token: SCRUBBED\n"
    # of the agent's properties, only the hook settings
    assert members["etc/cloudstack/agent/agent.properties"] == \
        b"agent.hooks.basedir=/etc/cloudstack/agent/hooks\n"


def test_members_and_links_stay_inside(demo_snapshot: Any) -> None:
    _, tarball, _ = demo_snapshot
    with tarfile.open(tarball) as tf:
        members = tf.getmembers()
    names = {m.name for m in members}
    for m in members:
        assert not m.name.startswith("/") and ".." not in m.name.split("/"), m.name
        assert m.uid == 0 and m.gid == 0
        if m.issym():
            assert not m.linkname.startswith("/"), m.name
            target = posixpath.normpath(posixpath.join(posixpath.dirname(m.name), m.linkname))
            assert target in names, (m.name, m.linkname)
        assert not m.islnk() and (m.isfile() or m.isdir() or m.issym())
    for rel in ("proc/cmdline", "etc/os-release", "etc/modprobe.d/blacklist-nouveau.conf",
                "etc/gpulib/gpulib.conf", "var/lib/gpulib/state.json",
                "usr/share/misc/pci.ids", f"sys/bus/pci/devices/{RTX}",
                "sys/module/nvidia", "sys/class/iommu/dmar0", f"run/udev/data/+pci:{RTX}",
                "run/libvirtd.pid", f"proc/{LIBVIRTD_PID}/stat", "proc/stat", dr.LIBVIRT_HOOK,
                "etc/cloudstack/agent/agent.properties", snap.MANIFEST):
        assert rel in names, rel
    # the NIC is not GPU-related: only its identity and links go in
    nic = "sys/bus/pci/devices/0000:18:00.0"
    assert nic in names
    nic_dir = next(m for m in members if m.name == nic).linkname
    nic_dir = posixpath.normpath(posixpath.join(posixpath.dirname(nic), nic_dir))
    assert {f"{nic_dir}/{n}" for n in ("class", "vendor", "device", "driver")} <= names
    assert f"{nic_dir}/numa_node" not in names
    assert "run/udev/data/+pci:0000:18:00.0" not in names
    assert not any(n.startswith("sys/bus/pci/drivers/i40e/") for n in names)


def test_write_only_and_unreadable_attributes(tmp_path: Any) -> None:
    host = build_demo(str(tmp_path / "demo"))
    dev = host.device_dir(DEMO_T4)
    for name, data, mode in (("config", b"\x10\xde\xb8\x1e", 0o644),
                             ("resource0", b"", 0o600), ("rom", b"", 0o600),
                             ("label", b"bin\x00ary", 0o444), ("reset", b"", 0o200)):
        with open(os.path.join(dev, name), "wb") as fh:
            fh.write(data)
        os.chmod(os.path.join(dev, name), mode)
    tarball = str(tmp_path / "t.tar.gz")
    snap.create(Context.for_root(host.root), tarball)
    rel_dev = os.path.relpath(dev, host.root)
    with tarfile.open(tarball) as tf:
        by_name = {m.name: m for m in tf.getmembers()}
    for gone in ("config", "resource0", "rom"):
        assert f"{rel_dev}/{gone}" not in by_name
    for empty, mode in (("label", 0o444), ("reset", 0o200),
                        ("mdev_supported_types/nvidia-232/create", 0o200)):
        m = by_name[f"{rel_dev}/{empty}"]
        assert m.size == 0 and stat.S_IMODE(m.mode) == mode, empty
    assert by_name[f"{rel_dev}/vendor"].size > 0


def test_snapshot_never_writes_below_the_root(demo_snapshot: Any) -> None:
    """Not even the NVIDIA numbers it asked the host's nvidia-smi for (they go
    into the tarball). The simulated tool's own record of its calls aside."""
    host, _, info = demo_snapshot
    tool_log = (NVIDIA_SMI_CALLS, os.path.dirname(NVIDIA_SMI_CALLS))

    def written(state: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in state.items() if k not in tool_log}

    assert written(tree_state(host.root)) == written(info["before"])
    # The type numbers, and the MIG mode of the GPUs with vendor VFs (`-q`:
    # this host has none in MIG mode), as a report would ask them.
    assert host.nvidia_smi_calls() == ["vgpu -s -v", "-q"]
    assert not os.path.exists(os.path.join(host.root, nvidiasmi.CACHE_FILE))
    assert not os.path.exists(os.path.join(host.root, "var/lib/gpulib/nvidia-mig.json"))


@pytest.mark.parametrize("text,expected", [
    ("<graphics type='spice' passwd='x1'/>", "<graphics type='spice' passwd='SCRUBBED'/>"),
    ('<graphics type="vnc" passwd="x1" keymap="en-us"/>',
     '<graphics type="vnc" passwd="SCRUBBED" keymap="en-us"/>'),
    ("<secret type='iscsi' usage='libvirtiscsi'/>", "<secret type='iscsi' usage='SCRUBBED'/>"),
    ('{"password": "x1", "type_id": "nvidia-232"}',
     '{"password": "SCRUBBED", "type_id": "nvidia-232"}'),
    ("keystore.passphrase=x1\nguid=abc\n", "keystore.passphrase=SCRUBBED\nguid=abc\n"),
    ("token: x1", "token: SCRUBBED"),
    ("monkey=banana bypass=1", "monkey=banana bypass=1"),
    ("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----",
     "-----BEGIN CERTIFICATE-----\nSCRUBBED\n-----END CERTIFICATE-----"),
    ("<uuid>2b7e4c1d-6f3a-4d8e-9b0c-5e1f2a3d4c6b</uuid>",
     "<uuid>2b7e4c1d-6f3a-4d8e-9b0c-5e1f2a3d4c6b</uuid>"),
])
def test_scrub(text: str, expected: str) -> None:
    assert snap.scrub(text) == expected


# -- the command line ------------------------------------------------------------------


def test_cli_writes_the_default_name(tmp_path: Any, monkeypatch: Any, capsys: Any) -> None:
    host = build_demo(str(tmp_path / "demo"))
    host.write_file("etc/hostname", "kvm-07.example\n")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    monkeypatch.chdir(out_dir)
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    assert cli.main(["snapshot"]) == 0
    made = glob.glob(str(out_dir / "gpulib-snapshot-kvm-07.example-*Z.tar.gz"))
    assert len(made) == 1, os.listdir(out_dir)
    assert made[0] in capsys.readouterr().out
    assert cli.main(["snapshot", "-o", str(tmp_path / "x.tar.gz")]) == 0
    assert tarfile.is_tarfile(str(tmp_path / "x.tar.gz"))


def test_cli_writes_to_stdout(tmp_path: Any, monkeypatch: Any, capsysbinary: Any) -> None:
    host = build_demo(str(tmp_path / "demo"))
    monkeypatch.setenv("GPULIB_ROOT", host.root)
    assert cli.main(["snapshot", "-o", "-"]) == 0
    data = capsysbinary.readouterr().out
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tf:
        assert "proc/cmdline" in tf.getnames()
    assert not any(name.endswith(".tar.gz") for name in os.listdir(tmp_path))


# -- every simulated host replays to the same reports ---------------------------------------

def _reports(root: str) -> dict[str, str]:
    """What the agent, an administrator and Prometheus read of a host:
    `gpulib discover` in its three formats and `gpulib metrics`, the last
    without the series that are times (the state file's mtime, an age)."""
    out = {}
    for name, args in (("cloudstack", ["discover", "--format", "cloudstack"]),
                       ("json", ["discover", "--format", "json"]),
                       ("table", ["discover", "--format", "table"]),
                       ("metrics", ["metrics"])):
        r = subprocess.run([str(BIN / "gpulib"), *args], capture_output=True, text=True,
                           env=hook_env(root), timeout=120)
        assert r.returncode == 0 and r.stderr == "", (name, r.stderr)
        out[name] = r.stdout
    out["metrics"] = "".join(
        line for line in out["metrics"].splitlines(keepends=True)
        if not line.split("{")[0].split(" ")[0].endswith(("_timestamp_seconds", "_age_seconds"))
        or line.startswith("#"))
    return out


@pytest.mark.parametrize("name", sorted(HOSTS))
def test_every_simulated_host_replays_to_the_same_reports(simulated_hosts: Any, name: str,
                                                          tmp_path: Any) -> None:
    """A host's snapshot, unpacked, gives the reports the host gives: the
    CloudStack, native and table forms of `gpulib discover` and `gpulib
    metrics` less its timestamps (NVIDIA vendor VFs' type numbers included,
    which a replay without nvidia-smi has only from the cache in the
    tarball, and the hooks' counters)."""
    root = simulated_hosts[name]
    _reports(root)  # what the agent's first discovery learns and caches, done
    counters.note(root, "starts_refused", hook="qemu", reason="device")
    tarball = str(tmp_path / "host.tar.gz")
    snap.create(Context.for_root(root), tarball)
    host = _reports(root)
    replay = _reports(unpack(tarball, str(tmp_path / "replay")))
    for fmt in host:
        assert replay[fmt] == host[fmt], fmt
    assert 'gpulib_starts_refused_total{hook="qemu",reason="device"} ' in host["metrics"]


def test_a_host_never_discovered_replays_with_its_nvidia_type_numbers(tmp_path: Any) -> None:
    """No cache of NVIDIA's numbers yet (the agent never ran discovery): the
    snapshot asks the host's nvidia-smi, as a report would, and puts the
    answer in the tarball, not on the host; the replay reports the numbers."""
    host = a10_host(str(tmp_path / "h"))
    install_nvidia_smi(host)
    cache = os.path.join(host.root, nvidiasmi.CACHE_FILE)
    assert not os.path.exists(cache)
    tarball = str(tmp_path / "host.tar.gz")
    snap.create(Context.for_root(host.root), tarball)
    # The numbers, and the GPU's MIG mode (`-q`: an A10 has none), as a report asks.
    assert not os.path.exists(cache) and host.nvidia_smi_calls() == ["vgpu -s -v", "-q"]
    members = member_bytes(tarball)
    assert nvidiasmi.CACHE_FILE in members and nvidiasmi.DRIVER_VERSION in members
    replayed = _reports(unpack(tarball, str(tmp_path / "replay")))
    assert replayed == _reports(host.root)
    numbers = [t["max_instances"] for g in json.loads(replayed["json"])["gpus"]
               for t in g["nvidia_types"]]
    assert numbers and None not in numbers


def test_replay_tells_libvirt_and_qemu_versions_without_the_cache(tmp_path: Any) -> None:
    """Where libvirt's capabilities cache is missing, the versions come from its
    library's name and the package database: a replay tells them alike, and
    keeps of the database only QEMU's stanza."""
    host = healthy_host(str(tmp_path / "host"))
    os.unlink(host.p("var/cache/libvirt/qemu/capabilities/3c76bc41.xml"))
    host.write_file("usr/lib/x86_64-linux-gnu/libvirt.so.0.9000.0", "\x7fELF")
    host.write_file("var/lib/dpkg/status",
                    "Package: openssh-server\nStatus: install ok installed\nVersion: 1:9.2\n\n"
                    "Package: qemu-system-x86\nStatus: install ok installed\n"
                    "Version: 1:8.2.1+ds-2\n\n")
    tarball = str(tmp_path / "host.tar.gz")
    snap.create(Context.for_root(host.root), tarball)
    root = unpack(tarball, str(tmp_path / "replay"))
    here = dr.run(Context.for_root(host.root)).results_for("migration")[0]
    there = dr.run(Context.for_root(root)).results_for("migration")[0]
    assert here.status == "ok" and "libvirt 9.0.0, QEMU 8.2.1" in here.message, here.message
    assert (there.status, there.message) == (here.status, here.message)
    with open(os.path.join(root, "var/lib/dpkg/status")) as fh:
        assert "openssh" not in fh.read()


def test_a_mig_host_replays_with_its_mig_mode_instances_and_series(tmp_path: Any) -> None:
    """A MIG host with a pool made: the replay, which has no nvidia-smi,
    reports its MIG mode, its GPU instances and every gpulib_mig_* series
    as the host does, from the layouts the tarball carries."""
    from gpulib import migtool
    from gpulib.sim.hosts import build_mig

    host = build_mig(str(tmp_path / "mig"))
    host.write_file("proc/sys/kernel/random/boot_id", "boot-1\n", 0o444)
    made = subprocess.run([str(BIN / "gpulib"), "pool", "apply"], capture_output=True,
                          text=True, env=hook_env(host.root), timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    tarball = str(tmp_path / "host.tar.gz")
    snap.create(Context.for_root(host.root), tarball)
    assert migtool.CACHE_FILE in member_bytes(tarball)
    original = _reports(host.root)
    root = unpack(tarball, str(tmp_path / "replay"))
    assert not os.path.exists(os.path.join(root, "usr/bin/nvidia-smi"))
    replay = _reports(root)
    for fmt in original:
        assert replay[fmt] == original[fmt], fmt
    series = {line.split("{")[0] for line in replay["metrics"].splitlines()
              if line.startswith("gpulib_mig_")}
    assert {"gpulib_mig_mode_enabled", "gpulib_mig_gpu_instances",
            "gpulib_mig_profile_creatable_instances"} <= series, series
    assert 'gpulib_mig_mode_enabled{pci_bus_id="00000000:41:00.0"} 1' in replay["metrics"]
    gpu = next(g for g in json.loads(replay["json"])["gpus"] if g["address"] == "0000:41:00.0")
    assert len(gpu["mig"]["gpu_instances"]) == 2
    # Later, still no tool: the layouts hold (a snapshot's are not aged out).
    cache = os.path.join(root, migtool.CACHE_FILE)
    with open(cache, encoding="utf-8") as fh:
        doc = json.load(fh)
    for entry in doc["gpus"].values():
        entry["at"] = 0
    with open(cache, "w", encoding="utf-8") as fh:
        json.dump(doc, fh)
    assert _reports(root) == replay
