"""Generates the Python stubs (with .pyi) for every proto under protos/.

    python scripts/gen_protos.py          # writes flywheel/<service>/v1/*_pb2*.py(i)
    python scripts/gen_protos.py --check  # exits 1 if regenerating would change them

Files live at protos/flywheel/<service>/v1/<service>.proto and are compiled
with protos/ as the include root, so `package flywheel.<service>.v1` becomes
the import path `flywheel.<service>.v1.<service>_pb2`: imports mirror the
proto packages without rewriting anything.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # dev dependency: only needed here

    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    # Every generated directory is a package (flywheel/<service>/v1/__init__.py).
    for proto in proto_files():
        package_dir = out_dir / proto.parent.relative_to(PROTO_ROOT)
        rel = package_dir.relative_to(out_dir)
        for depth in range(1, len(rel.parts) + 1):
            init = out_dir.joinpath(*rel.parts[:depth], "__init__.py")
            if not init.exists() and depth > 1:
                init.write_text("")


def generated_files(base: Path) -> dict[str, Path]:
    found = {}
    for proto in proto_files():
        package_dir = proto.parent.relative_to(PROTO_ROOT)
        for suffix in GENERATED_SUFFIXES:
            rel = package_dir / (proto.stem + suffix)
            found[str(rel)] = base / rel
        for depth in range(2, len(package_dir.parts) + 1):
            rel = Path(*package_dir.parts[:depth], "__init__.py")
            found[str(rel)] = base / rel
    return found


def stale_files() -> list[str]:
    """Paths whose committed content differs from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = generated_files(Path(tmp))
        committed = generated_files(ROOT)
        return sorted(
            rel
            for rel in fresh
            if not committed[rel].exists() or not filecmp.cmp(fresh[rel], committed[rel], shallow=False)
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stubs that are out of date")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        for rel in stale:
            print(f"out of date: {rel}")
        return 1 if stale else 0
    generate(ROOT)
    print(f"generated stubs for {len(proto_files())} protos")
    return 0


if __name__ == "__main__":
    sys.exit(main())
