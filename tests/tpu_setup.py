"""The TPU tier's packages (`make test-tpu`): what jaxlm needs at run time, what the tier's serving tests talk
with and what benchmarks/serve.py needs on a chip (tokenizers), installed with pip into one folder (`--target`)
where the running Python lacks them.

A TPU machine comes with its own JAX and libtpu, often without network access and with a package index of its
own: nothing here installs JAX (the machine's stays the one imported), and pip's index and options come from
the caller (`TPU_PIP_ARGS` in the Makefile; docs/tpu.md). A second run finds everything and installs nothing.

usage: python tests/tpu_setup.py SITE [pip options ...]
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Beyond the runtime dependencies: the server (the `serve` extra) and the client the serving tests drive it with.
TIER_EXTRAS = ("serve",)
TIER_CLIENTS = ("openai>=1.40", "httpx>=0.27")
# What benchmarks/serve.py needs on a chip (`--parts serve,engine --uds`) beyond those: its word-level tokenizer.
TIER_BENCHMARKS = ("tokenizers>=0.20",)
NEVER = ("jax", "jaxlib", "libtpu")  # the machine's own


def requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in TIER_EXTRAS:
        reqs += project["optional-dependencies"][extra]
    return reqs + list(TIER_CLIENTS) + list(TIER_BENCHMARKS)


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0]


def missing(reqs: list[str]) -> list[str]:
    """The requirements whose distribution this Python cannot find (versions are not compared: the machine's
    packages are taken as they are)."""
    out = []
    for req in reqs:
        if ";" in req and "win32" in req.split(";", 1)[1] and sys.platform == "win32":
            continue
        name = _name(req)
        if name.lower() in NEVER:
            continue
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out.append(req)
    return out


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    site, pip_args = Path(argv[0]).resolve(), argv[1:]
    sys.path.append(str(site))  # what an earlier run installed there counts as present
    importlib.invalidate_caches()
    need = missing(requirements())
    if not need:
        print(f"tpu tier: every package present (site {site})")
        return 0
    # By name, without the version floors: a machine's own index may hold older releases, and the tier takes what
    # it has (the versions it ran with are in its report: docs/tpu.md).
    names = [_name(req) for req in need]
    print(f"tpu tier: installing {', '.join(names)} into {site}", flush=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target", str(site),
           "--upgrade", *pip_args, *names]
    if subprocess.run(cmd).returncode:
        print(f"tpu tier: pip could not install {', '.join(names)}; give pip an index it can reach, e.g. make test-tpu "
              "TPU_PIP_ARGS='--index-url file:///path/to/simple' (docs/tpu.md)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
