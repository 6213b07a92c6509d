"""Where a run keeps what it must not lose: node checkpoints, curve snapshots, the SPSA replay
log and join checkpoint, final weights and results.

`storage` is a local path, a shared mount (NFS) or an object store URI (s3://, gs://), read and
written through `pyarrow.fs` the way Ray Train's `storage_path` is, so an actor restarted on
another host finds its checkpoint there. A node's own disk is only ever a cache. A `Storage`
pickles to its URI: actors get one and open the filesystem themselves.
"""

from __future__ import annotations

import json
import struct
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SCHEMES = ("file", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "mock")
"""The URI schemes `pyarrow.fs.FileSystem.from_uri` opens (mock: in memory, for tests)."""


def storage_problem(uri: str) -> str | None:
    """Why a run could not keep its state at `uri` (config.validate names the field), or None: a
    scheme pyarrow.fs does not open, or a local or mounted path that is (or lies under) a file."""
    if "://" in uri:
        scheme = uri.split("://", 1)[0].lower()
        if scheme in SCHEMES:
            return None
        return (f"pyarrow.fs cannot open {scheme}:// URIs: give a path every node can reach (a shared mount) or a URI "
                f"of {', '.join(s + '://' for s in SCHEMES[:-1])}")
    target = Path(uri).expanduser().absolute()
    existing = next(p for p in (target, *target.parents) if p.exists())  # the root always exists
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
        return json.loads(self.read_bytes(rel))

    def save_tensors(self, rel: str, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> int:
        """safetensors (never pickle); `metadata` travels as JSON in the header. Returns the size. A
        local or mounted file is written tensor by tensor (safetensors' save_file) beside its target
        and renamed, with no serialised copy of every tensor in memory (a 3B model's weights are 6 GB
        more otherwise); an object store gets the serialised bytes."""
        from safetensors.torch import save, save_file

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
        from safetensors.torch import load

        data = self.read_bytes(rel)
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        return load(data), json.loads((header.get("__metadata__") or {}).get("raylowcomm", "{}"))

    def delete(self, rel: str) -> None:
        """A file or a folder and everything in it; nothing if absent."""
        from pyarrow import fs

        info = self.fs.get_file_info(self.path(rel))
        if info.type == fs.FileType.Directory:
            self.fs.delete_dir(self.path(rel))
        elif info.type == fs.FileType.File:
            self.fs.delete_file(self.path(rel))
