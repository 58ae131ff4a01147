"""The bandwidth profile: a JSON file of what this host's parts were measured or learned to do, kept
between runs. Per host: each tier's read and write bandwidth and latency (calibrate.measure_tier's, and
what the placement learned since), and the CPU update's rate as the step ran it (learned_rate.py), so
the next run and the planner start from them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import platform
import tempfile
import time
from typing import Any, Callable, Iterable, Iterator, Optional

from .bandwidth import TierSpeed
from .config import NULL
from .node import first_on_node
from .storage import TierSpec
from .storage.base import TierError
from .storage.spec import as_spec

log = logging.getLogger(__name__)

DEFAULT_PROFILE = "~/.cache/fsdp-offload/bandwidth.json"
PROFILE_FORMAT = "fsdp-offload-bandwidth-profile/1"
UPDATE_RATES = "update_rates"  # the section of learned CPU update rates (beside "hosts", the tiers')


# -- what an entry must hold --------------------------------------------------------------------------
# The profile is a file people edit by hand: every entry is checked before use, by one function
# (`entry_problem`), and one that fails is said once (`BandwidthProfile.usable`) and treated as absent.

Check = Callable[[Any], Optional[str]]  # what is wrong with a field's value ("is -3: it must be ..."), None: nothing


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _gbps(value: object) -> str | None:
    return None if _finite(value) and value > 0 else f"is {value!r}: it must be a number of GB/s > 0"


def _ms(value: object) -> str | None:
    return None if _finite(value) and value >= 0 else f"is {value!r}: it must be a number of milliseconds >= 0"


def _text(value: object) -> str | None:
    return None if isinstance(value, str) and value else f"is {value!r}: it must be a non-empty string"


def _mparams_per_s(value: object) -> str | None:
    return None if _finite(value) and value > 0 else f"is {value!r}: it must be a number of M params/s > 0"


def _by_rank(each: Check, what: str) -> Check:
    """The check of a map from each local rank to a value that `each` checks (`what`: the values, with an example)."""

    def check(value: object) -> str | None:
        if not isinstance(value, dict):
            return f"is {value!r}: it must map each local rank to {what}"
        for rank, one in value.items():
            if not (isinstance(rank, str) and rank.isdigit()):
                return f"has the key {rank!r}: its keys must be local ranks (0, 1, ...)"
            if each(one) is not None:
                return f"[{rank!r}] {each(one)}"
        return None

    return check


_rank_rates = _by_rank(_mparams_per_s, 'its M params/s, e.g. {"0": 250.0}')
_rank_ms = _by_rank(_ms, 'milliseconds, e.g. {"0": 1.5}')


# The fields each kind of entry is read for (others, such as a tier's "source", are only kept).
TIER_FIELDS: dict[str, Check] = {"read_gbps": _gbps, "write_gbps": _gbps, "latency_ms": _ms}
RATE_FIELDS: dict[str, Check] = {"run": _text, "mparams_per_s": _rank_rates, "updated": _text}
# What a rate's run saved beside it where its update streamed nothing: a subgroup's walk beside the kernel
# (update_costs.UpdateCosts.subgroup_s; an entry of an older run has none)
WALK_FIELDS: dict[str, Check] = {"subgroup_ms": _rank_ms}


def entry_problem(entry: object, fields: dict[str, Check]) -> str | None:
    """What makes a profile entry unusable, naming the first field that is missing or wrong; None if usable."""
    if not isinstance(entry, dict):
        return f"it is {entry!r}, not an object with the fields {', '.join(fields)}"
    for name, check in fields.items():
        if name not in entry:
            return f"field {name!r} is missing"
        problem = check(entry[name])
        if problem is not None:
            return f"field {name!r} {problem}"
    return None


_said: set[tuple[str, ...]] = set()  # problems warned of by this process: each once, however often the file is read


def tier_profile_key(spec: TierSpec | str) -> str:
    """A tier spec with its path resolved and its options sorted: one key per distinct tier (TierSpec.key)."""
    return as_spec(spec).key


def profile_problem(path: str | None) -> str | None:
    """What keeps `path` (offload.bandwidth_profile) from holding a profile, or None (None: no profile).
    Makes its dir and lock file, as the first use would."""
    if path is None:
        return None
    try:
        BandwidthProfile(path).close()
    except TierError as exc:
        return str(exc)
    return None


@contextlib.contextmanager
def locked_profile(path: str) -> Iterator[BandwidthProfile]:
    """The profile at `path`, its lock held inside the block and its lock file closed after."""
    profile = BandwidthProfile(path)
    try:
        with profile.locked():
            yield profile
    finally:
        profile.close()


class BandwidthProfile:
    """`{"format": ..., "hosts": {host: {tier key: {read_gbps, write_gbps, latency_ms, source, updated}}},
    "update_rates": {host: {rate key: {"run": id, "mparams_per_s": {local rank: M params/s}, updated,
    and where the run streamed nothing "subgroup_ms": {local rank: ms}}}}}`.

    Read and rewritten under an flock on `<path>.lock`, and replaced atomically, so the ranks of a node
    (and nodes sharing a home dir) can use one file.
    """

    def __init__(self, path: str, host: str | None = None) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.host = host or platform.node() or "unknown-host"
        folder = os.path.dirname(self.path)
        if os.path.isdir(self.path):
            raise TierError(
                f"offload.bandwidth_profile={path!r} is a directory: give the path of a JSON file, e.g. "
                f"{os.path.join(path, 'bandwidth.json')}"
            )
        making = folder
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            making = self.path + ".lock"  # (beside the file: its lock)
            self._lock_fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise TierError(
                f"offload.bandwidth_profile={path!r}: cannot create {making}: {exc.strerror}; point it to a writable "
                f"file or set it to {NULL} (measure every run, keep nothing)"
            ) from exc

    @contextlib.contextmanager
    def locked(self, wait: bool = True) -> Iterator[bool]:
        """Holds the profile's lock inside the block; with wait=False, yields False if it is busy."""
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def _read_all(self) -> dict:
        """The whole file (call with the lock held). A corrupt file is moved aside with a warning."""
        try:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                raise TierError(
                    f"offload.bandwidth_profile={self.path!r} is a symbolic link, which is never followed: "
                    "point it to the file itself"
                ) from exc
            with os.fdopen(fd) as f:
                data = json.load(f)
            hosts = data.get("hosts") if isinstance(data, dict) else None
            well_formed = isinstance(hosts, dict) and all(isinstance(h, dict) for h in hosts.values())
            if not well_formed or data.get("format") != PROFILE_FORMAT:
                raise ValueError(f"not a {PROFILE_FORMAT} file")
            return data
        except FileNotFoundError:
            return {"format": PROFILE_FORMAT, "hosts": {}}
        except (ValueError, UnicodeDecodeError) as exc:
            aside = f"{self.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(self.path, aside)
            log.warning("bandwidth profile %s is unreadable (%s): moved it to %s; its tiers' speeds will be measured, and its CPU "
                        "rates learned, again", self.path, exc, aside)  # fmt: skip
            return {"format": PROFILE_FORMAT, "hosts": {}}

    def load(self, keys: Iterable[str] | None = None) -> dict[str, TierSpeed]:
        """This host's valid entries for the tier `keys` (None: all; call with the lock held); invalid
        ones are reported and left out. Only those asked for are checked: the warning says the run
        measures that tier, which holds for a tier of this run alone."""
        data = self._read_all()
        mine = data["hosts"].get(self.host)
        if mine is None:
            if data["hosts"]:
                log.info("bandwidth profile %s has no entry for host %s (it has %s)", self.path, self.host, sorted(data["hosts"]))
            return {}
        out = {}
        for key in mine if keys is None else [k for k in keys if k in mine]:
            entry = mine[key]
            if self.usable(["hosts", self.host, key], entry, TIER_FIELDS, "measures that tier again"):
                out[key] = TierSpeed(entry["read_gbps"] * 1e9, entry["write_gbps"] * 1e9, entry["latency_ms"] / 1e3)
        return out

    def usable(self, where: list[str], entry: object, fields: dict[str, Check], instead: str) -> bool:
        """Whether the entry at `where` (its keys from the file's top) holds `fields` as they must be; if
        not, says so (`unusable`) and what is done `instead`."""
        problem = entry_problem(entry, fields)
        if problem is not None:
            self.unusable(where, problem, instead)
        return problem is None

    def unusable(self, where: list[str], problem: str, instead: str) -> None:
        """A warning naming the file, the entry at `where`, its `problem` and the fix: once a process, and
        from the node's first rank only (each of a node's ranks reads the same entries)."""
        said = (self.path, *where, problem)
        if said not in _said and first_on_node():
            _said.add(said)
            log.warning("bandwidth profile %s: the entry %s is not usable: %s; this run ignores it and %s. Delete that "
                        "entry or fix its value in the file", self.path, "".join(f"[{k!r}]" for k in where), problem,
                        instead)  # fmt: skip

    def store(self, speeds: dict[str, TierSpeed], source: str) -> None:
        """Merges `speeds` (tier key -> speed) into this host's entries (call with the lock held)."""
        data = self._read_all()
        mine = data["hosts"].setdefault(self.host, {})
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
        for key, s in speeds.items():
            mine[key] = {
                "read_gbps": s.read_bps / 1e9, "write_gbps": s.write_bps / 1e9, "latency_ms": s.latency_s * 1e3,
                "source": source, "updated": stamp,
            }  # fmt: skip
        self._write(data)

    def update_rate_entry(self, key: str) -> tuple[str | None, dict[str, float], str | None]:
        """This host's learned CPU update rates under `key` (learned_rate.update_rate_key): the run that saved
        them, params/s by the local rank that measured it, and when (call with the lock held). An entry
        that is not as RATE_FIELDS say (a hand edit) is warned of and counts as none."""
        entry = self._rate_entry(key)
        if entry is None:
            return None, {}, None
        return entry["run"], {r: v * 1e6 for r, v in entry["mparams_per_s"].items()}, entry["updated"]

    def update_rate_walks(self, key: str) -> dict[str, float]:
        """The walk a subgroup beside the kernel that the run of `key`'s rates saved beside them, in seconds
        by local rank; {} where it saved none (it streamed, or an older run), or where it is not as
        WALK_FIELDS say (warned of: the planner times it)."""
        entry = self._rate_entry(key)
        if entry is None or "subgroup_ms" not in entry:
            return {}
        if not self.usable([UPDATE_RATES, self.host, key], entry, WALK_FIELDS, "times the update's walk instead"):
            return {}
        return {r: ms / 1e3 for r, ms in entry["subgroup_ms"].items()}

    def _rate_entry(self, key: str) -> dict | None:
        """`key`'s entry of this host's update rates if there is one as RATE_FIELDS say, else None (a broken
        one warned of)."""
        entry: object = self._read_all()
        where: list[str] = []
        instead = "times the CPU update instead (a run's own steps here save a new rate)"
        for part in (UPDATE_RATES, self.host, key):
            if not isinstance(entry, dict):  # a section that is not an object hides every entry under it
                self.unusable(where, f"it is {entry!r}, not an object", instead)
                return None
            entry, where = entry.get(part), [*where, part]
            if entry is None:  # none saved: nothing to say
                return None
        return entry if self.usable(where, entry, RATE_FIELDS, instead) else None

    def update_rate_keys(self) -> list[str]:
        """The keys this host has learned CPU update rates under (call with the lock held)."""
        mine = self._read_all().get(UPDATE_RATES)
        mine = mine.get(self.host) if isinstance(mine, dict) else None
        return sorted(mine) if isinstance(mine, dict) else []

    def store_update_rate(self, key: str, run: str, local_rank: int, params_per_s: float,
                          walk_s: float | None = None) -> None:  # fmt: skip
        """Stores one local rank's learned CPU update rate under `key` for `run` (call with the lock held),
        and its walk a subgroup beside it (update_rate_walks; None: none, and any this rank saved before goes):
        the first rank of a new run to save clears the last run's ranks, so one entry is one run's."""
        data = self._read_all()
        section = data[UPDATE_RATES] = data.get(UPDATE_RATES) if isinstance(data.get(UPDATE_RATES), dict) else {}
        mine = section[self.host] = section.get(self.host) if isinstance(section.get(self.host), dict) else {}
        entry = mine.get(key)
        if entry_problem(entry, RATE_FIELDS) is not None or entry["run"] != run:  # (a broken entry is replaced whole)
            entry = {"run": run, "mparams_per_s": {}}
        entry["mparams_per_s"][str(local_rank)] = params_per_s / 1e6
        walks = entry.pop("subgroup_ms", None)  # the other ranks' (a broken map made afresh), this rank's anew
        walks = {r: ms for r, ms in walks.items() if r != str(local_rank)} if _rank_ms(walks) is None else {}
        if walk_s is not None:
            walks[str(local_rank)] = walk_s * 1e3
        if walks:
            entry["subgroup_ms"] = walks
        entry["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        mine[key] = entry
        self._write(data)

    def _write(self, data: dict) -> None:
        """Replaces the file with `data` at once (call with the lock held)."""
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), prefix=".bandwidth-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def save_learned(self, speeds: dict[str, TierSpeed]) -> None:
        """Stores learned speeds if the file is free right now; never raises (training goes on)."""
        try:
            with self.locked(wait=False) as got:
                if got:
                    self.store(speeds, "learned")
                else:
                    log.debug("bandwidth profile %s is busy; learned speeds saved later", self.path)
        except OSError as exc:
            log.warning("cannot save learned bandwidths to %s: %s (training goes on)", self.path, exc)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def write_profile(path: str, speeds: dict[str, TierSpeed]) -> str:
    """Stores `speeds` (tier spec -> speed) as calibrated in the profile at `path` (what a benchmark or
    a test starts a run from); returns `path`."""
    with locked_profile(path) as profile:
        profile.store({tier_profile_key(spec): s for spec, s in speeds.items()}, "calibrated")
    return path
