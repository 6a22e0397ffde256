"""The adapter-version policy: the rules over the versions the registry holds.

- Which version a new request runs under (`VersionPolicy.resolve`): the adapter it names, else
  the default policy, else the base model; the latest version unless it pins one; `min_version`
  and `max_staleness` refuse it with 409 when the version is not (or no longer) right.
- What happens to a request refused only because its version is not published yet
  (`HeldRequests`): with `adapters.staleness_policy = "hold"` it waits for up to
  `adapters.hold_timeout_s` and is tried again; with "reject" it gets the 409 at once.
- Where running sequences go on a Resume after Pause(keep) (`VersionPolicy.follow_latest`): every
  unpinned one moves to its adapter's latest version.
"""

from __future__ import annotations

import time
from typing import Callable, Generic, Iterable, Protocol, TypeVar

from parallm.config import AdaptersConfig

from .errors import AdapterError
from .registry import AdapterManager, LoadedAdapter

T = TypeVar("T")


class FollowsVersions(Protocol):
    """What follow_latest reads and moves of a running sequence (parallm.engine's Sequence)."""

    seq_id: int
    adapter: str  # its prefix-cache identity
    adapter_name: str
    adapter_version: int
    lora: LoadedAdapter | None
    pinned: bool

    @property
    def is_finished(self) -> bool: ...


class VersionPolicy:
    def __init__(self, registry: AdapterManager) -> None:
        self.registry = registry

    def resolve(self, name: str, version: int = 0, min_version: int = 0,
                max_staleness: int = -1) -> LoadedAdapter | None:
        """The adapter a new request runs under (None = the base model), or AdapterError 404/409.
        A request naming no adapter runs under the default policy when one is set."""
        name = name or self.registry.default_name
        if not name:
            if version or min_version:
                raise AdapterError("the base model has only version 0", status=409, code="version_unavailable")
            return None
        got = self.registry.versions.get(name)
        if not got:
            raise AdapterError(f"adapter {name!r} is not loaded", status=404, code="adapter_not_found")
        latest = got[-1]
        if min_version > latest.version:
            raise AdapterError(f"adapter {name!r} is at version {latest.version}, below the requested "
                               f"min_version {min_version}", status=409, code="version_unavailable")
        if not version:
            return latest
        for a in got:
            if a.version == version:
                if max_staleness >= 0 and latest.version - version > max_staleness:
                    raise AdapterError(f"adapter {name!r} version {version} is {latest.version - version} versions "
                                       f"behind the latest ({latest.version}); max_staleness is {max_staleness}",
                                       status=409, code="version_unavailable")
                if version < min_version:
                    raise AdapterError(f"pinned version {version} is below min_version {min_version}",
                                       status=409, code="version_unavailable")
                return a
        kept = ", ".join(str(a.version) for a in got)
        raise AdapterError(f"adapter {name!r} has no version {version} (kept: {kept})", status=404,
                           code="adapter_not_found")

    def follow_latest(self, seqs: Iterable[FollowsVersions]) -> int:
        """Move every running, unpinned adapter sequence to its adapter's latest version (what a
        Resume after Pause(keep) does); returns how many moved."""
        moved = 0
        for seq in seqs:
            if seq.is_finished or seq.pinned or not seq.adapter_name:
                continue
            latest = self.registry.latest(seq.adapter_name)
            if latest is None or latest is seq.lora:
                continue
            seq.lora, seq.adapter_version = latest, latest.version
            # its KV now mixes versions: an identity no other sequence's blocks can match
            seq.adapter = f"{latest.identity}+seq{seq.seq_id}"
            moved += 1
        return moved


class HeldRequests(Generic[T]):
    """Requests refused only because the version they need (`min_version`) is not published yet,
    kept for another try while `adapters.staleness_policy` is "hold", for up to
    `adapters.hold_timeout_s` from their first refusal."""

    def __init__(self, settings: AdaptersConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._held: dict[str, tuple[float, T]] = {}  # rid -> (first refused at, the request)

    def hold(self, rid: str, request: T, *, status: int, min_version: int, since: float | None = None) -> bool:
        """Keep a request refused with `status` for another try, if the policy holds it; False:
        refuse it now. `since`: when it was first refused (None: now)."""
        if self.settings.staleness_policy != "hold" or status != 409 or min_version <= 0:
            return False
        now = self.clock()
        since = now if since is None else since
        if now - since >= self.settings.hold_timeout_s:
            return False
        self._held[rid] = (since, request)
        return True

    def take(self) -> list[tuple[float, T]]:
        """Everything held, (first refused at, request), to be tried again (and held again or refused)."""
        held, self._held = self._held, {}
        return list(held.values())

    def pop(self, rid: str) -> T | None:
        got = self._held.pop(rid, None)
        return None if got is None else got[1]

    def rids(self) -> list[str]:
        return list(self._held)

    def __len__(self) -> int:
        return len(self._held)
