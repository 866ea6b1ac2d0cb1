"""The wheels a machine with torch but no package index needs to run this project (docs/GPU.md).

GPU images usually carry torch, numpy, scipy, pillow, tensorboard, matplotlib, tqdm, safetensors, tokenizers
and lightning-utilities, but not the configuration and data libraries, nor torchao (model.float8). On a machine
with internet this downloads them for the target Python (pure-Python wheels, and torchao's x86-64 Linux wheel; no
dependencies pulled in) and builds the one PyPI has no wheel of (antlr4-python3-runtime, omegaconf's parser
runtime):

    python tools/prepare_wheels.py                       # .whl/ for Python 3.12
    python tools/prepare_wheels.py out=/tmp/wheels python=3.11

Then on the GPU machine: python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPTIONS = {"out": str(REPO / ".whl"), "python": "3.12"}
# (package, how it is fetched: "py" a pure-Python wheel, "build" built here from its source, "linux" the
# x86-64 Linux wheel for the target Python)
PACKAGES = (
    ("hydra-core", "py"),
    ("omegaconf", "py"),
    ("antlr4-python3-runtime", "build"),
    ("lightning-fabric", "py"),
    ("webdataset", "py"),
    ("braceexpand", "py"),
    ("torchao", "linux"),
)
LINUX = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pinned(name: str) -> str:
    """``name==version`` as requirements.txt pins it (the versions the test suite ran with)."""
    for line in (REPO / "requirements.txt").read_text().splitlines():
        if re.fullmatch(rf"{re.escape(name)}==[^\s]+", line.strip(), flags=re.IGNORECASE):
            return line.strip()
    raise SystemExit(f"error: requirements.txt pins no {name}")


def main(argv: list[str]) -> int:
    options = dict(OPTIONS)
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in options:
            print(f"error: unknown option {arg!r}: use out=<directory> python=<3.x>", file=sys.stderr)
            return 2
        options[key] = value
    out = Path(options["out"])
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    for name, how in PACKAGES:
        requirement = pinned(name)
        if how == "build":  # a pure-Python package: the wheel built here serves every Python 3
            command = [*pip, "wheel", "--no-deps", "--no-binary", name, "-w", str(out), requirement]
        else:
            command = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", options["python"]]
            if how == "linux":
                command += ["--implementation", "cp", *(f"--platform={tag}" for tag in LINUX)]
            else:
                command += ["--implementation", "py"]
            command += ["-d", str(out), requirement]
        print("+", " ".join(command), flush=True)
        subprocess.run(command, check=True)
    wheels = sorted(p.name for p in out.glob("*.whl"))
    print(f"{len(wheels)} wheel(s) in {out}: {', '.join(wheels)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
