"""Run directories on local disk or on storage that every host sees (docs/scaling.md).

`run_dir` may be a path or a URL (`gs://`, `s3://`, `file://`, any filesystem fsspec knows; `memory://` in tests):
a run's small files (config.json, metrics.jsonl, TensorBoard events, stack dumps) and everything jaxlm does to a
checkpoint folder go through fsspec, which serves local paths too. Object stores can neither append (a URL run's
append-only files are written to a local mirror and uploaded whole at every flush: `Mirror`) nor rename (`move`
copies and deletes). Checkpoints go through Orbax and tensorstore (`orbax_dir`): the endpoint settings s3fs and
gcsfs read (AWS_ENDPOINT_URL, STORAGE_EMULATOR_HOST) are handed to tensorstore, which does not read them.
Credentials come from the usual AWS variables or files and Google's default credentials.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from jaxlm.config import ConfigError

ORBAX_SCHEMES = ("gs", "s3")  # the URL schemes Orbax (tensorstore) writes checkpoints to
PIP_HINTS = {"gs": "pip install gcsfs", "s3": "pip install s3fs", "az": "pip install adlfs"}


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


def filesystem(path: str | Path, setting: str = "run_dir"):
    """(fsspec filesystem, path within it) for a path or URL; a one-line error, naming the `setting` that gave
    the URL, when no filesystem serves its scheme. A URL's filesystem caches no listings, and neither does the
    one Orbax opens for it (fsspec shares its settings): other processes, and tensorstore beside fsspec, write
    the same folders, and a stale listing shows deleted files (a rejected checkpoint) or hides new ones."""
    import fsspec

    if local_path(path) is None:
        fsspec.config.conf.setdefault(scheme(path), {})["use_listings_cache"] = False
    try:
        return fsspec.core.url_to_fs(str(path))
    except (ImportError, ValueError) as e:
        hint = PIP_HINTS.get(scheme(path))
        raise ConfigError(f"{setting} {path}: no filesystem for {scheme(path)}:// URLs"
                          + (f" ({hint})" if hint else f" ({str(e).splitlines()[0]})")) from None


def check_reachable(path: str | Path, setting: str = "run_dir") -> None:
    """Fail in one line, before anything is compiled, when a URL's storage cannot be reached (a wrong endpoint,
    no credentials) or its bucket does not exist (fsspec would create it); the line names the `setting`."""
    fs, p = filesystem(path, setting)
    probe = p.split("/", 1)[0] if scheme(path) in ORBAX_SCHEMES else p
    try:
        fs.info(probe)
    except FileNotFoundError:
        if probe != p:
            raise ConfigError(f"{setting} {path}: bucket {probe} does not exist; create it or fix the URL") from None
    except Exception as e:  # noqa: BLE001 - each filesystem and SDK raises its own types
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        variable = {"gs": "STORAGE_EMULATOR_HOST for a GCS emulator"}.get(scheme(path),
                                                                         "AWS_ENDPOINT_URL for an S3-compatible server")
        raise ConfigError(f"{setting} {path}: its storage cannot be reached ({e.__class__.__name__}: {first}); check "
                          f"the endpoint ({variable}), credentials and network") from None


def exists(path: str | Path) -> bool:
    fs, p = filesystem(path)
    return fs.exists(p)


def isdir(path: str | Path) -> bool:
    fs, p = filesystem(path)
    return fs.isdir(p)


def makedirs(path: str | Path) -> None:
    fs, p = filesystem(path)
    fs.makedirs(p, exist_ok=True)


def open_file(path: str | Path, mode: str = "rb"):
    fs, p = filesystem(path)
    return fs.open(p, mode)


def read_text(path: str | Path) -> str:
    with open_file(path, "r") as f:
        return f.read()


def write_text(path: str | Path, text: str) -> None:
    """Write a whole file so that readers see the old or the new text, never a part, even after a crash: a
    local file through a temporary name, fsync and a rename; an object store replaces an object in one step."""
    local = local_path(path)
    if local is not None:
        tmp = local.with_name(f"{local.name}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, local)
        return
    with open_file(path, "w") as f:
        f.write(text)


def folders(path: str | Path) -> list[str]:
    """Names of the folders in a folder ([] when it does not exist)."""
    fs, p = filesystem(path)
    try:
        entries = fs.ls(p, detail=True)
    except FileNotFoundError:
        return []
    return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")


def files(path: str | Path) -> dict[str, int]:
    """{path relative to the folder (with /): size in bytes} of every file under a folder, in one listing."""
    fs, p = filesystem(path)
    root = p.rstrip("/") + "/"
    return {name[len(root):]: info["size"] for name, info in fs.find(p, detail=True).items()
            if name.startswith(root) and info["type"] == "file"}


def remove(path: str | Path) -> None:
    """Delete a file or a folder with everything in it; nothing when it does not exist."""
    fs, p = filesystem(path)
    try:
        fs.rm(p, recursive=True)
    except FileNotFoundError:
        pass


def move(src: str | Path, dst: str | Path) -> None:
    """Move a folder to a path that does not exist yet: one rename on a local disk; on an object store, which
    has no rename, a copy of every object (done by the server) and then the deletion of the originals."""
    fs, s = filesystem(src)
    d = filesystem(dst)[1]
    if local_path(src) is not None:
        os.replace(s, d)
    else:
        fs.copy(s, d, recursive=True)
        fs.rm(s, recursive=True)


def orbax_dir(path: str | Path):
    """The checkpoint folder as Orbax takes it: an absolute local Path, or an etils Path for gs:// and s3://."""
    local = local_path(path)
    if local is not None:
        return local.absolute()
    if scheme(path) not in ORBAX_SCHEMES:
        raise ConfigError(f"checkpoints cannot be written to {path}: Orbax writes local paths, file://, gs:// and "
                          "s3:// URLs; use one of those for run_dir or set checkpoint.enabled=false")
    filesystem(path)  # Orbax writes its small files through the same fsspec filesystem (gcsfs, s3fs)
    if scheme(path) == "s3":
        _orbax_writes_s3()
    if scheme(path) == "gs" and (url := gcs_endpoint()):
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
    from etils import epath

    return epath.Path(str(path))


def _orbax_writes_s3() -> None:
    """Orbax (through 0.12.8) builds tensorstore specs for local paths and gs:// only: an s3:// folder became
    the relative file path 's3:/bucket/...' and every save failed. Orbax lays out a bucket the same way for
    both, so this builds the gs:// spec and swaps tensorstore's s3 driver in, with the endpoint of an
    S3-compatible server. Installed once, on the first s3:// checkpoint folder."""
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    build = ts_utils.build_kvstore_tspec
    if getattr(build, "serves_s3", False):
        return

    def build_kvstore_tspec(directory, *args, **kwargs):
        if not str(directory).startswith("s3://"):
            return build(directory, *args, **kwargs)
        gcs = build("gs://" + str(directory)[len("s3://"):], *args, **kwargs)
        s3 = _gcs_to_s3(gcs, s3_endpoint())
        if s3 == gcs:
            raise ConfigError(f"this Orbax version lays out gs:// buckets differently; jaxlm cannot write s3:// "
                              f"checkpoints with it (install orbax-checkpoint 0.12.x, or mount the bucket): {gcs}")
        return s3

    build_kvstore_tspec.serves_s3 = True
    ts_utils.build_kvstore_tspec = build_kvstore_tspec


def gcs_endpoint() -> str | None:
    """The URL of the GCS endpoint STORAGE_EMULATOR_HOST names (gcsfs's reading of it: a scheme is optional)."""
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host in ("", "default"):
        return None
    return host if host.startswith(("http://", "https://")) else f"http://{host}"


def s3_endpoint() -> dict:
    """The tensorstore spec members that point its s3 driver at the server botocore (s3fs) uses."""
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return {"endpoint": url} if url else {}


def _gcs_to_s3(spec, endpoint: dict):
    """The tensorstore spec with each gcs kvstore replaced by the s3 one of the same bucket and path."""
    if isinstance(spec, dict):
        if spec.get("driver") in ("gcs", "gcs_grpc"):
            return {**spec, "driver": "s3", **endpoint}
        return {k: _gcs_to_s3(v, endpoint) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_gcs_to_s3(v, endpoint) for v in spec]
    return spec


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
