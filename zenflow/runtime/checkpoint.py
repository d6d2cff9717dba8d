"""Checkpoint files on disk: one file per rank, a commit marker, and ``latest``.

Layout of ``save_checkpoint(save_dir, tag)``::

    <save_dir>/<tag>/rank<r>.pt     everything rank r needs to resume (written by rank r)
    <save_dir>/<tag>/COMMITTED      JSON {"world_size": n, "sha256": [digest of rank r's file]};
                                    a tag without it is incomplete
    <save_dir>/latest               the name of the last committed tag

Every file is written to a temporary name, flushed to disk and renamed, so a crash leaves either
the old file or the new one, never half of one. A save goes in three phases:

1. each rank writes its state to ``rank<r>.pt.next``;
2. rank 0 writes the marker with every rank's digest: the commit point;
3. each rank renames ``rank<r>.pt.next`` to ``rank<r>.pt``; then rank 0 writes ``latest``.

A crash before the commit point leaves the tag as it was (absent, or its previous committed
state when it is being overwritten); after it, the new state. Loading takes the file whose
SHA-256 the marker records (``rank<r>.pt``, or ``.next`` after a crash in phase 3) and refuses
any other: torch.load alone does not notice a flipped byte inside tensor data. ``latest`` never
names a tag that was not committed.

Files are read with ``torch.load(weights_only=True)``: tensors and plain values only, so that a
checkpoint directory someone else wrote cannot run code when it is loaded. A ``client_state``
holding other objects loads only with ``trusted=True`` (``load_checkpoint``'s
``client_state_from_trusted_file``), which unpickles the file as it is.
"""

import hashlib
import json
import os
import pickle

import torch
import torch.distributed as dist

from zenflow.runtime.comm import run_collective

MARKER = "COMMITTED"
LATEST = "latest"
_NEXT = ".next"


def rank_file(save_dir: str | os.PathLike, tag: str, rank: int) -> str:
    return os.path.join(save_dir, tag, f"rank{rank}.pt")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        run_collective("barrier (checkpoint)", dist.get_world_size(), dist.barrier)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _gather_digests(digest: str, world_size: int) -> list[str]:
    """Every rank's digest on every rank (a barrier too: each rank's file is in place)."""
    if not _distributed():
        return [digest]
    digests = [None] * world_size
    run_collective("all_gather (checkpoint)", world_size, dist.all_gather_object, digests, digest)
    return digests


def write_atomically(path: str, write) -> None:
    temporary = f"{path}.tmp{os.getpid()}"
    with open(temporary, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    _replace(temporary, path)


def _replace(source: str, destination: str) -> None:
    os.replace(source, destination)
    # A rename reaches the disk with its directory: without this, a power loss could undo it.
    directory = os.open(os.path.dirname(destination) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def save(
    save_dir: str | os.PathLike,
    tag: str,
    state: dict,
    rank: int,
    world_size: int,
    save_latest: bool,
) -> str:
    """Write this rank's ``state`` under ``tag`` and commit the tag (collective: every rank
    calls it). Returns this rank's file."""
    if not tag or os.sep in tag or tag in (".", ".."):
        raise ValueError(f"checkpoint tag must be a plain directory name, got {tag!r}")
    directory = os.path.join(save_dir, tag)
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
    _barrier()
    path = rank_file(save_dir, tag, rank)
    if os.path.exists(path + _NEXT):  # left by a save that crashed: finish its phase 3
        committed = _matching_file(path, _recorded_digest(directory, rank))
        if committed is not None and committed != path:
            _replace(committed, path)
    write_atomically(path + _NEXT, lambda file: torch.save(state, file))
    digests = _gather_digests(_sha256(path + _NEXT), world_size)
    if rank == 0:
        marker_text = json.dumps({"world_size": world_size, "sha256": digests}).encode()
        write_atomically(os.path.join(directory, MARKER), lambda file: file.write(marker_text))
    _barrier()
    _replace(path + _NEXT, path)
    _barrier()
    if rank == 0:
        if save_latest:
            latest = os.path.join(save_dir, LATEST)
            write_atomically(latest, lambda file: file.write(tag.encode()))
    _barrier()
    return path


def resolve_tag(load_dir: str | os.PathLike, tag: str | None) -> str | None:
    """``tag``, or the one ``latest`` names; None when there is nothing to load."""
    if tag is not None:
        return tag if os.path.isdir(os.path.join(load_dir, tag)) else None
    latest = os.path.join(load_dir, LATEST)
    try:
        with open(latest, encoding="utf-8") as file:
            return file.read().strip()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as error:
        raise RuntimeError(
            f"{latest} is corrupted ({error}); pass the tag to load explicitly"
        ) from None


def _recorded_digest(directory: str, rank: int) -> str | None:
    """The digest the marker in ``directory`` records for ``rank``; None if it has none."""
    try:
        with open(os.path.join(directory, MARKER), encoding="utf-8") as file:
            return json.load(file)["sha256"][rank]
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def _matching_file(path: str, digest: str | None) -> str | None:
    """``path`` or ``path.next``, whichever has SHA-256 ``digest``; None if neither has."""
    for candidate in (path, path + _NEXT):
        if os.path.exists(candidate) and _sha256(candidate) == digest:
            return candidate
    return None


def saved_world_size(load_dir: str | os.PathLike, tag: str) -> int:
    """How many processes saved the committed ``tag``: as many rank files as it holds."""
    return _read_marker(load_dir, tag)[1]["world_size"]


def _read_marker(load_dir: str | os.PathLike, tag: str) -> tuple[str, dict]:
    directory = os.path.join(load_dir, tag)
    marker = os.path.join(directory, MARKER)
    try:
        with open(marker, encoding="utf-8") as file:
            committed = json.load(file)
        if not isinstance(committed["world_size"], int):
            raise TypeError(f"world_size {committed['world_size']!r} is not an int")
    except FileNotFoundError:
        raise RuntimeError(
            f"checkpoint tag {tag!r} ({directory}) is incomplete: it has no {MARKER} marker, "
            "so saving it did not finish on every rank; load another tag"
        ) from None
    except (ValueError, KeyError, TypeError) as error:  # not JSON, or not a marker's JSON
        raise RuntimeError(
            f"checkpoint marker {marker} is corrupted ({error!r}); load another tag"
        ) from error
    return marker, committed


def load(
    load_dir: str | os.PathLike, tag: str, rank: int, *, trusted: bool = False, mmap: bool = False
) -> tuple[str, dict]:
    """Rank ``rank``'s saved state under a committed ``tag``: (its path, the state). ``mmap``:
    tensors are read from the file as they are touched (copy-on-write), not all at once.
    ``trusted``: unpickle any object the file holds (else tensors and plain values only)."""
    marker, committed = _read_marker(load_dir, tag)
    path = rank_file(load_dir, tag, rank)
    try:
        digest = committed["sha256"][rank]
    except (KeyError, IndexError, TypeError) as error:
        raise RuntimeError(
            f"checkpoint marker {marker} is corrupted (no SHA-256 for rank {rank}: {error!r}); "
            "load another tag"
        ) from error
    found = _matching_file(path, digest)
    if found is None and not os.path.exists(path):
        raise RuntimeError(
            f"checkpoint file {path} is missing although tag {tag!r} is committed; the "
            "checkpoint directory was modified after saving"
        )
    if found is None:
        raise RuntimeError(
            f"checkpoint file {path} is truncated or corrupted: its SHA-256 differs from the one "
            f"recorded in {marker} when it was saved; load another tag"
        )
    path = found
    try:
        # Onto the CPU: the engine moves each piece to where its owner keeps it.
        state = torch.load(path, map_location="cpu", weights_only=not trusted, mmap=mmap)
    except pickle.UnpicklingError as error:
        if trusted or "weights_only" not in str(error):
            raise _corrupted(path, error) from error
        first_line = str(error).strip().splitlines()[0]
        raise RuntimeError(
            f"checkpoint file {path} holds objects other than tensors and plain values "
            f"({first_line}); zenflow reads checkpoints with torch.load(weights_only=True), so "
            "that a file someone else wrote cannot run code. A client_state of your own "
            "objects (or numpy's RNG state, as files written before that was stored as a "
            "tensor hold it) loads with load_checkpoint(..., "
            "client_state_from_trusted_file=True): only for files you trust"
        ) from error
    except (RuntimeError, EOFError, OSError, ValueError) as error:
        raise _corrupted(path, error) from error
    return path, state


def _corrupted(path: str, error: Exception) -> RuntimeError:
    return RuntimeError(
        f"checkpoint file {path} is truncated or corrupted and cannot be loaded ({error}); "
        "load another tag"
    )
