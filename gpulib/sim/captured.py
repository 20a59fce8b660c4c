"""nvidia-smi's MIG answers laid out after real captures, for the simulator.

The simulated tool (`gpulib.sim.nvidia_smi`) prints its tables in the
layout of text NVIDIA's tool printed on real hosts (`gpulib/sim/data/
nvidia-smi`, each capture's source named in SOURCES.md there), never
through gpulib's own code, so that gpulib's parsers are tried against the
tool's layout and not against gpulib's idea of it.

A table (`-lgip`, `-lgi`, `-lci`) is learned from a capture: its rule, its
head (down to the `|===|` line), and for each line of a row the place of
each field. A field whose rows end in one column is right-aligned there (an
id: ` 7` and `13`), one whose rows start in one column is left-aligned
there (a name, `16` and `132` under SM); a field the capture shows in one
width only is left-aligned, but for the first (the GPU's index, right as
the tool's columns of numbers are). `-q`'s lines put their colon where the
capture does. The one-line answers (`-cgi`, `-dci`, `-dgi`, `-lgipp`) follow
the captures' lines quoted beside each format.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

TYPE_CHECKING = False
if TYPE_CHECKING:
    from gpulib.nvidiasmi import TypeNumbers
    from gpulib.pci import PciAddress

DATA = os.path.join(os.path.dirname(__file__), "data", "nvidia-smi")
_FIELD = re.compile(r"MIG \S+|\S+")


def read(name: str) -> str:
    with open(os.path.join(DATA, name), encoding="utf-8") as fh:
        return fh.read()


class Table:
    """A table of nvidia-smi's, learned from a capture (see the module's notes)."""

    def __init__(self, rule: str, head: list[str], fields: list[list[tuple[int, int, bool]]],
                 width: int) -> None:
        self.rule = rule
        self.head = head
        # Per row line: each field's (start, end, right-aligned).
        self.fields = fields
        self.width = width

    @classmethod
    def learn(cls, text: str) -> Table:
        lines = text.splitlines()
        rule = lines[0]
        sep = next(i for i, line in enumerate(lines) if line.startswith("|="))
        head = lines[1:sep + 1]
        rows: list[list[str]] = []
        current: list[str] = []
        for line in lines[sep + 1:]:
            if line == rule:
                rows.append(current)
                current = []
            else:
                current.append(line)
        per_line = len(rows[0])
        fields: list[list[tuple[int, int, bool]]] = []
        for k in range(per_line):
            spans = [[(m.start(), m.end()) for m in _FIELD.finditer(row[k][1:-1])]
                     for row in rows if len(row) == per_line]
            line_fields = []
            for j in range(len(spans[0])):
                starts = {s[j][0] + 1 for s in spans if len(s) > j}
                ends = {s[j][1] + 1 for s in spans if len(s) > j}
                right = len(ends) == 1 and (len(starts) > 1 or (j == 0 and k == 0))
                line_fields.append((min(starts), max(ends), right))
            fields.append(line_fields)
        return cls(rule, head, fields, len(rule))

    def row(self, values: Sequence[Sequence[object]]) -> list[str]:
        """One row's lines: `values` per line, one per field."""
        out = []
        for line_fields, line_values in zip(self.fields, values):
            chars = [" "] * self.width
            chars[0] = chars[-1] = "|"
            for (start, end, right), value in zip(line_fields, line_values):
                text = str(value)
                at = end - len(text) if right else start
                chars[at:at + len(text)] = list(text)
            out.append("".join(chars[:self.width]))
        return out

    def render(self, rows: Sequence[Sequence[Sequence[object]]]) -> str:
        lines = [self.rule, *self.head]
        for r in rows:
            lines += [*self.row(r), self.rule]
        return "\n".join(lines) + "\n"


_TABLES: dict[str, Table] = {}


def table(name: str) -> Table:
    if name not in _TABLES:
        _TABLES[name] = Table.learn(read(name))
    return _TABLES[name]


def profiles_table() -> Table:
    return table("h100-80gb-mig-lgip.txt")


def instances_table() -> Table:
    return table("h100-80gb-hbm3-mig-lgi-7x1g.txt")


def compute_table() -> Table:
    return table("h100-80gb-hbm3-mig-lci-7x1g.txt")


_COLON: list[int] = []


def query_line(key: str, value: object, indent: int = 4) -> str:
    """One `nvidia-smi -q` line, its colon where the capture's are."""
    if not _COLON:
        _COLON.append(next(line.index(" : ") for line in read(
            "h100-nvl-550.127.06-q-mig.txt").splitlines() if " : " in line))
    return f"{' ' * indent}{key:<{_COLON[0] - indent}} : {value}"


# The one-line answers, as these captures' lines show them:
# "GPU  0 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1" / "... Placement : {0}:8"
def placements_line(gpu: int, profile: int, starts: Sequence[int], size: int) -> str:
    label = "Placements:" if len(starts) > 1 else "Placement :"
    return f"GPU {gpu:2d} Profile ID {profile:2d} {label} {{{','.join(map(str, starts))}}}:{size}"


# "Successfully created GPU instance ID  2 on GPU  0 using profile MIG 3g.40gb (ID  9)"
def created_gi(gi: int, gpu: int, name: str, profile: int) -> str:
    return (f"Successfully created GPU instance ID {gi:2d} on GPU {gpu:2d} using profile "
            f"{name} (ID {profile:2d})")


# "Successfully created compute instance ID  0 on GPU  0 GPU instance ID 13 using
# profile MIG 1g.12gb (ID  0)"
def created_ci(ci: int, gpu: int, gi: int, name: str, ci_profile: int) -> str:
    return (f"Successfully created compute instance ID {ci:2d} on GPU {gpu:2d} GPU instance "
            f"ID {gi:2d} using profile {name} (ID {ci_profile:2d})")


# "Successfully destroyed compute instance ID  2 from GPU  0 GPU instance ID  1"
def destroyed_ci(ci: int, gpu: int, gi: int) -> str:
    return (f"Successfully destroyed compute instance ID {ci:2d} from GPU {gpu:2d} GPU "
            f"instance ID {gi:2d}")


# "Successfully destroyed GPU instance ID  1 from GPU  0"
def destroyed_gi(gi: int, gpu: int) -> str:
    return f"Successfully destroyed GPU instance ID {gi:2d} from GPU {gpu:2d}"



# `nvidia-smi vgpu -s -v`: a `GPU <bus id>` line, then per type its `vGPU
# Type ID` line and its fields, in the capture's order and indents, the
# colon where the capture has it.
_VGPU_CAPTURE = "rtx-pro-6000-580.105.06-vgpu-s-v.txt"
# After FB Memory, which ends the capture's blocks (see SOURCES.md).
_VGPU_MORE = ("Display Heads", "Maximum X Resolution", "Maximum Y Resolution")
_VGPU_LAYOUT: list[tuple[int, list[tuple[int, str]]]] = []


def _vgpu_layout() -> tuple[int, list[tuple[int, str]]]:
    """(the colon's column, [(indent, key)] of one type's block)."""
    if not _VGPU_LAYOUT:
        lines = read(_VGPU_CAPTURE).splitlines()
        colon = next(line.index(" : ") for line in lines if " : " in line)
        block: list[tuple[int, str]] = []
        for line in lines[1:]:
            key = line.partition(" : ")[0]
            indent = len(key) - len(key.lstrip(" "))
            if block and indent == block[0][0]:
                break  # the next type's block
            block.append((indent, key.strip()))
        block += [(block[-1][0], k) for k in _VGPU_MORE]
        _VGPU_LAYOUT.append((colon, block))
    return _VGPU_LAYOUT[0]


def vgpu_types(gpus: dict[PciAddress, dict[int, tuple[str, TypeNumbers]]]) -> str:
    """`nvidia-smi vgpu -s -v` for {GPU: {type id: (class, numbers)}}."""
    colon, block = _vgpu_layout()
    lines = []
    for address in sorted(gpus):
        lines.append(f"GPU {address.domain:08X}:{address.bus:02X}:{address.slot:02X}."
                     f"{address.function:X}")
        for tid, (klass, n) in sorted(gpus[address].items()):
            mig_backed = n.gi_profile is not None
            values: dict[str, object] = {
                "vGPU Type ID": f"0x{tid:x}", "Name": n.name, "Class": klass,
                "GPU Instance Profile ID": n.gi_profile if mig_backed else "N/A",
                "Max Instances": n.max_instances, "Max Instances Per VM": 1,
                "Max Instances Per GI": (n.per_gi or 1) if mig_backed else "N/A",
                "FB Memory": f"{n.framebuffer_mb} MiB", "Display Heads": n.num_heads}
            if n.max_resolution:
                values["Maximum X Resolution"] = n.max_resolution[0]
                values["Maximum Y Resolution"] = n.max_resolution[1]
            for indent, key in block:
                if key in values:
                    lines.append(f"{' ' * indent}{key:<{colon - indent}} : {values[key]}")
    return "\n".join(lines) + "\n"
