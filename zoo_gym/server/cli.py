"""`gym-server`: initialise a federation's state, serve it over gRPC, inspect it.

Every command is a thin wrapper over library calls; errors print one line saying what to fix and exit 2.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import select

from zoo_gym.cli_help import Typer
from zoo_gym.allocator import settle_allocator
from zoo_gym.server.config import ConfigError, ServerConfig, build_config, ingest_leaves, read_config_file
from zoo_gym.settings import with_settings
from zoo_gym.server.store.state import StateError, open_state
from zoo_gym.server.genesis import init_state

app = Typer(help="Zoo Gym server: runs federated rounds, merges deltas, publishes checkpoints.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
ledger_app = Typer(help="Inspect and verify the rewards ledger.", no_args_is_help=True)
app.add_typer(ledger_app, name="ledger")


def _print_version(value: bool) -> None:
    if value:
        from zoo_gym import __version__

        typer.echo(f"gym-server {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")) -> None:
    pass

StateDir = typer.Option(..., "--state-dir", help="Directory holding the server's database, blobs and key.")
VALIDATION_HELP = ("Held-out examples the server evaluates every checkpoint on: alpaca records "
                   "(instruction / input / output) or sharegpt records (conversations), as .json or .jsonl "
                   "(what zoo_gym.gym_train.formats.load_examples reads).")


def _fail(message: str) -> None:
    from zoo_gym.server.logging_setup import announce

    announce(f"error: {message}", level=logging.ERROR, event="error")  # a JSON line under --log-format json
    raise typer.Exit(2)


def _join_ray(address: str | None) -> None:
    """Join the Ray cluster before serving (`--aggregation-engine ray`): an unreachable one is one line now."""
    from zoo_gym.server.logging_setup import announce
    from zoo_gym.server.rounds.ray_engine import RayEngineError, connect

    try:
        connect(address)
    except RayEngineError as exc:
        _fail(str(exc))
    announce(f"aggregation sharded on Ray ({address or 'a local cluster'})", ray_address=address)


@contextmanager
def _one_line_errors() -> Iterator[None]:
    """What a person can fix (a missing or damaged state directory, a bad setting, a taken port, an
    unusable database) ends the command with one line and exit 2 instead of a traceback."""
    try:
        yield
    except (ConfigError, StateError, ValueError, OSError) as exc:
        _fail(str(exc))
    except SQLAlchemyError as exc:  # its text spans lines (statement, parameters, a link): keep the cause
        cause = str(getattr(exc, "orig", None) or exc).strip().splitlines()
        _fail(f"database error: {cause[0] if cause else type(exc).__name__}")


@app.command()
def init(
    state_dir: Path = StateDir,
    base_model: str = typer.Option("tiny", help="A built-in base: 'tiny' (random weights, for the mechanics) or "
                                                "'smollm2-135m' (SmolLM2-135M-Instruct, real weights); a local HF "
                                                "model directory; a .gguf file (dequantized once, cached); or a "
                                                "model id already in the local Hugging Face cache."),
    db: Optional[str] = typer.Option(None, help="SQLAlchemy URL (default: SQLite in the state dir)."),
    chat_template: Optional[Path] = typer.Option(
        None, "--chat-template", help="Jinja chat-template file written into the genesis tokenizer, used by every "
        "client's training and the server's evaluation \\[default: the base's own; a base without one gets the "
        "plain format '### Instruction:\\n...\\n\\n### Response:\\n<answer><eos>']."),
    validation_data: Optional[Path] = typer.Option(
        None, "--validation-data", help=VALIDATION_HELP + " Copied into the state directory; `serve` uses it "
        "unless given another \\[default: the built-in task's validation set]."),
) -> None:
    """Create the state: database, blob store, genesis checkpoint (round 0), the server's Ed25519 key.

    Refuses, in one line and creating nothing, a base that a client could not train with LoRA or the
    server could not evaluate (it tries one training step on two examples and the server's evaluator)."""
    with _one_line_errors():
        state = init_state(state_dir, base_model=base_model, db_url=db, chat_template=chat_template,
                           validation_file=validation_data)
        from zoo_gym.server.store.models import Round

        with state.session() as s:
            rnd = s.get(Round, 1)
    typer.echo(f"initialised {state_dir}: genesis checkpoint {rnd.base_sha256[:12]} ({base_model}); round 1 open")
    if base_model != "tiny" and validation_data is None:
        typer.echo("warning: no --validation-data: held-out losses and rewards will be measured on the built-in "
                   "arithmetic task, which is made for the built-in model and says little about this one; give "
                   "your own held-out examples with `serve --validation-data FILE`", err=True)


@app.command()
@with_settings(ServerConfig)
def serve(
    state_dir: Path = StateDir,
    config: Optional[Path] = typer.Option(None, "--config", help="TOML or YAML settings (keys as the flags, "
                                          "dashes or underscores); environment variables ZOO_GYM_<KEY> win over "
                                          "it, flags over both."),
    db: Optional[str] = typer.Option(None, help="SQLAlchemy URL overriding the one chosen at init."),
    port_file: Optional[Path] = typer.Option(None, help="Write the bound port here once serving (for scripts)."),
    *,
    settings_flags: dict,
) -> None:
    """Serve the federation's gRPC API (plus gRPC health and reflection); resumes an existing state."""
    import os

    with _one_line_errors():
        file_values = read_config_file(config) if config else {}
        cfg = build_config(file_values, environ=os.environ, **settings_flags)
        from zoo_gym.server.logging_setup import announce, configure_logging

        configure_logging(level=cfg.log_level, fmt=cfg.log_format)
    with _one_line_errors():
        if cfg.validation_data is not None:
            from zoo_gym.server.genesis import check_validation_file

            check_validation_file(Path(cfg.validation_data))  # a DataError names file, line and field
        from zoo_gym.server.rounds.policy import policy_for

        policy_for(cfg).check_size()  # a round too small for the rule fails now, not when it closes
        # the directory's lock, held until this process ends: a second serve of it is refused
        state = open_state(state_dir, db_url=db, exclusive=True)
        from zoo_gym.server.store.state import use_init_validation

        use_init_validation(cfg, state)
        from zoo_gym.server.store.state import record_serve_settings
        from zoo_gym.settings import flat_values

        record_serve_settings(state.root, flat_values(cfg))  # what `gym-server ingest` processes take
        from zoo_gym.server.store.sweep import sweep_storage

        swept = sweep_storage(state)  # what a crash left behind, before any upload can be in flight
        if swept.blobs or swept.scratch:
            logging.getLogger("zoo_gym.server").info("%s", swept)
        if cfg.keep_checkpoints is not None:  # a crash between a publish's commit and its sweep
            from zoo_gym.server.store.retention import retire_checkpoints

            retired = retire_checkpoints(state, keep=cfg.keep_checkpoints)
            if retired.bytes:
                logging.getLogger("zoo_gym.server").info("%s", retired)
        from zoo_gym.server.transport.servicer import build_server

        server, bound, rounds = build_server(state, cfg)  # refuses a port another process listens on
        dashboard = _dashboard(state, cfg, registry=rounds.metrics.registry) if cfg.dashboard_port else None
    _ready_for_rounds()
    if cfg.aggregation_engine == "ray":
        _join_ray(cfg.ray_address)
    server.start()
    rounds.start()
    if port_file:
        with _one_line_errors():
            port_file.write_text(f"{bound}\n")
    announce(f"gym-server listening on {cfg.host}:{bound} (state {state_dir})", port=bound)
    if cfg.mirrors:
        announce(_mirrors_line(cfg.mirrors), mirrors=cfg.mirrors)
    if dashboard is not None:
        dashboard.start()
        guarded = " (bearer token required)" if cfg.dashboard_token_file else ""
        announce(f"dashboard at {dashboard.url} (metrics at {dashboard.url}metrics){guarded}", url=dashboard.url)
    _wait_for_stop()
    announce("gym-server stopping")
    if dashboard is not None:
        dashboard.stop()
    server.stop(grace=5).wait()
    rounds.stop()
    state.lock.release()


def _ready_for_rounds() -> None:
    """The allocator settled before the first upload's buffers, the kernels compiled (or loaded) now, not in the
    first round."""
    from zoo_gym.aggregation import select_kernels
    from zoo_gym.aggregation.packed_kernels import warm_up
    from zoo_gym.server.store import master_kernel

    settle_allocator()
    warm_up()  # the BitDelta distance / mean kernels
    select_kernels.warm_up()  # the trimmed mean's selection
    master_kernel.warm_up()  # and the publish's bf16 master update


def _wait_for_stop() -> None:
    """Return once SIGINT or SIGTERM arrives."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    # wake every second: a process's signal may land on any thread (gRPC's own), and then Python runs the
    # handler only when the main thread next executes bytecode, never while it blocks in a wait without timeout
    while not done.wait(1.0):
        pass


@app.command()
@with_settings(ingest_leaves())
def ingest(
    state_dir: Path = StateDir,
    config: Optional[Path] = typer.Option(None, "--config", help="TOML or YAML settings, serve's own file may be "
                                          "given: this process takes from it the settings below; any other key in "
                                          "it must agree with the running serve's."),
    db: Optional[str] = typer.Option(None, "--db", "--database-url", help="PostgreSQL URL of the database the "
                                     "directory's serve uses \\[default: the one chosen at init]."),
    port_file: Optional[Path] = typer.Option(None, help="Write the bound port here once serving (for scripts)."),
    *,
    settings_flags: dict,
) -> None:
    """Take uploads on one more address for the `gym-server serve` of a state directory on PostgreSQL.

    Answers Register, GetRound, SubmitDelta, DownloadCheckpoint and the ledger queries from the shared state
    directory (blobs) and database (rows), signed with the server's key, with no round manager: serve closes
    and publishes the rounds, seeing these submissions within a second. The round settings (mode, rule,
    privacy, limits that RoundInfo signs) are serve's, read from STATE_DIR/serve.json, so start serve first;
    the settings below are this process's own. Run several, each on its own --host/--port, and give
    contributors every address: gym-client join --server A,B,C. --dashboard-port serves the dashboard and
    this process's own /metrics. Refuses SQLite."""
    import os

    settle_allocator()

    from zoo_gym.server.config import ingest_config
    from zoo_gym.server.store.state import open_ingest_state
    from zoo_gym.server.transport.ingest import ServeSettings, build_ingest_server

    with _one_line_errors():
        file_values = read_config_file(config) if config else {}
        state = open_ingest_state(state_dir, db_url=db)
        settings = ServeSettings(state.root, lambda recorded: ingest_config(recorded, file_values,
                                                                            environ=os.environ, **settings_flags))
        cfg = settings.config
        from zoo_gym.server.logging_setup import announce, configure_logging

        configure_logging(level=cfg.log_level, fmt=cfg.log_format)
        server, bound, metrics = build_ingest_server(state, settings)  # refuses a port another process listens on
        dashboard = _dashboard(state, cfg, registry=metrics.registry) if cfg.dashboard_port else None
    server.start()
    if port_file:
        with _one_line_errors():
            port_file.write_text(f"{bound}\n")
    announce(f"gym-server ingest listening on {cfg.host}:{bound} (state {state_dir}, {cfg.mode} rounds run by its "
             "gym-server serve)", port=bound)
    if dashboard is not None:  # the shared state's pages, and this process's own /metrics
        dashboard.start()
        announce(f"dashboard at {dashboard.url} (this process's metrics at {dashboard.url}metrics)", url=dashboard.url)
    _wait_for_stop()
    announce("gym-server ingest stopping")
    if dashboard is not None:
        dashboard.stop()
    server.stop(grace=5).wait()
    state.engine.dispose()


def _mirrors_line(mirrors: list[str]) -> str:
    plain = [m for m in mirrors if m.startswith("http://")]
    note = (f"; {len(plain)} over plain http, which is fine: clients keep only bytes that hash to the sha256 this "
            "server signs" if plain else "")
    return (f"checkpoint mirrors, tried in this order by clients: {', '.join(mirrors)} (fill each with "
            f"`gym-server mirror-sync DIR` after a publish{note})")


def _dashboard(state, cfg: ServerConfig, *, registry):
    """The dashboard server (not started yet) on cfg.dashboard_host, behind its bearer token when one is set."""
    from zoo_gym.dashboard import DashboardServer, create_app

    return DashboardServer(create_app(state, registry=registry, dp_target_epsilon=cfg.soup.dp_target_epsilon,
                                      token=cfg.dashboard_token()),
                           host=cfg.dashboard_host, port=cfg.dashboard_port, ssl_certfile=cfg.ssl_certfile,
                           ssl_keyfile=cfg.ssl_keyfile)


@app.command("settings")
@with_settings(ServerConfig)
def show_settings(
    config: Optional[Path] = typer.Option(None, "--config", help="TOML or YAML settings, as `serve` reads them."),
    *,
    settings_flags: dict,
) -> None:
    """Print, as JSON, every setting `serve` would run with given the same flags, environment and --config
    (flag > environment ZOO_GYM_<KEY> > file > default); changes nothing."""
    import os

    from zoo_gym.settings import flat_values

    with _one_line_errors():
        cfg = build_config(read_config_file(config) if config else {}, environ=os.environ, **settings_flags)
    typer.echo(json.dumps(flat_values(cfg), indent=2))


@app.command("tls-cert")
def tls_cert(
    out: Path = typer.Option(..., "--out", help="Directory to write ca.pem, server.pem and server.key into."),
    host: list[str] = typer.Option(..., "--host", help="Host name or IP address clients connect to (repeat "
                                                       "for several)."),
    days: int = typer.Option(365, min=1, help="Validity in days."),
) -> None:
    """Make a private CA and a TLS certificate for the server signed by it. Serve with
    --ssl-certfile server.pem --ssl-keyfile server.key; give contributors ca.pem (--root-certificates)."""
    from zoo_gym.proto.tls import make_certificates

    with _one_line_errors():
        made = make_certificates(out, hosts=tuple(host), days=days)
    typer.echo(f"wrote {made.ca} (give it to contributors), {made.cert} and {made.key} (keep it secret)")


@app.command()
def invite(
    state_dir: Path = StateDir,
    count: int = typer.Option(1, "--count", min=1, max=1_000_000, help="How many invitations to make."),
    as_json: bool = typer.Option(False, "--json", help='Print {"invites": [...]} instead of one token a line.'),
) -> None:
    """Print single-use invitations signed with the server's key, for a server run with --admission invite.
    Each admits one new contributor key (`gym-client join --invite TOKEN`); keep them secret until handed out."""
    from zoo_gym.server.transport.admission import make_invites

    with _one_line_errors():
        tokens = make_invites(open_state(state_dir).key, count=count)
    typer.echo(json.dumps({"invites": tokens}) if as_json else "\n".join(tokens))


@app.command()
def migrate(
    state_dir: Path = StateDir,
    dry_run: bool = typer.Option(False, "--dry-run", help="List the pending migrations; change nothing."),
    db: Optional[str] = typer.Option(None, help="SQLAlchemy URL overriding the one chosen at init."),
) -> None:
    """Upgrade the database of a state directory made by an older zoo-gym (every other command refuses it until
    then): copies a SQLite file to server.db.<old revision>.bak, then applies the pending schema migrations in one
    transaction. Stop the server first; back up a PostgreSQL database with pg_dump."""
    from zoo_gym.server.store.state import migrate_state

    with _one_line_errors():
        report = migrate_state(state_dir, db_url=db, dry_run=dry_run)
    if not report.pending:
        typer.echo(f"nothing to migrate: the database is at revision {report.head}, the newest")
        return
    typer.echo(f"the database is at revision {report.current}; {len(report.pending)} migration(s) "
               f"{'pending' if dry_run else 'to apply'}:")
    for step in report.pending:
        typer.echo(f"  {step.revision}  {step.message}")
    if report.backup is not None:
        typer.echo(f"backed up the database to {report.backup}")
    if report.applied:
        typer.echo(f"migrated {state_dir} to revision {report.head}")


STATUS_LINES = 20  # submissions `status` names one a line; the rest are counted (10,000 lines say nothing)


@app.command()
def status(state_dir: Path = StateDir, as_json: bool = typer.Option(False, "--json", help="Machine-readable.")) -> None:
    """Current round (who submitted, when it closes, the rule), contributors, privacy spent, checkpoints."""
    import time

    from sqlmodel import func

    from zoo_gym.server.rounds import async_rounds
    from zoo_gym.server.store.models import Checkpoint, Contributor, Round, Submission

    with _one_line_errors():
        state = open_state(state_dir)
        with state.session() as s:
            rnd = state.current_round(s)
            subs = list(s.exec(select(Submission, Contributor.display_name)
                               .join(Contributor, Contributor.id == Submission.contributor_id, isouter=True)
                               .where(Submission.round_id == rnd.id))) if rnd else []
            ckpts = list(s.exec(select(Checkpoint).order_by(Checkpoint.round_id)))
            rounds = list(s.exec(select(Round).order_by(Round.id)))
            contributors = int(s.exec(select(func.count()).select_from(Contributor)).one())
            mode = async_rounds.recorded_mode(s)
    if rnd is None:
        _fail(f"the database of {state_dir} holds no rounds: it is not the one `gym-server init` made")
    spent = next((r.dp_epsilon_total for r in reversed(rounds) if r.dp_epsilon_total is not None), None)
    doc = {
        "round": {"id": rnd.id, "state": rnd.state.value, "base_sha256": rnd.base_sha256, "message": rnd.message,
                  "deadline_unix": rnd.deadline_unix, "aggregator": rnd.aggregator,
                  "submissions": [{"contributor": x.contributor_id, "display_name": name or "",
                                   "payload_sha256": x.payload_sha256, "bytes": x.payload_size, "codecs": x.codecs,
                                   "received_at": x.received_at.isoformat()} for x, name in subs]},
        "mode": mode,  # as the latest closed round recorded it: serve's --mode is not stored elsewhere
        "contributors": contributors,
        "dp_epsilon_spent": spent,
        "rounds": [{"id": r.id, "state": r.state.value, "published_sha256": r.published_sha256,
                    "aggregator": r.aggregator, "dp_epsilon_total": r.dp_epsilon_total,
                    "dp_epsilon_round": r.dp_epsilon_round, "dp_sample_rate": r.dp_sample_rate,
                    # a report names every contributor: parsed for --json only (the text shows none of it)
                    "report": json.loads(r.report_json) if as_json else None} for r in rounds],
        "checkpoints": [{"round": c.round_id, "sha256": c.sha256, "parent_sha256": c.parent_sha256,
                         "bytes": c.size, "heldout_loss": c.heldout_loss,
                         "lineage": json.loads(c.manifest_json)} for c in ckpts],
    }
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
        return
    r = doc["round"]
    n = len(r["submissions"])
    when = ""
    if r["state"] == "open":
        when = (f", closes at {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(r['deadline_unix']))}"
                if r["deadline_unix"] else ", no deadline yet (the clock starts with the server)")
    typer.echo(f"round {r['id']}: {r['state']} on base {r['base_sha256'][:12]}, {n} submission{'s' if n != 1 else ''}"
               f"{when}, aggregator {r['aggregator']}" + (f" ({r['message']})" if r["message"] else ""))
    for x in r["submissions"][:STATUS_LINES]:
        typer.echo(f"  {x['display_name'] or '-':<24} {x['contributor'][:12]}  {x['bytes']:>10} bytes  {x['codecs']}")
    if n > STATUS_LINES:
        typer.echo(f"  ... and {n - STATUS_LINES} more (`gym-server status --json` lists every one)")
    typer.echo(async_rounds.describe_mode(mode))
    typer.echo(f"contributors: {contributors} registered")
    typer.echo("privacy: off (no differential privacy spent)" if spent is None else f"privacy: epsilon {spent:.4g} spent")
    typer.echo("published checkpoints:")
    for c in doc["checkpoints"]:
        loss = f"{c['heldout_loss']:.4f}" if c["heldout_loss"] is not None else "-"
        typer.echo(f"  round {c['round']:>3}  {c['sha256'][:12]}  {c['bytes']:>10} bytes  held-out loss {loss}")


@app.command("mirror-sync")
def mirror_sync(
    out: Path = typer.Argument(..., help="Directory a web server serves as a --mirror URL (created if absent)."),
    state_dir: Path = StateDir,
    db: Optional[str] = typer.Option(None, help="SQLAlchemy URL overriding the one chosen at init."),
    size_only: bool = typer.Option(False, "--size-only", help="Take a file already in OUT with the right size "
                                   "as copied, without hashing it."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary."),
) -> None:
    """Copy every stored published checkpoint into OUT as OUT/<sha256>, the layout a checkpoint mirror serves
    (serve --mirror URL; clients fetch URL/<sha256>). Skips those already there; atomic; runs beside a
    serving server. Run it after each publish (e.g. from cron): a mirror without a checkpoint answers 404
    and clients take it from the server."""
    from zoo_gym.server.store.mirror_sync import mirror_sync as sync

    with _one_line_errors():
        report = sync(open_state(state_dir, db_url=db), out, verify=not size_only)
    if as_json:
        typer.echo(json.dumps(vars(report), indent=2))
    else:
        typer.echo(report.line())


@app.command()
def export(
    out: Path = typer.Argument(..., help="New (or empty) directory to write the Hugging Face model into."),
    state_dir: Path = StateDir,
    round_id: Optional[int] = typer.Option(None, "--round", help="Round whose published checkpoint to export "
                                                                 "(0 = the base) \\[default: the latest]."),
    fmt: str = typer.Option("hf", "--format", help="hf: a Hugging Face directory; gguf: one .gguf file for "
                                                    "llama.cpp / Ollama (needs the gguf package); peft: the round's "
                                                    "update as a PEFT LoRA adapter (truncated SVD) for the "
                                                    "previous round's checkpoint."),
    quantization: str = typer.Option("f16", help="GGUF tensor type: f16, bf16 or q8_0."),
    license: str = typer.Option("unknown", "--license", help="The card's license (a Hub license id such as "
                                                             "apache-2.0; a fine-tune inherits its base's)."),
    rank: Optional[int] = typer.Option(None, "--rank", help="--format peft: the LoRA rank of every tensor "
                                       "\\[default: per tensor, the smallest with relative error <= 1e-3]."),
) -> None:
    """Write a published checkpoint as a plain Hugging Face directory (loads with from_pretrained) or a GGUF
    file, with a README.md model card: base model, lineage, contributors, privacy spent, held-out loss.
    --format peft writes the round's update instead and prints, as JSON, each tensor's rank and error."""
    if fmt == "peft":
        with _one_line_errors():
            from zoo_gym.server.peft_export import export_round_adapter

            report = export_round_adapter(open_state(state_dir), out, round_id=round_id, rank=rank)
        typer.echo(json.dumps(report.as_json(out), indent=2))
        return
    if rank is not None:
        _fail("--rank is for --format peft")
    with _one_line_errors():
        state = open_state(state_dir)
        from zoo_gym.server.store.export import export_checkpoint

        ckpt = export_checkpoint(state, out, round_id=round_id, fmt=fmt, quantization=quantization, license=license)
    from zoo_gym.proto.model_card import base_label

    typer.echo(f"exported round {ckpt.round_id} {base_label(out)} to {out}")


@ledger_app.command("verify")
def ledger_verify(state_dir: Path = StateDir, as_json: bool = typer.Option(False, "--json")) -> None:
    """Check the whole hash chain and every signature; name the first bad entry (exit 1). Says its progress on
    stderr every 5,000 entries."""
    with _one_line_errors():
        state = open_state(state_dir)
        from zoo_gym.server.store.queries import ledger_size, verify_ledger

        total = ledger_size(state)
        report = verify_ledger(state, progress=lambda n: typer.echo(f"ledger verify: {n} of {total} entries "
                                                                    "checked", err=True))
    if as_json:
        typer.echo(json.dumps(report))
    elif report["ok"]:
        typer.echo(f"ledger OK: {report['checked']} entries, chain and signatures verified")
    else:
        typer.echo(f"ledger BROKEN at entry {report['first_bad_seq']}: {report['reason']}")
    if not report["ok"]:
        raise typer.Exit(1)


@ledger_app.command("show")
def ledger_show(state_dir: Path = StateDir, contributor: Optional[str] = typer.Option(None),
                limit: int = typer.Option(50), as_json: bool = typer.Option(False, "--json")) -> None:
    """Print ledger entries (newest last)."""
    with _one_line_errors():
        state = open_state(state_dir)
        from zoo_gym.server.rounds.settlement import ledger_entries

        entries = ledger_entries(state, contributor=contributor, since_seq=0, limit=None)[-limit:]
    if as_json:
        typer.echo(json.dumps(entries, indent=2))
        return
    for e in entries:
        typer.echo(f"{e['seq']:>5} r{e['round_id']:<3} {e['contributor_id'][:12]} {e['kind']:<10} "
                   f"{e['amount']:>8} score {e['score']:.4f} rep {e['reputation_after']:.3f} {e['reason']}")
