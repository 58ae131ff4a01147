"""A checkpoint's manifest: `manifest.json`, written last at commit, names every part of the
checkpoint with its step and digest, and every entry's CRC32:

  {"format": 1, "step": k,
   "parts": {"run.json": {"step": k, "sha256": ...}, "model/.metadata": {"step": k, "sha256": ...},
             "model/__0_0.distcp": {"step": k, "bytes": n}, ..., "optimizer/...": ...},
   "entries": {"model": {entry_key: crc32, ...}, "optimizer": {...}},
   "self_checked": {"model": [], "optimizer": [entry_key, ...]}}  # subgroups: the CRC32 of their chunks' CRC32s

The small parts (run.json, each .metadata) carry a sha256; a data file carries its size, and each
entry in it the CRC32 the planners check as they read it back (entry_digests.py). A .metadata names
its save (DCP's save id, the files, their offsets), so a part copied from another step or run differs
from the manifest. The commit refuses to finish when a part is missing or short; a resume refuses a
checkpoint whose parts disagree with its manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from ..dcp_reader import CheckpointFileError, read_dcp_metadata
from ..entry_digests import entry_key
from .files import FileOps

MANIFEST = "manifest.json"
PARTS = ("model", "optimizer")
_FORMAT = 1


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NOFOLLOW)) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _data_files(directory: str, part: str) -> tuple[dict[str, int], set[str]]:
    """The data files a part's .metadata names, each with the end of its last entry, and its entries."""
    metadata = read_dcp_metadata(os.path.join(directory, part, ".metadata"))
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    return ends, {entry_key(index) for index in metadata.storage_data}


def write_manifest(directory: str, step: int, run_file: str, entries: dict[str, dict[str, int]], self_checked: dict[str, list[str]],
                   ops: FileOps) -> None:  # fmt: skip
    """Checks that every part of the checkpoint being committed in `directory` is there, whole and
    digested, then writes its manifest. Raises CheckpointFileError naming the first part that is not."""
    parts: dict[str, dict[str, Any]] = {}
    for name in [run_file] + [f"{part}/.metadata" for part in PARTS]:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise CheckpointFileError(path, "missing: the checkpoint is not committed")
        parts[name] = {"step": step, "sha256": _sha256(path)}
    for part in PARTS:
        ends, keys = _data_files(directory, part)
        for name, end in sorted(ends.items()):
            path = os.path.join(directory, part, name)
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size is None or size < end:
                what = "missing" if size is None else f"{size} bytes, its entries end at {end}"
                raise CheckpointFileError(path, f"{what}: the checkpoint is not committed")
            parts[f"{part}/{name}"] = {"step": step, "bytes": size}
        undigested = sorted(keys - set(entries.get(part, {})))
        if undigested:
            raise CheckpointFileError(os.path.join(directory, part), f"{len(undigested)} entries have no digest, e.g. {undigested[:3]}")
    manifest = {"format": _FORMAT, "step": step, "parts": parts, "entries": entries, "self_checked": self_checked}
    ops.write_file(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1, sort_keys=True).encode())


def check_manifest(directory: str, step: int) -> tuple[dict[str, dict[str, int]], dict[str, set[str]]]:
    """Checks the checkpoint in `directory` (of `step`, as its run.json says) against its manifest;
    returns the entries' digests and the self-checked entries, per part. Raises CheckpointFileError
    naming the part that disagrees."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        raise CheckpointFileError(path, "missing: the checkpoint was not committed by this version of fsdp-offload (or was copied in part)")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
        if manifest.get("format") != _FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, {_FORMAT} expected")
        parts, saved_step = _mapping(manifest, "parts"), int(manifest["step"])
        entries = _mapping(manifest, "entries")
        digests = {part: {str(k): int(v) for k, v in _mapping(entries, part, {}).items()} for part in PARTS}
        self_checked = {part: set(manifest["self_checked"][part]) for part in PARTS}
        outside = [name for name in parts if os.path.isabs(name) or os.path.normpath(name).startswith("..")]
        if outside:
            raise ValueError(f"part {outside[0]!r} lies outside the checkpoint")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointFileError(path, f"cannot be read ({type(exc).__name__}: {exc})") from None
    if saved_step != step:
        raise CheckpointFileError(path, f"is of step {saved_step}, its run.json of step {step}: the parts come from different checkpoints")
    for name, want in sorted(parts.items()):
        where = os.path.join(directory, name)
        if not isinstance(want, dict) or want.get("step") != step:
            raise CheckpointFileError(where, f"is listed in the manifest for another step ({want!r})")
        if not os.path.isfile(where) or os.path.islink(where):
            raise CheckpointFileError(where, "missing (or not a regular file)")
        if "sha256" in want and _sha256(where) != want["sha256"]:
            raise CheckpointFileError(where, "differs from the one the manifest names (a part of another step or run, or damaged)")
        if "bytes" in want and os.path.getsize(where) != want["bytes"]:
            raise CheckpointFileError(where, f"holds {os.path.getsize(where)} bytes, the manifest says {want['bytes']} (cut short or replaced)")
    for part in PARTS:
        ends, _ = _data_files(directory, part)
        unlisted = sorted(f"{part}/{name}" for name in ends if f"{part}/{name}" not in parts)
        if unlisted:
            raise CheckpointFileError(os.path.join(directory, unlisted[0]), "is not in the manifest")
    return digests, self_checked


def _mapping(within: dict, key: str, default: dict | None = None) -> dict:
    """`within[key]`, which must be a JSON object (KeyError where missing and no `default`)."""
    value = within[key] if default is None else within.get(key, default)
    if not isinstance(value, dict):
        raise TypeError(f"{key!r} is a {type(value).__name__}, an object expected")
    return value
