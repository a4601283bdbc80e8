"""The wheel set of the GPU lane (.ci/gpu/wheels.sh): which packages to carry, and its checks.

    wheelset.py requirements                      the project's install_requires + `train` extra
    wheelset.py select REPORT IMAGE               name==version to carry, one a line
    wheelset.py stubs REPORT IMAGE DIR            empty wheels standing in for the image's packages
    wheelset.py check WHEELDIR IMAGE [NAME==VER]  one version each; conflicts with known image versions
    wheelset.py image REPORT IMAGE [NAME==VER]    the image's packages the requirements use (known
                                                  versions pinned): the rehearsal installs them

REPORT is `pip install --dry-run --report` of the requirements for the GPU machine's Python;
IMAGE a file of the package names the GPU machine already has, one a line. A package is carried
when the requirements reach it through carried packages alone: an image package ends the walk,
so the needs of a newer release of it than the image's are never carried.
"""

from __future__ import annotations

import base64
import configparser
import hashlib
import json
import re
import sys
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    from packaging.version import Version
except ImportError:  # a bare interpreter: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name
    from pip._vendor.packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
# The GPU machine: CPython 3.12 on x86-64 Linux.
TARGET = {
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Linux",
    "platform_version": "",
    "python_full_version": "3.12.3",
    "python_version": "3.12",
    "sys_platform": "linux",
}


def fail(message: str) -> None:
    sys.exit(f"wheelset.py: error: {message}")


def project_requirements(setup_cfg: Path = REPO / "setup.cfg") -> list[str]:
    cfg = configparser.ConfigParser()
    cfg.read(setup_cfg)
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in ("pipeline", "train"):  # the lane builds datasets (Beam) and trains
        lines += cfg["options.extras_require"][extra].splitlines()
    lines = [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]
    # Beam without its extras: the lane builds local datasets only, and apache-beam[aws]'s boto3
    # and botocore alone are 20 MiB of the 64 MiB a call carries
    return [re.sub(r"^(apache-beam)\[[^\]]*\]", r"\1", s) for s in lines]


def applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**TARGET, "extra": e}) for e in (extras or {""}))


def read_names(path: str) -> set[str]:
    return {canonicalize_name(s) for s in Path(path).read_text().split() if s}


def resolved(report: str) -> dict[str, dict]:
    """canonical name -> the report's metadata of it."""
    return {
        canonicalize_name(x["metadata"]["name"]): x["metadata"]
        for x in json.load(open(report))["install"]
    }


def select(report: dict[str, dict], image: set[str], top: list[str]) -> dict[str, str]:
    """name -> version of every package the requirements reach through non-image packages."""
    carry: dict[str, str] = {}
    todo = [(Requirement(r), set()) for r in top]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if not applies(req, extras) or name in image:
            continue
        if name not in report:
            fail(f"{req} is not in the resolver's report")
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        meta = report[name]
        carry[name] = meta["version"]
        todo += [(Requirement(r), set(req.extras)) for r in meta.get("requires_dist") or []]
    return carry


def write_stub(directory: Path, name: str, version: str) -> Path:
    """An installable wheel with nothing in it but its name and version (and no needs)."""
    dist = f"{canonicalize_name(name).replace('-', '_')}-{version}"
    files = {
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: wheelset\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    out = directory / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return out


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    head = text.split("\n\n", 1)[0].splitlines()
    field = lambda key: [s.split(":", 1)[1].strip() for s in head if s.startswith(key + ":")]  # noqa: E731
    return field("Name")[0], field("Version")[0], field("Requires-Dist")


def check(wheels: Path, image: set[str], known: dict[str, str]) -> int:
    """Exit status: 1 when a package comes twice; conflicts with the image's known versions are
    printed (pip installs the carried wheels with --no-deps, so they stop nothing)."""
    names: dict[str, list[str]] = {}
    notes = []
    dists = [wheel_metadata(path) + (path,) for path in sorted(wheels.glob("*.whl"))]
    for name, version, needs, path in [
        ("shatter", "setup.cfg", project_requirements(), REPO)
    ] + dists:
        names.setdefault(canonicalize_name(name), []).append(path.name)
        if canonicalize_name(name) in image and path != REPO:
            notes.append(f"error: {path.name} shadows the image's {name}")
        for line in needs:
            req = Requirement(line)
            have = known.get(canonicalize_name(req.name))
            if have and applies(req, set()) and not req.specifier.contains(have, prereleases=True):
                notes.append(f"note: {name} {version} asks {req}; the image has {have}")
    twice = [
        f"error: {n} comes {len(f)} times: {' '.join(f)}" for n, f in names.items() if len(f) > 1
    ]
    for line in twice + notes:
        print(line)
    return 1 if twice or any(x.startswith("error") for x in notes) else 0


def image_requirements(report: dict[str, dict], image: set[str], known: dict[str, str]) -> list:
    """The image's packages in the resolver's report: `name==version` where the image's version
    is known; elsewhere at most the release the resolver chose beside the carried packages (so
    within their bounds: Beam's protobuf<7, say), pip free to go lower where a known one asks
    (torch 2.11's setuptools<82); CUDA's own packages left to torch, which brings its build's."""
    cuda = ("nvidia-", "cuda-")
    return sorted(
        f"{name}=={known[name]}" if name in known else f"{name}<={report[name]['version']}"
        for name in report
        if name in image and not name.startswith(cuda)
    )


def main(argv: list[str]) -> int:
    if argv[:1] == ["requirements"]:
        print("\n".join(project_requirements()))
    elif argv[:1] == ["select"] and len(argv) == 3:
        for name, version in sorted(
            select(resolved(argv[1]), read_names(argv[2]), project_requirements()).items()
        ):
            print(f"{name}=={version}")
    elif argv[:1] == ["stubs"] and len(argv) == 4:
        image, out = read_names(argv[2]), Path(argv[3])
        out.mkdir(parents=True, exist_ok=True)
        for name, meta in resolved(argv[1]).items():
            if name in image:
                write_stub(out, name, meta["version"])
    elif argv[:1] == ["image"] and len(argv) >= 3:
        known = dict(canonical_pin(p) for p in argv[3:])
        print("\n".join(image_requirements(resolved(argv[1]), read_names(argv[2]), known)))
    elif argv[:1] == ["check"] and len(argv) >= 3:
        known = dict(canonical_pin(p) for p in argv[3:])
        return check(Path(argv[1]), read_names(argv[2]), known)
    else:
        fail(f"usage: see {__file__}")
    return 0


def canonical_pin(pin: str) -> tuple[str, str]:
    name, _, version = pin.partition("==")
    Version(version)  # a malformed pin fails here
    return canonicalize_name(name), version


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
