"""The dashboard under hostile input and in a browser: every query parameter is bounded (422 with a message,
never a 500, on SQLite and PostgreSQL), every response carries the security headers (a strict CSP the page
itself satisfies), and nothing loads from a CDN (the Swagger UI is off; the schema stays at /api/openapi.json)."""

from __future__ import annotations

import re
import threading

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi.testclient import TestClient
from sqlmodel import SQLModel

from zoo_gym.dashboard import create_app
from zoo_gym.server.store.engine import make_engine
from zoo_gym.server.store.state import ServerState, register_tables

DATABASES = ("sqlite", "postgresql")  # tests using `db_backend` run on each (tests/conftest.py)


@pytest.fixture(scope="module")
def web(db_backend, new_database, tmp_path_factory):
    root = tmp_path_factory.mktemp("hardening")
    url = new_database(db_backend) or f"sqlite:///{root / 'server.db'}"
    register_tables()
    engine = make_engine(url)
    SQLModel.metadata.create_all(engine)
    state = ServerState(root=root, engine=engine, blobs=None, key=Ed25519PrivateKey.generate(), base_model="tiny",
                        write_lock=threading.RLock())
    yield TestClient(create_app(state), raise_server_exceptions=False)
    engine.dispose()


@pytest.mark.parametrize("path,params", [
    ("/api/rounds", {"before": 2**31}), ("/api/rounds", {"before": -1}), ("/api/rounds", {"before": 10**30}),
    ("/api/rounds", {"limit": 2**63}), ("/api/leaderboard", {"limit": 10**20}), ("/api/ledger", {"limit": -5}),
    ("/api/checkpoints", {"limit": 2**31}), ("/api/rounds", {"before": "x"}),
])
def test_out_of_range_parameters_are_422_with_a_message(web, path, params):
    r = web.get(path, params=params)
    assert r.status_code == 422, (r.status_code, r.text)
    assert r.json()["detail"][0]["msg"]


def test_in_range_parameters_work(web):
    assert web.get("/api/rounds", params={"before": 2**31 - 1}).json() == []
    assert web.get("/api/rounds", params={"before": 1, "limit": 1000}).json() == []


def test_security_headers_on_pages_api_and_errors(web):
    for path in ("/", "/api/summary", "/static/style.css", "/api/rounds?before=-1", "/nope"):
        r = web.get(path)
        assert r.status_code < 500, (path, r.status_code)
        h = r.headers
        csp = h["content-security-policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp, path
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        assert h["x-content-type-options"] == "nosniff"
        assert h["referrer-policy"] == "no-referrer"
        assert h["x-frame-options"] == "DENY"
        assert "strict-transport-security" not in h  # plain HTTP: HSTS would be ignored, and is not sent


def test_hsts_over_tls(web):
    h = TestClient(web.app, base_url="https://testserver").get("/api/summary").headers
    assert h["strict-transport-security"].startswith("max-age=")


def test_the_page_needs_nothing_the_csp_forbids(web):
    html = web.get("/").text
    assert "<script" not in html and "<style" not in html and not re.search(r"\sstyle=", html)
    assert not re.search(r"\son[a-z]+=", html)  # no inline event handlers
    for ref in re.findall(r'(?:href|src)="([^"]+)"', html):
        assert ref.startswith("/") and not ref.startswith("//"), ref  # same origin only


def test_no_cdn_docs_but_the_schema_is_served(web):
    assert web.get("/api/docs").status_code == 404
    assert web.get("/api/openapi.json").json()["paths"]["/api/rounds"]
    assert "cdn" not in web.get("/").text.lower()


def test_an_internal_error_is_a_500_with_the_headers_and_no_traceback(tmp_path):
    """A real failure (the database has no tables: sqlite3.OperationalError inside a query) through a real
    uvicorn server: Starlette answers it outside any add_middleware middleware, so the headers are checked."""
    import httpx

    from zoo_gym.dashboard.serve import DashboardServer

    register_tables()
    engine = make_engine(f"sqlite:///{tmp_path / 'empty.db'}")  # never create_all: every query fails
    state = ServerState(root=tmp_path, engine=engine, blobs=None, key=Ed25519PrivateKey.generate(),
                        base_model="tiny", write_lock=threading.RLock())
    server = DashboardServer(create_app(state), host="127.0.0.1", port=0)
    server.start()
    try:
        for path in ("/api/summary", "/"):
            r = httpx.get(server.url.rstrip("/") + path, timeout=30)
            assert r.status_code == 500, (path, r.status_code, r.text)
            assert r.json() == {"detail": "internal error"}
            assert "Traceback" not in r.text and "sqlite" not in r.text.lower()
            assert "default-src 'none'" in r.headers["content-security-policy"]
            assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
            assert r.headers["referrer-policy"] == "no-referrer"
    finally:
        server.stop()
        engine.dispose()
