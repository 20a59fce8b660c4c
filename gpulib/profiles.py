"""What a vGPU profile or type name means: the one rule, everywhere.

A vGPU type is known by two names: its id (an mdev type's directory,
`nvidia-232`; an NVIDIA vendor VF type's number, `594`, also written
`nvidia-594`) and its name (`GRID T4-4Q`, `NVIDIA A10-6Q`: an mdev type's
`name` file, a line of a VF's `creatable_vgpu_types`). CloudStack works by
name (its vGPU profiles), and NVIDIA numbers its types per driver branch, so:

* names are equal when they are equal ignoring case and runs of blanks
  (`key`): "grid t4-2q" is "GRID T4-2Q", as CloudStack's profiles are;
* an mdev type id is its directory name, compared exactly; a vendor VF type
  id is a number, with or without the `nvidia-` prefix (`vendor_number`);
* what a request, a pool or a record asks for is served by an offered type
  (`serves`): a type id asks for that id; a profile asks for that name (or,
  for a type without a name, that id); both together (a record of what a
  vGPU is, `<gpulib:device>`) ask for an equivalent type: the same name
  when both names are known -- the id is only a hint, a same id with
  another name is another type -- else the same id.

Every caller decides with these functions: `vf set-type`, `attach --profile`
and metadata requests (`VgpuRequest`), pools' `profile =` and `type =`, the
doctor's pool check, migration. A leaf module: no import but `validate`.
"""

from __future__ import annotations

from gpulib.validate import decimal

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional, Union

# The prefix an NVIDIA vendor VF type number may carry (as mdev type ids do).
VENDOR_PREFIX = "nvidia-"
# NVIDIA's type numbers are small (below 10**4); 9 digits is the bound.
VENDOR_DIGITS = 9


def key(name: str) -> str:
    """The form two names are compared in: case folded, blanks collapsed."""
    return " ".join(name.split()).casefold()


def same_name(a: Optional[str], b: Optional[str]) -> bool:
    """Whether two names (both known) name the same type."""
    return a is not None and b is not None and key(a) == key(b)


def vendor_number(text: object) -> Optional[int]:
    """An NVIDIA vendor VF type id as written (`594`, `nvidia-594`, blanks
    around it allowed) as its number; None when it is no such id."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text if text >= 0 else None
    if not isinstance(text, str):
        return None
    bare = text.strip()
    if bare[:len(VENDOR_PREFIX)].lower() == VENDOR_PREFIX:
        bare = bare[len(VENDOR_PREFIX):]
    return decimal(bare, VENDOR_DIGITS)


def same_id(wanted: str, offered: Union[str, int]) -> bool:
    """Whether a type id as asked for is the offered one: an mdev type's
    directory name exactly (`offered` a str), a vendor VF type's number
    (`offered` an int; `wanted` with or without the prefix)."""
    if isinstance(offered, int):
        return vendor_number(wanted) == offered
    return wanted == offered


def serves(profile: Optional[str], type_id: Optional[str], offered_id: Union[str, int],
           offered_name: Optional[str]) -> bool:
    """Whether an offered type (its id, its name when known) is what is asked
    for: a `type_id`, a `profile`, or both (an equivalent of a recorded type:
    its name decides when both names are known, else its id)."""
    if profile is not None and type_id is not None:
        if offered_name is not None:
            return same_name(profile, offered_name)
        return same_id(type_id, offered_id)
    if type_id is not None:
        return same_id(type_id, offered_id)
    if profile is None:
        return False
    # A type without a name is listed under its id: a profile names it so.
    return same_name(profile, offered_name) or key(profile) == key(str(offered_id))


def equivalent(type_id: str, name: Optional[str], offered_id: Union[str, int],
               offered_name: Optional[str]) -> bool:
    """Whether an offered type is equivalent to a recorded one (`type_id`,
    `name`): the same name when both are known, else the same id."""
    return serves(name, type_id, offered_id, offered_name)


def pick(creatable: dict[int, str], type_id: Optional[str], name: Optional[str]) -> Optional[int]:
    """The number of the type in a VF's creatable list (number -> name) that
    serves a recorded type (`type_id`, `name`; either may be unknown): by name
    when both names are known, its own number first when several are named
    alike; None when none serves."""
    hits = sorted(tid for tid, n in creatable.items() if serves(name, type_id, tid, n))
    wanted = vendor_number(type_id) if type_id is not None else None
    if wanted in hits:
        return wanted
    return hits[0] if hits else None
