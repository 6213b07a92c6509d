"""Where a run keeps what it must not lose: node checkpoints, curve snapshots, the SPSA replay
log and join checkpoint, final weights and results.

`storage` is a local path, a shared mount (NFS) or an object store URI (s3://, gs://), read and
written through `pyarrow.fs` the way Ray Train's `storage_path` is, so an actor restarted on
another host finds its checkpoint there. A node's own disk is only ever a cache. A `Storage`
pickles to its URI: actors get one and open the filesystem themselves.
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from raylowcomm.common.files import FileError, parse_json, safetensors_problem

if TYPE_CHECKING:
    import torch

SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "mock")
"""The URI schemes `pyarrow.fs.FileSystem.from_uri` opens (mock: in memory, for tests)."""
BUCKETED = ("s3", "gs", "gcs", "abfs", "abfss")
"""Object stores whose URI names a bucket (or container) first: s3://BUCKET/PATH."""
STATE_FIX = "delete it, or rerun without --resume to start afresh"
"""What to do about a damaged file in a run's state: the run cannot continue from it."""
PROBE_TIMEOUT_S = 20.0
"""How long `Storage.probe` waits for its marker to be written and deleted: an object store whose
credentials chain or endpoint never answers is reported, not waited on for minutes."""


def storage_problem(uri: str) -> str | None:
    """Why a run could not keep its state at `uri` (config.validate names the field), or None: a
    scheme pyarrow.fs does not open, or a local or mounted path that is (or lies under) a file."""
    if "://" in uri:
        scheme = uri.split("://", 1)[0].lower()
        if scheme in BUCKETED and not urlsplit(uri).netloc.rpartition("@")[2]:
            return f"names no bucket: give {scheme}://BUCKET/PATH"
        if scheme in SCHEMES:
            return None
        return (
            f"pyarrow.fs cannot open {scheme}:// URIs: give a path every node can reach (a shared mount) or a URI "
            f"of {', '.join(s + '://' for s in SCHEMES[:-1])}"
        )
    target = Path(uri).expanduser().absolute()
    try:
        existing = next(p for p in (target, *target.parents) if p.exists())  # the root always exists
    except OSError as err:  # a folder on the way that may not be searched
        return f"cannot be looked into ({err.strerror}: {err.filename}): give a folder the driver and the nodes reach"
    if existing.is_dir():
        return None
    where = "is a file" if existing == target else f"lies under {existing}, which is a file"
    return f"{where}: give a folder (new or existing) for the run's state"


class Storage:
    def __init__(self, uri: str | Path):
        uri = str(uri)
        self.uri = uri if "://" in uri else str(Path(uri).expanduser().resolve())
        self._fs = None

    def __reduce__(self):
        return Storage, (self.uri,)

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    def _open(self) -> tuple:
        if self._fs is None:
            from pyarrow import fs

            self._fs, self._base = fs.FileSystem.from_uri(self.uri)
        return self._fs, self._base

    def probe(self, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
        """Why a run could not write here, or None: a marker written the way checkpoints are (folder
        made, file written, renamed where local) and deleted, so read-only, uncreatable, unreachable
        or refused storage stops a run before Ray starts, not at its first checkpoint. Object stores
        are asked with one retry and short timeouts, the whole probe under `timeout_s`. The driver
        writes results and final weights here too, so it asks from the driver, also on a cluster.
        Local folders the probe made are removed again."""
        from pyarrow import ArrowException

        marker, failure, made = f".raylowcomm-probe-{uuid.uuid4().hex[:8]}", [], []

        def write_and_delete() -> None:
            try:
                if self.is_local:
                    target = Path(self.path(""))
                    made.extend(p for p in (target, *target.parents) if not p.exists())  # innermost first
                quick = self.quick()
                quick.write_bytes(marker, b"")
                quick.delete(marker)
            except (OSError, ArrowException) as err:
                failure.append(err)
            for folder in made:
                with contextlib.suppress(OSError):
                    folder.rmdir()

        worker = threading.Thread(target=write_and_delete, name="storage-probe", daemon=True)
        worker.start()
        worker.join(timeout_s)
        fix = (
            "give a folder the driver and every node can write (made if missing)"
            if self.is_local
            else "check the bucket, the endpoint and the credentials"
        )
        if worker.is_alive():
            return f"writing a test file there got no answer in {timeout_s:g} s: {fix}"
        if failure:
            detail = re.sub(r"^\[Errno \d+\] ", "", " ".join(str(failure[0]).split()))
            return f"cannot be written ({detail}): {fix}"
        return None

    def quick(self) -> Storage:
        """This storage with one retry and short timeouts (`_quick`): for the driver's checks before a
        run (`probe`, a resume's look at its state), which must answer in seconds, not after retries."""
        quick = Storage(self.uri)
        quick._fs, quick._base = _quick(*self._open())
        return quick

    @property
    def fs(self):
        return self._open()[0]

    @property
    def is_local(self) -> bool:
        return "://" not in self.uri or self.uri.startswith("file://")

    def path(self, rel: str) -> str:
        """`rel`'s path inside the filesystem."""
        base = self._open()[1]
        return f"{base.rstrip('/')}/{rel}" if rel else base

    def uri_of(self, rel: str) -> str:
        """`rel` as a URI (or local path) a user or Ray Train can open."""
        return f"{self.uri.rstrip('/')}/{rel}" if rel else self.uri

    def exists(self, rel: str) -> bool:
        from pyarrow import fs

        return self.fs.get_file_info(self.path(rel)).type != fs.FileType.NotFound

    def size(self, rel: str) -> int:
        """The bytes of `rel`: what a reader of it fetches."""
        return self.fs.get_file_info(self.path(rel)).size

    def write_bytes(self, rel: str, data: bytes) -> int:
        """Atomic where the filesystem allows it: a local or NFS file is written beside and
        renamed, so a reader (a restarted node) never sees half a checkpoint; an object store's
        put is atomic itself."""
        target = self.path(rel)
        self.fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        tmp = f"{target}.{uuid.uuid4().hex[:8]}.tmp" if self.is_local else target
        with self.fs.open_output_stream(tmp) as f:
            f.write(data)
        if tmp != target:
            self.fs.move(tmp, target)
        return len(data)

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self.path(rel)) as f:
            return f.read()

    def write_json(self, rel: str, value) -> int:
        return self.write_bytes(rel, json.dumps(value, indent=2, default=str).encode())

    def read_json(self, rel: str):
        """`rel`'s JSON; a cut-off or damaged file is a FileError naming it (raylowcomm.common.files)."""
        return parse_json(self.read_bytes(rel), self.uri_of(rel), STATE_FIX)

    def save_tensors(self, rel: str, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> int:
        """safetensors (never pickle); `metadata` travels as JSON in the header. Returns the size. A
        local or mounted file is written tensor by tensor (safetensors' save_file) beside its target
        and renamed, with no serialised copy of every tensor in memory (a 3B model's weights are 6 GB
        more otherwise); an object store gets the serialised bytes. Tensors of another memory format
        (a channels_last weight, its momentum) are written in torch's contiguous order, as safetensors
        needs."""
        from safetensors.torch import save, save_file

        tensors = {k: v.contiguous() for k, v in tensors.items()}

        header = {"raylowcomm": json.dumps(metadata or {})}
        if not self.is_local:
            return self.write_bytes(rel, save(tensors, metadata=header))
        target = self.path(rel)
        self.fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
        tmp = f"{target}.{uuid.uuid4().hex[:8]}.tmp"
        save_file(tensors, tmp, metadata=header)
        self.fs.move(tmp, target)
        return self.fs.get_file_info(target).size

    def load_tensors(self, rel: str) -> tuple[dict[str, torch.Tensor], dict]:
        """The tensors and metadata `save_tensors` wrote; a cut-off or damaged file is a FileError
        naming it, not safetensors' 'incomplete metadata'."""
        from safetensors.torch import load

        data = self.read_bytes(rel)
        problem = safetensors_problem(lambda offset, n: data[offset : offset + n], len(data))
        if problem is not None:
            raise FileError(self.uri_of(rel), problem, STATE_FIX)
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        meta = (header.get("__metadata__") or {}).get("raylowcomm", "{}")
        return load(data), parse_json(meta, self.uri_of(rel), STATE_FIX)

    def tensors_problem(self, rel: str) -> str | None:
        """Why `load_tensors(rel)` would fail, or None, from the file's header and size alone (a
        checkpoint's whole bytes are not read): what a resume checks on the driver before actors start."""
        with self.fs.open_input_file(self.path(rel)) as f:
            return safetensors_problem(lambda offset, n: f.read_at(n, offset), f.size())

    def list(self, rel: str) -> list[str]:
        """The names of the files directly in folder `rel`, sorted; none if it is absent. Files being
        written (a local write's temporary name) are not among them."""
        from pyarrow import fs

        found = self.fs.get_file_info(fs.FileSelector(self.path(rel), allow_not_found=True))
        names = (info.base_name for info in found if info.type == fs.FileType.File)
        return sorted(n for n in names if not n.endswith(".tmp"))

    def walk(self, rel: str) -> list[str]:
        """Every file under folder `rel`, at any depth, as paths relative to the storage (as `rel`
        is), sorted; none if it is absent. Files being written (`.tmp`) are not among them."""
        from pyarrow import fs

        base = self.path("").rstrip("/") + "/"
        found = self.fs.get_file_info(fs.FileSelector(self.path(rel), recursive=True, allow_not_found=True))
        files = (info.path for info in found if info.type == fs.FileType.File and not info.path.endswith(".tmp"))
        return sorted(p[len(base) :] if p.startswith(base) else p for p in files)

    def delete(self, rel: str) -> None:
        """A file or a folder and everything in it; nothing if absent."""
        from pyarrow import fs

        info = self.fs.get_file_info(self.path(rel))
        if info.type == fs.FileType.Directory:
            self.fs.delete_dir(self.path(rel))
        elif info.type == fs.FileType.File:
            self.fs.delete_file(self.path(rel))


def _quick(filesystem, base: str) -> tuple:
    """`filesystem` with one retry and short timeouts where pyarrow lets them be set (S3, GCS), for
    `Storage.probe`: an unreachable endpoint answers in about a second, not after retries. Its
    other options (endpoint, region, credentials) are those `from_uri` read, as pickling keeps them."""
    from datetime import timedelta

    from pyarrow import fs

    name = type(filesystem).__name__
    if name == "S3FileSystem":
        options = {
            **filesystem.__reduce__()[1][0],
            "connect_timeout": 5,
            "request_timeout": 10,
            "retry_strategy": fs.AwsStandardS3RetryStrategy(max_attempts=2),
        }
        return fs.S3FileSystem(**options), base
    if name == "GcsFileSystem":
        return fs.GcsFileSystem(**{**filesystem.__reduce__()[1][0], "retry_time_limit": timedelta(seconds=10)}), base
    return filesystem, base
