"""Checkpoints from mirrors (issue 50 item 3): the server signs its `--mirror` URLs into RoundInfo; the client
downloads from a mirror with resumable range requests, verifies the signed sha256 and falls back to the server
when a mirror is down, slow or serves other bytes.

Each mirror is a real HTTP server on 127.0.0.1 (http.server in a thread, with Range support and a log of the
requests it got); each federation a real in-process gym-server whose DownloadCheckpoint calls are counted.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.client.cli import app
from zoo_gym.client.download import DownloadError, fetch, fetch_checkpoint
from zoo_gym.client.mirrors import MirrorPolicy
from zoo_gym.client.server_signatures import verify_round_info
from zoo_gym.client.upload import build_header, register_request, request_stream
from zoo_gym.proto import archive, gym_pb2, gym_pb2_grpc, signing
from zoo_gym.server.config import ConfigError, build_config
from zoo_gym.server.genesis import init_state
from zoo_gym.server.transport import handlers
from zoo_gym.server.transport.servicer import build_server

QUICK = MirrorPolicy(timeout=5.0, min_bytes_per_s=1024, window_s=5.0)


class Mirror:
    """A real HTTP server serving the files of `root` at <url>/<name>, honouring `Range: bytes=N-`.

    mode: "good"; "other" (zeros of the right length); "drop" (the first answer stops half-way, later range
    requests are served); "slow" (1 KiB every 50 ms); "drop norange" (as drop, but ranges are ignored)."""

    def __init__(self, root: Path, mode: str = "good") -> None:
        self.root, self.mode, self.requests = Path(root), mode, []
        self.root.mkdir(parents=True, exist_ok=True)
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/zoo"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def _handler(self):
        mirror = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                rng = self.headers.get("Range")
                mirror.requests.append((self.path, rng))
                path = mirror.root / self.path.rsplit("/", 1)[-1]
                if not self.path.startswith("/zoo/") or not path.is_file():
                    self.send_error(404)
                    return
                data = path.read_bytes()
                if mirror.mode == "other":
                    data = bytes(len(data))
                if "norange" in mirror.mode:
                    rng = None  # as python -m http.server: the whole file, 200
                start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                body = data[start:]
                try:
                    if "drop" in mirror.mode and len(mirror.requests) == 1:
                        self.wfile.write(body[:len(body) // 2])  # then the connection closes
                    elif mirror.mode == "slow":
                        for i in range(0, len(body), 1024):
                            self.wfile.write(body[i:i + 1024])
                            time.sleep(0.05)
                    else:
                        self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        return Handler

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _down_url() -> str:
    """A URL nothing listens on: a port the system handed out and took back."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/zoo"


class Fed:
    def __init__(self, state_dir: Path, mirrors: list[str]) -> None:
        self.state = init_state(state_dir, base_model="tiny")
        config = build_config({}, port=0, insecure=True, min_contributors=2, aggregator="mean", round_timeout=600,
                              max_payload_bytes=4 << 20, mirrors=mirrors)
        self.server, port, self.rounds = build_server(self.state, config)
        self.server.start()
        self.rounds.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = gym_pb2_grpc.GymStub(self.channel)

    def round(self) -> gym_pb2.RoundInfo:
        return self.stub.GetRound(gym_pb2.GetRoundRequest())

    def stop(self) -> None:
        self.channel.close()
        self.server.stop(grace=None)
        self.rounds.stop()
        self.state.engine.dispose()


@pytest.fixture
def server_downloads(monkeypatch):
    """The offsets of every DownloadCheckpoint the in-process servers answered."""
    offsets: list[int] = []
    real = handlers.download

    def counted(**kw):
        offsets.append(kw["offset"])
        return real(**kw)

    monkeypatch.setattr(handlers, "download", counted)
    return offsets


@pytest.fixture
def started(tmp_path):
    """`started(mirrors)`: a federation whose RoundInfo names `mirrors` (stopped after the test)."""
    feds: list[Fed] = []

    def start(mirrors: list[str]) -> Fed:
        feds.append(Fed(tmp_path / f"state{len(feds)}", mirrors))
        return feds[-1]

    yield start
    for fed in feds:
        fed.stop()


def _mirror(tmp_path: Path, mode: str = "good", name: str = "m") -> Mirror:
    return Mirror(tmp_path / name, mode)


def _fill(mirror: Mirror, fed: Fed) -> str:
    """Put `fed`'s current base (the genesis) on `mirror`; its sha256."""
    sha = fed.round().base_sha256
    shutil.copyfile(fed.state.blobs.path(sha), mirror.root / sha)
    return sha


def _get(fed: Fed, workdir: Path, said: list[str], policy: MirrorPolicy = QUICK):
    info = fed.round()
    verify_round_info(info, server_key=fed.state.public_key, address=fed.address)
    return info, fetch(fed.stub, info.base_sha256, info.base_size, workdir, progress=False, round_info=info,
                       server_key=fed.state.public_key, say=said.append, mirror_policy=policy)


def test_a_mirror_serving_the_checkpoint_is_used_and_the_server_is_not(started, tmp_path, server_downloads):
    mirror = _mirror(tmp_path)
    fed = started([mirror.url + "/"])  # stored without the trailing slash
    sha = _fill(mirror, fed)
    said: list[str] = []
    info, got = _get(fed, tmp_path / "w", said)
    assert list(info.mirrors) == [mirror.url]
    assert got.source == mirror.url and (got.model_dir / archive.WEIGHTS).is_file()
    assert server_downloads == []  # DownloadCheckpoint never asked
    assert mirror.requests == [(f"/zoo/{sha}", None)]
    assert archive.packed_sha256(got.model_dir) == sha
    assert any(f"downloaded from mirror {mirror.url}" in line for line in said)
    assert not list((tmp_path / "w" / "downloads").iterdir())  # the partial file was unpacked and removed
    assert fetch(fed.stub, sha, info.base_size, tmp_path / "w", progress=False, round_info=info).source == "cache"
    mirror.stop()


def test_a_mirror_that_is_down_or_lacks_the_checkpoint_falls_back_to_the_server(started, tmp_path,
                                                                                 server_downloads):
    empty = _mirror(tmp_path, name="empty")  # up, but never synced: 404
    down = _down_url()
    fed = started([down, empty.url])
    said: list[str] = []
    info, got = _get(fed, tmp_path / "w", said)
    assert got.source == "server" and server_downloads == [0]
    assert archive.packed_sha256(got.model_dir) == info.base_sha256
    refused, missing = [line for line in said if line.startswith("mirror ")]
    assert refused.startswith(f"mirror {down}: unreachable (") and "refused" in refused, refused
    assert refused.endswith("; trying the next mirror")
    assert missing == f"mirror {empty.url}: HTTP 404 Not Found; trying the server"
    empty.stop()


def test_a_mirror_serving_other_bytes_is_refused_and_nothing_it_sent_is_loaded(started, tmp_path,
                                                                               server_downloads):
    evil, good = _mirror(tmp_path, mode="other", name="evil"), _mirror(tmp_path, name="good")
    fed = started([evil.url])
    sha = _fill(evil, fed)
    said: list[str] = []
    info, got = _get(fed, tmp_path / "w", said)
    assert got.source == "server" and server_downloads == [0]  # afresh: none of the mirror's bytes kept
    assert archive.packed_sha256(got.model_dir) == sha
    assert f"mirror {evil.url}: served other bytes (not the signed sha256 {sha[:12]}); discarded them, trying " \
           "the server" in said
    # with a good mirror after it, the good one serves: the server is still not asked
    fed2 = started([evil.url, good.url])
    _fill(good, fed2), _fill(evil, fed2)
    info2, got2 = _get(fed2, tmp_path / "w2", said)
    assert got2.source == good.url and server_downloads == [0]
    assert archive.packed_sha256(got2.model_dir) == info2.base_sha256
    evil.stop(), good.stop()


def test_other_bytes_from_a_mirror_never_reach_the_checkpoint_directory(tmp_path):
    """Without the server to fall back on (its download fails), the corrupt mirror's bytes are still refused."""
    evil = _mirror(tmp_path, mode="other")
    (evil.root / ("ab" * 32)).write_bytes(b"x" * 1000)

    class NoServer:
        def DownloadCheckpoint(self, request):
            raise DownloadError("the server is unreachable too")

    with pytest.raises(DownloadError, match="unreachable too"):
        fetch_checkpoint(NoServer(), "ab" * 32, 1000, tmp_path / "w", progress=False, mirrors=[evil.url],
                         mirror_policy=QUICK)
    assert not (tmp_path / "w" / "checkpoints").exists()
    partial = tmp_path / "w" / "downloads" / f"{'ab' * 32}.partial"
    assert not partial.exists() or partial.stat().st_size == 0
    evil.stop()


def test_a_mirror_that_stops_half_way_is_resumed_with_a_range_request(started, tmp_path, server_downloads):
    mirror = _mirror(tmp_path, mode="drop")
    fed = started([mirror.url])
    sha = _fill(mirror, fed)
    info, got = _get(fed, tmp_path / "w", [])
    assert got.source == mirror.url and server_downloads == []
    (first, no_range), (again, rng) = mirror.requests
    assert first == again == f"/zoo/{sha}" and no_range is None
    assert rng == f"bytes={info.base_size // 2}-"  # from where the first answer stopped
    assert archive.packed_sha256(got.model_dir) == sha
    mirror.stop()


def test_a_mirror_that_ignores_ranges_is_resumed_by_skipping_what_the_client_has(started, tmp_path,
                                                                                server_downloads):
    mirror = _mirror(tmp_path, mode="drop norange")
    fed = started([mirror.url])
    sha = _fill(mirror, fed)
    info, got = _get(fed, tmp_path / "w", [])
    assert got.source == mirror.url and server_downloads == []
    assert [r for _, r in mirror.requests] == [None, f"bytes={info.base_size // 2}-"]
    assert archive.packed_sha256(got.model_dir) == sha
    mirror.stop()


def test_a_slow_mirror_is_abandoned_and_its_bytes_are_not_resumed_by_the_server(started, tmp_path,
                                                                               server_downloads):
    mirror = _mirror(tmp_path, mode="slow")
    fed = started([mirror.url])
    _fill(mirror, fed)
    said: list[str] = []
    begun = time.monotonic()
    info, got = _get(fed, tmp_path / "w", said, policy=MirrorPolicy(timeout=5.0, min_bytes_per_s=1 << 20,
                                                                     window_s=0.5))
    assert time.monotonic() - begun < 60  # the mirror alone would take minutes
    assert got.source == "server" and server_downloads == [0]  # the unverified slow bytes were cut off
    assert any(line.startswith(f"mirror {mirror.url}: too slow (") for line in said), said
    assert archive.packed_sha256(got.model_dir) == info.base_sha256
    mirror.stop()


def test_the_signature_covers_the_mirror_list(started, tmp_path):
    fed = started(["https://a.example/zoo", "http://b.example"])
    info = fed.round()
    assert list(info.mirrors) == ["https://a.example/zoo", "http://b.example"]
    pub = fed.state.public_key
    signing.verify(pub, bytes(info.signature), signing.round_info_bytes(info))
    for changed in (["https://evil.example/zoo", "http://b.example"], ["http://b.example", "https://a.example/zoo"],
                    ["https://a.example/zoo"], []):
        forged = gym_pb2.RoundInfo()
        forged.CopyFrom(info)
        del forged.mirrors[:]
        forged.mirrors.extend(changed)
        with pytest.raises(signing.SignatureError):
            signing.verify(pub, bytes(forged.signature), signing.round_info_bytes(forged))


class _WithoutMirrors:
    """A RoundInfo as a reader without the mirrors field sees it (today's clients)."""

    def __init__(self, info) -> None:
        self._info = info

    def __getattr__(self, name):
        if name == "mirrors":
            raise AttributeError(name)
        return getattr(self._info, name)


def test_a_server_without_mirrors_signs_the_bytes_it_signed_before(started):
    info = started([]).round()
    assert list(info.mirrors) == []
    assert signing.round_info_bytes(info) == signing.round_info_bytes(_WithoutMirrors(info))
    assert b"mirrors" not in signing.round_info_bytes(info)
    signing.verify(bytes(info.server_public_key), bytes(info.signature), signing.round_info_bytes(_WithoutMirrors(info)))


@pytest.mark.parametrize("bad", ["ftp://m.example/x", "m.example/zoo", "http://", "https://m.example/?a=1"])
def test_a_mirror_that_is_not_an_http_url_is_refused_at_start(bad):
    with pytest.raises(ConfigError, match="must be an http:// or https:// base URL"):
        build_config({}, mirrors=[bad])
    assert build_config({"mirrors": ["http://m.example/zoo/"]}).mirrors == ["http://m.example/zoo"]


def _publish_round_one(fed: Fed) -> str:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from safetensors import safe_open
    import torch

    sha = fed.round().base_sha256
    with safe_open(str(fed.state.checkpoint_dir(sha) / "model.safetensors"), framework="pt") as f:
        names = [k for k in f.keys() if len(f.get_slice(k).get_shape()) == 2][:3]
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
    for seed in range(2):  # min_contributors = 2
        key = Ed25519PrivateKey.generate()
        cid = fed.stub.Register(register_request(key, "t")).contributor_id
        g = torch.Generator().manual_seed(seed)
        payload = codec.encode({k: torch.randn(s, generator=g) * 1e-3 for k, s in shapes.items()}, codec="bitdelta")
        header = build_header(key=key, contributor_id=cid, round_id=1, base_sha256=sha, payload=payload,
                              metadata={"test": True})
        fed.stub.SubmitDelta(request_stream(header, payload, chunk_bytes=1 << 16))
    deadline = time.monotonic() + 180
    while fed.round().round_id == 1:
        assert time.monotonic() < deadline, "round 1 was not published in 180 s"
        time.sleep(0.2)
    return fed.round().base_sha256


def test_gym_client_pull_takes_the_published_checkpoint_from_a_mirror_mirror_sync_filled(started, tmp_path,
                                                                                          server_downloads):
    from zoo_gym.server.cli import app as server_app

    mirror = _mirror(tmp_path)
    fed = started([mirror.url])
    sha = _publish_round_one(fed)
    sync = CliRunner().invoke(server_app, ["mirror-sync", str(mirror.root), "--state-dir", str(fed.state.root),
                                           "--json"])
    assert sync.exit_code == 0, sync.output
    assert sha in json.loads(sync.stdout)["copied"]
    res = CliRunner().invoke(app, ["pull", str(tmp_path / "out"), "--server", fed.address, "--insecure",
                                   "--workdir", str(tmp_path / "w"), "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["sha256"] == sha and summary["source"] == mirror.url
    assert server_downloads == [] and mirror.requests == [(f"/zoo/{sha}", None)]
    assert (tmp_path / "out" / archive.WEIGHTS).is_file()
    mirror.stop()


def test_the_mirror_policy_is_read_from_the_environment(tmp_path):
    policy = MirrorPolicy.from_env({"ZOO_GYM_MIRROR_TIMEOUT": "3", "ZOO_GYM_MIRROR_MIN_BYTES_PER_S": "1e6"})
    assert (policy.timeout, policy.min_bytes_per_s) == (3.0, 1e6)
    assert MirrorPolicy.from_env({}) == MirrorPolicy()
    with pytest.raises(ValueError, match="ZOO_GYM_MIRROR_MIN_BYTES_PER_S='fast': must be a number"):
        MirrorPolicy.from_env({"ZOO_GYM_MIRROR_MIN_BYTES_PER_S": "fast"})


def test_gym_client_join_trains_on_the_base_a_mirror_served(started, tmp_path, server_downloads):
    from zoo_gym.client.join import JoinOptions, join

    mirror = _mirror(tmp_path)
    fed = started([_down_url(), mirror.url])
    sha = _fill(mirror, fed)
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"instruction": f"Say {i} twice.", "input": "", "output": f"{i} {i}"}) + "\n"
                            for i in range(12)))
    said: list[str] = []
    opts = JoinOptions(server=fed.address, workdir=tmp_path / "home", key_path=tmp_path / "k.pem", data=str(data),
                       max_steps=1, insecure=True, train_overrides={"warmup_steps": 0}, wait_for_publish=False,
                       progress=False, max_wait=60)
    [summary] = join(opts, say=said.append)
    assert summary["checkpoint_source"] == mirror.url and server_downloads == []
    assert any(line.startswith(f"checkpoint {sha[:12]}: downloaded from mirror {mirror.url}") for line in said)
    assert any(line.startswith("mirror http://127.0.0.1:") and "unreachable" in line for line in said), said
    assert fed.round().submissions == 1
    mirror.stop()
