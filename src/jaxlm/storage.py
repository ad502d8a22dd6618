"""Run directories on local disk or on storage that every host sees.

`run_dir` may be a path or a URL: `gs://bucket/runs/a`, `s3://...`, `file:///shared/runs/a`, or any other
filesystem fsspec knows (`memory://` in tests). Checkpoints go through Orbax, which writes local paths, gs://
and s3:// itself (with tensorstore); the small files of a run (config.json, metrics.jsonl, TensorBoard events,
stack dumps) go through fsspec. Object stores cannot append to a file, so a URL run's append-only files are
written to a local mirror folder and uploaded whole at every flush (`Mirror`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from jaxlm.config import ConfigError

ORBAX_SCHEMES = ("gs", "s3")  # the URL schemes Orbax (tensorstore) writes checkpoints to


def scheme(path: str | Path) -> str:
    """'' for a plain path, else the URL scheme ('file', 'gs', 's3', 'memory', ...)."""
    s = str(path)
    return s.split("://", 1)[0] if "://" in s else ""


def local_path(path: str | Path) -> Path | None:
    """The local path of a plain path or a file:// URL; None for other URLs."""
    s = str(path)
    if scheme(s) == "file":
        return Path(s[len("file://"):])
    return None if scheme(s) else Path(s)


def local_folder(path: str | Path, what: str) -> Path:
    """A plain path or file:// URL as a Path; other URLs fail in one line (`what` names the command)."""
    local = local_path(path)
    if local is None:
        raise ConfigError(f"{what} reads a local folder or a file:// URL, not {path}; copy the run directory "
                          "here or mount its bucket")
    return local


def join(base: str | Path, *parts: str) -> str:
    if local_path(base) is not None and not scheme(base):
        return str(Path(base, *parts))
    return "/".join([str(base).rstrip("/"), *parts])


def filesystem(path: str | Path):
    """(fsspec filesystem, path within it) for a URL; a one-line error when no filesystem serves its scheme."""
    import fsspec

    try:
        return fsspec.core.url_to_fs(str(path))
    except (ImportError, ValueError) as e:
        hint = {"gs": "pip install gcsfs", "s3": "pip install s3fs", "az": "pip install adlfs"}.get(scheme(path))
        raise ConfigError(f"run_dir {path}: no filesystem for {scheme(path)}:// URLs"
                          + (f" ({hint})" if hint else f" ({str(e).splitlines()[0]})")) from None


def exists(path: str | Path) -> bool:
    local = local_path(path)
    if local is not None:
        return local.exists()
    fs, p = filesystem(path)
    return fs.exists(p)


def makedirs(path: str | Path) -> None:
    local = local_path(path)
    if local is not None:
        local.mkdir(parents=True, exist_ok=True)
    else:
        fs, p = filesystem(path)
        fs.makedirs(p, exist_ok=True)


def read_text(path: str | Path) -> str:
    local = local_path(path)
    if local is not None:
        return local.read_text()
    fs, p = filesystem(path)
    with fs.open(p, "r") as f:
        return f.read()


def write_text(path: str | Path, text: str) -> None:
    """Write a whole file so that readers see the old or the new text, never a part: a local file through a
    temporary name and a rename; an object store replaces an object in one step."""
    local = local_path(path)
    if local is not None:
        tmp = local.with_name(f"{local.name}.tmp{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, local)
        return
    fs, p = filesystem(path)
    with fs.open(p, "w") as f:
        f.write(text)


def orbax_dir(path: str | Path):
    """The checkpoint folder as Orbax takes it: an absolute local Path, or an etils Path for gs:// and s3://."""
    local = local_path(path)
    if local is not None:
        return local.absolute()
    if scheme(path) in ORBAX_SCHEMES:
        from etils import epath

        return epath.Path(str(path))
    raise ConfigError(f"checkpoints cannot be written to {path}: Orbax writes local paths, file://, gs:// and s3:// "
                      "URLs; use one of those for run_dir or set checkpoint.enabled=false")


class Mirror:
    """A local folder standing in for a run directory's append-only files. For a local run directory it is the
    run directory itself; for a URL it is a cache folder whose files are uploaded to the URL by `sync()` (and
    whose metrics.jsonl starts as a copy of the one there, so that a resumed run appends to it)."""

    def __init__(self, run_dir: str | Path, download: tuple[str, ...] = ("metrics.jsonl",)):
        self.run_dir = str(run_dir)
        local = local_path(run_dir)
        self.remote = local is None
        if local is not None:
            self.dir = local
            return
        self.dir = Path(tempfile.mkdtemp(prefix="jaxlm-mirror-"))
        self._sent: dict[str, tuple[int, int]] = {}
        fs, root = filesystem(self.run_dir)
        for name in download:
            if fs.exists(f"{root}/{name}"):
                fs.get(f"{root}/{name}", str(self.dir / name))

    def sync(self) -> None:
        """Upload the mirror's new or changed files."""
        if not self.remote:
            return
        fs, root = filesystem(self.run_dir)
        for f in sorted(p for p in self.dir.rglob("*") if p.is_file()):
            rel = f.relative_to(self.dir).as_posix()
            st = f.stat()
            if self._sent.get(rel) != (st.st_size, st.st_mtime_ns):
                fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
                fs.put_file(str(f), f"{root}/{rel}")
                self._sent[rel] = (st.st_size, st.st_mtime_ns)

    def close(self) -> None:
        """Upload what is left and remove a URL run's cache folder."""
        if self.remote:
            self.sync()
            shutil.rmtree(self.dir, ignore_errors=True)
