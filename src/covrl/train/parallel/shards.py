"""The storage side of a sharded (fsdp2) checkpoint's dcp/ folder, for covrl.train.parallel.wrappers'
save_sharded / load_sharded:

- `writer(folder)`: DCP's file writer with the reliability tests' fault point (`checkpoint-shards`) where each
  rank starts writing its shards, inside DCP's collective;
- `failure(err)`: DCP's CheckpointException (a BaseException with every rank's failure, raised on every
  rank) as a ShardIOError (an OSError) when a rank met one (a full disk, a read-only folder: the
  checkpoint writer then removes the partial folder and the run ends with exit code 4 on every rank), as the
  KeyboardInterrupt (Ctrl-C, SIGTERM) a rank met, else as a RuntimeError;
- `reader(folder)`: DCP's file reader, except that `.metadata` (a pickle) is unpickled with an allowlist of
  DCP's own metadata classes: nothing in a checkpoint is executed (DCP itself calls `pickle.load`);
- `check(folder)`: what a resume can verify before anything is loaded: the metadata reads, and every shard
  file it names exists, holds each recorded byte range and starts each item as torch.save does (so a
  truncated, deleted or overwritten shard is met while an older checkpoint can still be chosen).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath

from covrl.train.faults import fault_point

__all__ = ["ShardIOError", "check", "failure", "read_metadata", "reader", "writer"]

METADATA = ".metadata"
_ZIP_MAGIC = b"PK\x03\x04"   # each item is a torch.save archive (DCP's default serialization, what writer() uses)


class ShardIOError(OSError):
    """A rank's shards could not be written or read (a full disk, a read-only folder, a missing file): DCP
    gathers the ranks' failures, so every rank raises it alike."""


def writer(directory: str):
    """DCP's file writer (what `checkpoint_id=<folder>` picks) with the fault point `checkpoint-shards`."""
    from torch.distributed.checkpoint import FileSystemWriter

    class ShardWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            fault_point("checkpoint-shards")   # reliability tests: COVRL_FAULT (no-op otherwise)
            return super().write_data(plan, planner)

    return ShardWriter(directory)


def failure(err, doing: str = "written") -> BaseException:
    """The exception DCP's CheckpointException stands for (the same on every rank: DCP broadcasts it)."""
    failures = {rank: exc for rank, (exc, _trace) in sorted(err.failures.items())}
    interrupt = next((exc for exc in failures.values() if isinstance(exc, KeyboardInterrupt)), None)
    if interrupt is not None:   # Ctrl-C / SIGTERM met by a rank inside DCP (which catches BaseException)
        return interrupt
    text = "; ".join(f"rank {rank}: {exc.strerror or exc}" if isinstance(exc, OSError) else
                     f"rank {rank}: {type(exc).__name__}: {exc}" for rank, exc in failures.items())
    text = f"the sharded state (torch.distributed.checkpoint) was not {doing} ({text})"
    os_error = next((exc for exc in failures.values() if isinstance(exc, OSError)), None)
    return RuntimeError(text) if os_error is None else ShardIOError(os_error.errno, text)


def _allowed() -> dict[tuple[str, str], object]:
    import torch
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md
    import torch.serialization

    names = {(md.__name__, n): getattr(md, n) for n in (
        "Metadata", "StorageMeta", "MetadataIndex", "BytesStorageMetadata", "TensorProperties",
        "ChunkStorageMetadata", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")}
    names[(fs.__name__, "_StorageInfo")] = fs._StorageInfo
    names[("torch", "Size")] = torch.Size
    names[("torch.serialization", "_get_layout")] = torch.serialization._get_layout   # a layout by its name
    names.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    names.update({("pathlib", c.__name__): c for c in (Path, PosixPath, WindowsPath, PurePosixPath, PureWindowsPath)})
    return names


class _MetadataUnpickler(pickle.Unpickler):
    """Only DCP's metadata classes (and torch.Size, dtypes, paths) can be named: a payload that names anything
    else (os.system, builtins.eval, ...) is refused before it runs."""

    allowed: dict[tuple[str, str], object] = {}

    def find_class(self, module: str, name: str):
        found = self.allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a torch.distributed.checkpoint "
                                         "metadata file; it is not unpickled")
        return found


def read_metadata(directory) -> object:
    """`<directory>/.metadata` through the allowlist unpickler (raises pickle.UnpicklingError, EOFError, ...)."""
    if not _MetadataUnpickler.allowed:
        _MetadataUnpickler.allowed = _allowed()
    with open(Path(directory) / METADATA, "rb") as f:
        return _MetadataUnpickler(io.BytesIO(f.read())).load()


def reader(directory: str):
    """DCP's file reader with `read_metadata` above in place of its `pickle.load`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class ShardReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            if kwargs.get("rank") is not None:   # per-rank metadata: covrl's writer never writes it
                raise FileNotFoundError(f"{self.path}: no per-rank metadata")
            metadata = read_metadata(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return ShardReader(directory)


def check(directory) -> None:
    """Raise ValueError (what is wrong, in one line) unless `directory` holds a readable sharded state: the
    metadata unpickles through the allowlist and every shard file it names exists, is long enough for each
    item recorded in it, and has an archive's signature where each item starts."""
    directory = Path(directory)
    try:
        metadata = read_metadata(directory)
    except FileNotFoundError:
        raise ValueError(f"{METADATA} is missing") from None
    except Exception as err:  # noqa: BLE001 - a truncated or garbage pickle raises many kinds
        raise ValueError(f"{METADATA} is unreadable ({type(err).__name__}: {err})") from None
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, dict) or not storage:
        raise ValueError(f"{METADATA} names no shards")
    items: dict[str, list[tuple[int, int, bool]]] = {}
    for info in storage.values():
        plain = not getattr(info, "transform_descriptors", None)   # compressed / transformed items: no signature
        items.setdefault(str(info.relative_path), []).append((int(info.offset), int(info.length), plain))
    for rel, spans in sorted(items.items()):
        path = directory / rel
        if PurePosixPath(rel).is_absolute() or ".." in PurePosixPath(rel).parts or not path.is_file():
            raise ValueError(f"shard {rel} named by {METADATA} is missing")
        size = path.stat().st_size
        end = max(offset + length for offset, length, _ in spans)
        if size < end:
            raise ValueError(f"shard {rel} is truncated ({size} bytes, {METADATA} records {end})")
        with open(path, "rb") as f:
            for offset, length, plain in spans:
                f.seek(offset)
                if plain and length >= len(_ZIP_MAGIC) and f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
                    raise ValueError(f"shard {rel} is damaged: the item at byte {offset} is not what "
                                     "torch.distributed.checkpoint wrote")
