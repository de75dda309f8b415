"""`gym-server ingest`: the gRPC API of a state directory on PostgreSQL, served without a round manager.

Several ingest processes and one `gym-server serve` share the state directory and the database. Each answers
Register, GetRound, SubmitDelta, DownloadCheckpoint and the ledger queries on its own address, stages uploads
in a directory of its own and commits blob and row under the database's advisory write lock
(ServerState.write_session); serve's round manager reads the rows at its next poll (at least every second).
The round settings are serve's own, read from serve.json and read again whenever serve writes it, so every
address signs the same RoundInfo. What stays per process: docs/design/SCALE-OUT.md, "Ingest processes".
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from zoo_gym.server.config import ConfigError, ServerConfig
from zoo_gym.server.errors import Unavailable
from zoo_gym.server.metrics import ServerMetrics
from zoo_gym.server.rounds.policy import policy_for
from zoo_gym.server.store.state import ServerState, StateError, serve_settings, serve_settings_stamp
from zoo_gym.server.transport.first_message import PendingSlots
from zoo_gym.server.transport.servicer import GymServicer, listen

log = logging.getLogger("zoo_gym.server")


class ServeSettings:
    """serve's recorded settings merged with this process's own by `build(recorded) -> ServerConfig`
    (config.ingest_config), and their policy; read again when serve.json changes (a serve restarted)."""

    def __init__(self, root: Path, build: Callable[[dict], ServerConfig]) -> None:
        self.root, self._build = Path(root), build
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._current: tuple[ServerConfig, object] | None = None
        self._problem = ""
        self._load()
        if self._current is None:
            raise ConfigError(self._problem)

    def _load(self) -> None:
        try:
            got = serve_settings(self.root)
            if got is None:
                raise StateError(f"no gym-server serve has run on {self.root} yet: start it first (an ingest "
                                 f"process takes the round settings from the {self.root / 'serve.json'} it writes)")
            recorded, self._stamp = got
            config = self._build(recorded)
            self._current, self._problem = (config, policy_for(config)), ""
        except (ConfigError, StateError) as exc:
            self._current, self._problem = None, str(exc)

    def get(self) -> tuple[ServerConfig, object]:
        """(config, policy) as serve's serve.json says now; Unavailable (clients go to another address) while
        serve's new settings cannot be taken, the reason logged."""
        stamp = serve_settings_stamp(self.root)
        if stamp is not None and stamp != self._stamp:
            with self._lock:
                if stamp != self._stamp:
                    self._load()
                    self._stamp = stamp  # tried once per change of the file, not once per call
                    if self._current is None:
                        log.error("serve's settings changed and cannot be taken here: %s; refusing calls until "
                                  "this is fixed", self._problem)
                    else:
                        log.info("serve's settings changed (%s); following them", self.root / "serve.json")
        current = self._current
        if current is None:
            raise Unavailable(f"this ingest process cannot take the round settings of its gym-server serve "
                              f"({self._problem}); try another address")
        return current

    @property
    def config(self) -> ServerConfig:
        return self.get()[0]


class IngestServicer(GymServicer):
    """GymServicer with the settings followed from serve (ServeSettings), and no round manager to wake."""

    def __init__(self, state: ServerState, settings: ServeSettings, *, pending: PendingSlots) -> None:
        config, policy = settings.get()
        super().__init__(state, config, policy, pending=pending)
        self.followed = settings

    def settings(self):
        config, policy = self.followed.get()
        self.admission.mode = config.admission  # open or invite, as serve admits; the buckets are this process's
        return config, policy


def build_ingest_server(state: ServerState, settings: ServeSettings) -> tuple[grpc.Server, int, ServerMetrics]:
    """Create (not start) an ingest process's gRPC server on its host:port (`listen`: serve's slots, limits,
    interceptors and refusal of a taken port), its uploads staged in a directory of its own (BlobStore.own_tmp,
    which serve's start-up sweep leaves alone); returns (server, bound port, metrics)."""
    metrics = ServerMetrics(state)
    server, port = listen(settings.config, metrics, lambda pending: IngestServicer(state, settings, pending=pending))
    state.blobs = state.blobs.own_tmp()
    return server, port, metrics
