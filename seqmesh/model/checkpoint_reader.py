"""Reading a ``torch.distributed.checkpoint`` folder without running code from it.

DCP stores a checkpoint's index (``.metadata``) as a pickle and reads it with a plain ``pickle.load``;
its default planner reads non-tensor items with ``torch.load(weights_only=False)``. Either lets whoever
wrote the folder run code on every rank that loads it, and the checksums in ``seqmesh.json`` cannot
help: whoever writes the folder writes those too. Here:

- ``.metadata`` is unpickled by :class:`MetadataUnpickler`, which builds only DCP's own metadata
  classes, ``torch.Size``, dtypes and layouts, and the ``PosixPath`` DCP records as the folder it
  saved to (:data:`METADATA_GLOBALS`); any other class, or a file that is not such a pickle, is
  refused with an :class:`UnsafeCheckpoint` naming the file;
- every storage file the metadata names must be a plain file name, so it resolves inside the folder;
- non-tensor items are decoded with ``torch.load(weights_only=True)`` (:class:`CheckedLoadPlanner`).

:func:`load_checked` is ``dcp.load`` with both; :func:`read_checked_metadata` the index alone.
"""

from __future__ import annotations

import io
import os
import pickle
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

METADATA_FILE = ".metadata"
FIX = "re-save it with seqmesh, or don't load a checkpoint folder you did not write"

_DCP = "torch.distributed.checkpoint.metadata"
# What DCP's .metadata pickles hold (torch 2.9.1 to 2.13 write the same names; dtypes are checked apart).
METADATA_GLOBALS = frozenset({
    (_DCP, "Metadata"), (_DCP, "StorageMeta"), (_DCP, "MetadataIndex"), (_DCP, "TensorStorageMetadata"),
    (_DCP, "BytesStorageMetadata"), (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"),
    (_DCP, "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format, an Enum
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # file, offset and length of one item
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # how torch pickles a torch.layout: a lookup by name
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),  # StorageMeta.checkpoint_id (Python 3.13 moved it)
})


class UnsafeCheckpoint(ValueError):
    """A checkpoint seqmesh refuses to read: it asks to run code, names files outside its folder, or
    cannot be parsed. A ValueError, so the job reports it as a user error on every rank."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only the classes in :data:`METADATA_GLOBALS` and torch's dtypes."""

    def __init__(self, file: io.BufferedIOBase, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS or module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return super().find_class(module, name)
        raise UnsafeCheckpoint(f"{self.path} asks to load {module}.{name}; seqmesh loads only DCP metadata from a "
                               f"checkpoint (nothing that can run code): {FIX}.")


def _plain_file_name(name: object) -> bool:
    """Whether ``name`` is one file name: joined to a folder, it stays inside it."""
    return (isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name
            and "/" not in name and "\\" not in name and "\0" not in name)


def _storage_problem(metadata: Metadata) -> str | None:
    """Why the storage entries of ``metadata`` cannot be followed safely, or None."""
    if not isinstance(metadata.storage_data, dict):
        return "has no storage table"
    for index, info in metadata.storage_data.items():
        where = getattr(index, "fqn", index)
        name = getattr(info, "relative_path", None)
        if not _plain_file_name(name):
            return f"names the file {name!r} for {where!r}, which is not a file inside the checkpoint folder"
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
            return f"gives {where!r} the byte range offset={offset!r}, length={length!r}"
        if getattr(info, "transform_descriptors", None):  # seqmesh never writes compressed or transformed items
            return f"asks to decode {where!r} with the stream transforms {info.transform_descriptors!r}"
    return None


def read_checked_metadata(folder: str, rank: int | None = None) -> Metadata:
    """The DCP metadata of the checkpoint ``folder`` (``__{rank}.metadata`` when ``rank`` is given),
    unpickled by :class:`MetadataUnpickler` and checked; raises :class:`UnsafeCheckpoint`."""
    path = os.path.join(os.fspath(folder), METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
    try:
        with open(path, "rb") as f:
            metadata = MetadataUnpickler(f, path).load()
    except UnsafeCheckpoint:
        raise
    except FileNotFoundError:
        raise UnsafeCheckpoint(f"{path} is missing, so {folder} is not a complete torch.distributed.checkpoint "
                               "folder; use a checkpoint that finished saving.") from None
    except Exception as err:  # any parse failure of an untrusted file: EOFError, UnpicklingError, TypeError...
        raise UnsafeCheckpoint(f"{path} cannot be read as DCP metadata ({type(err).__name__}: {err}): it is cut short "
                               "or damaged; use an older checkpoint of the run, or re-save it with seqmesh.") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP metadata: {FIX}.")
    problem = _storage_problem(metadata)
    if problem is not None:
        raise UnsafeCheckpoint(f"{path} {problem}: {FIX}.")
    return metadata


class CheckedReader(FileSystemReader):
    """``FileSystemReader`` whose metadata is ``metadata`` (already checked) or comes from
    :func:`read_checked_metadata`, and which reads non-tensor items only for a :class:`CheckedLoadPlanner`."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self.checked = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")  # DCP asks for rank-local metadata only when the global read failed
        if rank is None and self.checked is not None:
            metadata = self.checked
        else:
            metadata = read_checked_metadata(os.fspath(self.path), rank)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, CheckedLoadPlanner) and any(i.type == LoadItemType.BYTE_IO for i in plan.items):
            raise UnsafeCheckpoint(f"{self.path}: non-tensor items are read only with seqmesh's CheckedLoadPlanner "
                                   "(DCP's default one unpickles them with torch.load(weights_only=False)).")
        return super().read_data(plan, planner)


class CheckedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor item is decoded with ``torch.load(weights_only=True)``."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            item = torch.load(value, weights_only=True)
        except Exception as err:  # weights_only refuses any class outside torch's allow-list
            lines = str(err).splitlines() or [""]
            reason = next((line for line in lines if "GLOBAL" in line), lines[0])  # "...unsupported GLOBAL posix.system..."
            raise UnsafeCheckpoint(f"{self.folder}: the non-tensor item {read_item.dest_index.fqn!r} is not plain data "
                                   f"({type(err).__name__}: {reason}); seqmesh reads such items only with "
                                   f"torch.load(weights_only=True): {FIX}.") from None
        # the default planner places it (with its own torch.load); what it decodes now was built from vetted values
        plain = io.BytesIO()
        torch.save(item, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


def load_checked(state_dict: dict[str, Any], folder: str, *, fix: str, no_dist: bool = False,
                 metadata: Metadata | None = None) -> None:
    """``dcp.load(state_dict, checkpoint_id=folder, no_dist=no_dist)`` reading nothing that can run code;
    ``metadata``: the folder's, if already read by :func:`read_checked_metadata`. The metadata is read
    before DCP starts, so an :class:`UnsafeCheckpoint` reaches the caller as it is (DCP would log it and
    fail on missing rank-local metadata); any other failure is a ValueError naming ``folder``, the first
    failed rank's error, and ``fix``."""
    reader = CheckedReader(folder, metadata or read_checked_metadata(folder))
    try:
        dcp.load(state_dict, storage_reader=reader, planner=CheckedLoadPlanner(folder), no_dist=no_dist)
    except (CheckpointException, Exception) as err:  # CheckpointException, a BaseException, holds each rank's error
        failures = [f for f, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
        refused = next((f for f in failures if isinstance(f, UnsafeCheckpoint)), None)
        if refused is not None:
            raise UnsafeCheckpoint(str(refused)) from None
        first = failures[0] if failures else err
        raise ValueError(f"the checkpoint {folder} could not be read ({type(first).__name__}: {first}); {fix}") from err
