"""/health from ingress's view of the engine (issue 22, issue 21): 200 while the server serves, busy or
not; 503 when the engine is paused or stalled (answers no stats poll), a stage is down or it drains."""

from __future__ import annotations

import asyncio
import time

from starlette.testclient import TestClient

from parallm import protocol
from parallm.api.app import build_app
from parallm.config import ServerConfig
from parallm.stages import ingress
from test_ingress_backend import backend_for, far, run  # noqa: F401  (far: the fixture)
from tests._far_side import answer


def test_paused_and_stalled_engines_are_503_and_overload_is_200(tmp_path, far, monkeypatch):
    monkeypatch.setattr(ingress, "ENGINE_STALLED_AFTER_S", 0.6)
    monkeypatch.setattr(ingress, "STATS_TIMEOUT_S", 1.0)
    engine = {"paused": False, "frozen": False}

    def script(stage, message):
        if stage == "engine" and isinstance(message, protocol.GetStats):
            if engine["frozen"]:
                return []
            return [protocol.StatsReply(qid=message.qid, stats=protocol.EngineStats(paused=engine["paused"]))]
        return answer(stage, message)

    far.script = script
    backend = backend_for(tmp_path)
    seen = []

    async def main():
        await backend.start()
        try:
            async def settle(want: str) -> None:
                deadline = time.monotonic() + 5
                while backend.health()["status"] != want and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                seen.append(backend.health()["status"])

            await settle("ok")
            engine["paused"] = True
            await settle("paused")
            engine["paused"] = False
            await settle("ok")
            engine["frozen"] = True
            await settle("stalled")
            engine["frozen"] = False
            await settle("ok")
        finally:
            await backend.stop()

    run(main())
    assert seen == ["ok", "paused", "ok", "stalled", "ok"]
    app = TestClient(build_app(_Fixed("paused"), ServerConfig()))
    assert app.get("/health").status_code == 503 and app.get("/readyz").status_code == 503


class _Fixed:
    """Only what the health routes ask of a backend."""

    def __init__(self, status: str) -> None:
        self.status = status

    def health(self):
        return {"status": self.status, "ready": self.status == "ok"}

    def __getattr__(self, name):
        raise AttributeError(name)
