"""``RUN_DIR/control/manager.json``: which process manages a run, and where its
telemetry goes.

`adaptipe train` marks itself there while it runs, so ``adaptipe stop`` can tell its
request will be heard. ``adaptipe manage`` (the manager of workers that torchrun
started, on other hosts) also writes where its collector listens and the CURVE keys
the workers publish with: workers without the manager's environment find it here. The
file holds a secret key, so it is written readable by its owner only.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

from adaptipe.errors import PlanError
from adaptipe.runtime.rundir import RunDir
from adaptipe.serial import read_json

__all__ = ["ManagerInfo", "clear_manager", "read_manager", "write_manager"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ManagerInfo:
    """The managing process (``pid`` on ``host``) and, for workers started elsewhere,
    its telemetry ``address`` and the keys they publish with (Z85 text; the client's
    secret is the workers')."""

    pid: int
    host: str
    telemetry: str | None = None
    server_public: str | None = None
    client_public: str | None = None
    client_secret: str | None = None

    @classmethod
    def here(cls, **telemetry: Any) -> ManagerInfo:
        """This process on this host."""
        return cls(pid=os.getpid(), host=socket.gethostname(), **telemetry)

    def curve(self) -> Any:
        """The workers' CURVE keys (`adaptipe.monitor.publisher.CurveKeys`), or None."""
        if self.server_public is None or self.client_public is None or self.client_secret is None:
            return None
        from adaptipe.monitor.publisher import CurveKeys

        return CurveKeys(
            self.server_public.encode(),
            None,
            self.client_public.encode(),
            self.client_secret.encode(),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pid": self.pid, "host": self.host}
        for key in ("telemetry", "server_public", "client_public", "client_secret"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: Any, *, source: str) -> ManagerInfo:
        try:
            return cls(
                pid=int(data["pid"]),
                host=str(data["host"]),
                **{
                    key: None if data.get(key) is None else str(data[key])
                    for key in ("telemetry", "server_public", "client_public", "client_secret")
                },
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"{source}: not a manager record ({exc})") from None


def _path(run: RunDir) -> Any:
    return run.root / "control" / "manager.json"


def write_manager(run: RunDir, info: ManagerInfo) -> None:
    """Mark ``info`` as the run's manager (atomically, readable by the owner only)."""
    import json

    path = _path(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(info.to_json(), fh)
        fh.write("\n")
    os.replace(tmp, path)


def read_manager(run: RunDir) -> ManagerInfo | None:
    """The run's marked manager (None: none marked, or an unreadable record)."""
    path = _path(run)
    try:
        return ManagerInfo.from_json(read_json(path), source=str(path))
    except (OSError, PlanError):
        return None


def clear_manager(run: RunDir) -> None:
    """Unmark the run's manager (it ended)."""
    _path(run).unlink(missing_ok=True)
