"""`gym-client`: contribute to a Zoo Gym federation and query your rewards."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import grpc
import typer

from zoo_gym.cli_help import Typer
from zoo_gym.client.train_settings import with_train_options
from zoo_gym.gym_train.distill import DEFAULT_DISTILL_STEPS

app = Typer(help="Zoo Gym contributor: fine-tune the federation's model on your data and earn rewards.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

DEFAULT_HOME = Path(os.environ.get("ZOO_GYM_HOME", Path.home() / ".zoo-gym"))
CODECS = ("auto", "bitdelta", "int8", "int4", "fp16", "bf16", "lora")


def _print_version(value: bool) -> None:
    if value:
        from zoo_gym import __version__

        typer.echo(f"gym-client {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                          help="Print the version and exit.")) -> None:
    pass


def _roots_option():
    return typer.Option(None, "--root-certificates", help="PEM file of the CA the server's TLS certificate must "
                        "chain to (the federation's ca.pem) \\[default: the system trust store].")


def _insecure_option():
    return typer.Option(False, "--insecure", help="Plaintext gRPC, only against a server started with "
                        "--insecure on a network you trust.")


def _check_roots(root_certificates: Optional[Path], insecure: bool) -> None:
    if insecure and root_certificates is not None:
        _fail("--insecure and --root-certificates contradict each other: plaintext has no certificates")
    if root_certificates is not None and not root_certificates.is_file():
        _fail(f"--root-certificates {root_certificates}: no such file")


def _check_server(server: str) -> None:
    """HOST:PORT (an IPv6 address in brackets) or a gRPC target such as unix:PATH; refused at once otherwise."""
    if server.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return
    host, sep, port = server.rpartition(":")
    if not sep or not host or host.endswith(":") or not port.isdigit() or not 0 < int(port) < 65536:
        name = server if server.count(":") > 1 or not sep else host  # an IPv6 address, or HOST:<bad port>
        name = f"[{name.strip('[]')}]" if ":" in name.strip("[]") else name or "localhost"
        _fail(f"--server {server!r}: give HOST:PORT with a port from 1 to 65535, e.g. {name}:50051")


def _check_servers(given: list[str]) -> str:
    """join's --server values (each one address or several comma-separated) as one comma-separated list, each
    address checked; a duplicate is refused."""
    from zoo_gym.client.connection import addresses

    listed = [a for value in given for a in addresses(value)]
    if not listed:
        _fail("--server: give HOST:PORT of the gym-server, e.g. localhost:50051")
    for address in listed:
        _check_server(address)
    twice = sorted({a for a in listed if listed.count(a) > 1})
    if twice:
        _fail(f"--server names {', '.join(twice)} twice: give each address of the federation once")
    return ",".join(listed)


def _set_log_level(level: str) -> None:
    import logging

    level = level.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        _fail(f"--log-level must be DEBUG, INFO, WARNING or ERROR, not {level!r}")
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if level in ("DEBUG", "INFO"):  # training keeps transformers quiet unless asked for more, as here
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity(getattr(logging, level))


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _say(message: str) -> None:
    typer.echo(message, err=True)


def _training(*, method, data: str, train_flags, train_config_file, threads) -> tuple[dict, list[str]]:
    """join's and personalize's shared checks, before any work: (TrainConfig overrides, warnings) from the
    flags, the environment and --config (warnings printed), a --data that exists, and torch's thread count."""
    from zoo_gym.client.train_settings import resolve
    from zoo_gym.gym_train.sources import FILE_SUFFIXES, looks_like_hub_id

    if data != "builtin" and not Path(data).exists() and not looks_like_hub_id(data):
        _fail(f"--data {data}: no such file or directory (use 'builtin', a {'/'.join(FILE_SUFFIXES)} file, "
              "a save_to_disk directory or a cached Hub dataset id)")
    try:
        train_overrides, warnings = resolve(train_flags or {}, train_config_file, method=method,
                                            environ=os.environ)
    except ValueError as exc:
        _fail(str(exc))
    for line in warnings:
        _say(f"warning: {line}")
    if threads:
        import torch

        torch.set_num_threads(threads)
    return train_overrides, warnings


@app.command()
@with_train_options
def join(
    server: list[str] = typer.Option(..., "--server", help="HOST:PORT of the gym-server. Several addresses of one "
                                     "federation (its serve and ingest processes), comma-separated or the flag "
                                     "repeated: you start at the one your key picks and go on with the next "
                                     "when it is unavailable."),
    root_certificates: Optional[Path] = _roots_option(),
    insecure: bool = _insecure_option(),
    data: str = typer.Option("builtin", help="'builtin' (your own shard of the built-in data, chosen from your "
                                             "key); a .json, .jsonl, .parquet or .csv file; a datasets "
                                             "save_to_disk directory; or a Hub dataset id already in your "
                                             "Hugging Face cache (never downloaded). Records: alpaca "
                                             "(instruction/input/output), sharegpt (conversations), messages "
                                             "(role/content) or prompt/completion."),
    method: Optional[str] = typer.Option(None, help="Deprecated: lora = --stage sft --finetuning-type lora, "
                                         "sft = --finetuning-type full, grpo = --stage grpo.",
                                         rich_help_panel="Training"),
    task: Optional[str] = typer.Option(None, "--task", help="Built-in task family to train on with --data builtin "
                                       "(e.g. arithmetic, sort_words, arithmetic-pairs for the preference stages) "
                                       "\\[default: the stage's: default, preference or grpo]."),
    rounds: int = typer.Option(1, min=1, help="Rounds to contribute to before exiting."),
    key: Optional[Path] = typer.Option(None, help="Ed25519 key (PEM); created if missing "
                                                  "\\[default: ~/.zoo-gym/contributor.pem]."),
    workdir: Optional[Path] = typer.Option(None, help="Cache for checkpoints and codec state \\[default: ~/.zoo-gym]."),
    codec: str = typer.Option("auto", help="auto (smallest exact-enough per tensor), bitdelta, int8, int4, "
                                           "fp16, bf16 or lora."),
    group_size: int = typer.Option(128, help="BitDelta/int scale group along each row (0 = one scale per row, "
                                             "-1 = one per tensor)."),
    shard: Optional[int] = typer.Option(None, help="Built-in data shard (default: picked from your key)."),
    n_shards: int = typer.Option(64, help="Number of built-in data shards."),
    name: str = typer.Option("", help="Display name shown to the operator."),
    invite: str = typer.Option("", "--invite", help="Invitation token from the operator (`gym-server invite`), "
                                                   "for a server that admits new contributors by invitation."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for training \\[default: torch's]."),
    no_wait: bool = typer.Option(False, "--no-wait", help="Exit right after the last upload."),
    keep_variant: bool = typer.Option(False, "--keep-variant", help="Also keep each round's own delta as a personal "
                                      "variant for gym-serve (WORKDIR/variants/ID-roundN.zgd)."),
    distill_steps: Optional[int] = typer.Option(None, "--distill-steps", min=0, help="With --keep-variant: scale "
                                                "distillation steps of each variant (BitDelta's calibration, on the "
                                                "training device after the last round); 0 = off \\[default: "
                                                f"{DEFAULT_DISTILL_STEPS}]."),
    connect_timeout: float = typer.Option(60.0, "--connect-timeout", min=1.0,
                                          help="Seconds to keep trying an unreachable server at first contact."),
    log_level: str = typer.Option("WARNING", "--log-level", help="DEBUG, INFO, WARNING or ERROR: log messages of "
                                                                 "the client and its libraries (transformers, TRL)."),
    as_json: bool = typer.Option(False, "--json", help="Print the per-round summaries as JSON on stdout."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Check the settings and the data, print the resolved "
                                 "training settings as JSON and exit, without contacting the server."),
    train_flags: dict = None,
    train_config_file: Optional[Path] = None,
) -> None:
    """Join a federation: each round download the base, train, compress, sign and upload your delta.

    Every training setting is a flag below (TRL/PEFT names; LLaMA-Factory's lora_rank, cutoff_len, per_device_train_batch_size, lora_target also work) or a key of --config train.yaml|toml (flags win); a LLaMA-Factory or TRL config is accepted as written, its keys that the server decides (model_name_or_path, output_dir, dataset ...) set aside with a warning. The data and the settings are checked before contacting the server (--dry-run: only that, printed as JSON).
    """
    from zoo_gym.client.join import JoinOptions

    _check_roots(root_certificates, insecure)
    server = _check_servers(server)
    _set_log_level(log_level)
    if codec not in CODECS:
        _fail(f"--codec must be one of {', '.join(CODECS)}")
    train_overrides, warnings = _training(method=method, data=data, train_flags=train_flags,
                                          train_config_file=train_config_file, threads=threads)
    home = workdir or DEFAULT_HOME
    opts = JoinOptions(server=server, workdir=home, key_path=key or DEFAULT_HOME / "contributor.pem", rounds=rounds,
                       data=data, task=task, codec=codec, group_size=(None if group_size == 0 else group_size),
                       train_overrides=train_overrides, shard=shard, n_shards=n_shards, display_name=name,
                       wait_for_publish=not no_wait, progress=not quiet and sys.stderr.isatty(),
                       root_certificates=str(root_certificates) if root_certificates else None, insecure=insecure,
                       invite=invite.strip(), connect_timeout=connect_timeout, keep_variant=keep_variant,
                       **({} if distill_steps is None else {"distill_steps": distill_steps}))
    if distill_steps is not None and not keep_variant:
        _fail("--distill-steps applies to the variants --keep-variant keeps: add --keep-variant, or drop it")
    if dry_run:
        _dry_run(opts, warnings)
        return
    _run_join(opts, as_json)


def _run_join(opts, as_json: bool) -> None:
    """join's rounds, each failure as one line and its exit code (1: the server or the network, 2: the data)."""
    from zoo_gym.client.connection import ServerUnreachable
    from zoo_gym.client.join import JoinError
    from zoo_gym.client.join import join as run_join
    from zoo_gym.proto.signing import SignatureError

    try:
        summaries = run_join(opts, say=_say)
    except (JoinError, ServerUnreachable, SignatureError) as exc:
        _fail(str(exc), 1)
    except grpc.RpcError as exc:
        _fail(f"the server refused a request ({exc.code().name}): {exc.details()}", 1)
    except ValueError as exc:  # bad data file or training settings
        _fail(str(exc), 2)
    if as_json:
        typer.echo(json.dumps(summaries, indent=2))


def _dry_run(opts, warnings: list[str]) -> None:
    """join --dry-run: the resolved round as JSON on stdout (exit 2 in one line if it cannot train)."""
    from zoo_gym.client.join import JoinError, dry_run

    try:
        doc = dry_run(opts)
    except (JoinError, ValueError) as exc:  # bad data file or training settings
        _fail(str(exc), 2)
    typer.echo(json.dumps({**doc, "warnings": warnings}, indent=2))


@app.command()
@with_train_options
def personalize(
    data: str = typer.Option(..., help="Your examples: a .json, .jsonl, .parquet or .csv file, a datasets "
                                       "save_to_disk directory or a cached Hub dataset id (the formats of join), "
                                       "or 'builtin'."),
    base: str = typer.Option(..., help="The base: 'tiny' or 'smollm2-135m' (built in), a Hugging Face directory, "
                                       "a .gguf file, or a hub id already in your cache. The variant is served "
                                       "only over these exact weights."),
    out: Path = typer.Option(..., help="The variant file to write, NAME.zgd (NAME is its model id in gym-serve)."),
    method: Optional[str] = typer.Option(None, help="Deprecated: lora = --stage sft --finetuning-type lora, "
                                         "sft = --finetuning-type full, grpo = --stage grpo.",
                                         rich_help_panel="Training"),
    task: Optional[str] = typer.Option(None, "--task", help="Built-in task family to train on with --data builtin "
                                       "(e.g. arithmetic, sort_words, arithmetic-pairs for the preference stages) "
                                       "\\[default: the stage's: default, preference or grpo]."),
    distill_steps: int = typer.Option(DEFAULT_DISTILL_STEPS, min=0, help="Scale distillation steps (BitDelta's "
                                      "calibration, on the training device); 0 = off."),
    peft_out: Optional[Path] = typer.Option(None, help="Also write the trained LoRA factors as a PEFT adapter "
                                                       "directory (PeftModel.from_pretrained; LoRA training only)."),
    threads: Optional[int] = typer.Option(None, help="CPU threads for training \\[default: torch's]."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
    train_flags: dict = None,
    train_config_file: Optional[Path] = None,
) -> None:
    """Train a personal variant locally (no server): 1-bit BitDelta signs with distilled group scales, for
    gym-serve. Training flags and --config are join's."""
    from zoo_gym.client.personalize import PersonalizeError, PersonalizeOptions
    from zoo_gym.client.personalize import personalize as run_personalize

    train_overrides, _ = _training(method=method, data=data, train_flags=train_flags,
                                   train_config_file=train_config_file, threads=threads)
    opts = PersonalizeOptions(data=data, task=task, base=base, out=out, train_overrides=train_overrides,
                              distill_steps=distill_steps, progress=not quiet and sys.stderr.isatty(),
                              peft_out=peft_out)
    try:
        summary = run_personalize(opts, say=_say)
    except (PersonalizeError, ValueError) as exc:  # bad data, settings, base or name
        _fail(str(exc), 2)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))


@app.command()
def pull(
    out: Path = typer.Argument(..., help="New or empty directory to write the Hugging Face model into."),
    server: str = typer.Option(..., "--server", help="HOST:PORT of the gym-server."),
    root_certificates: Optional[Path] = _roots_option(),
    insecure: bool = _insecure_option(),
    workdir: Optional[Path] = typer.Option(None, help="Download cache (resumable) \\[default: ~/.zoo-gym]."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary on stdout."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    fmt: str = typer.Option("hf", "--format", help="hf: a Hugging Face directory; gguf: one .gguf file for "
                                                    "llama.cpp / Ollama (needs the gguf package)."),
    quantization: str = typer.Option("f16", help="GGUF tensor type: f16, bf16 or q8_0."),
) -> None:
    """Download the latest published checkpoint (resumable, sha256-verified) as a plain Hugging Face
    directory (loads with from_pretrained) or a GGUF file, with a model card."""
    from zoo_gym.client.connection import ServerUnreachable
    from zoo_gym.client.download import DownloadError
    from zoo_gym.client.pull import PullError
    from zoo_gym.client.pull import pull as run_pull

    _check_roots(root_certificates, insecure)
    _check_server(server)
    try:
        summary = run_pull(server, out, workdir=workdir or DEFAULT_HOME, progress=not quiet and sys.stderr.isatty(),
                           root_certificates=str(root_certificates) if root_certificates else None,
                           insecure=insecure, say=_say, fmt=fmt, quantization=quantization)
    except PullError as exc:
        _fail(str(exc), 2)
    except (ServerUnreachable, DownloadError) as exc:
        _fail(str(exc), 1)
    except grpc.RpcError as exc:
        _fail(f"the server refused a request ({exc.code().name}): {exc.details()}", 1)
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        from zoo_gym.proto.model_card import base_label

        _say(f"pulled round {summary['round']} ({base_label(out)}) into {out}")


@app.command()
def rewards(
    server: str = typer.Option(..., "--server", help="HOST:PORT of the gym-server."),
    root_certificates: Optional[Path] = _roots_option(),
    insecure: bool = _insecure_option(),
    key: Optional[Path] = typer.Option(None, help="Your Ed25519 key \\[default: ~/.zoo-gym/contributor.pem]."),
    contributor: Optional[str] = typer.Option(None, help="Contributor id to query (default: your key's)."),
    limit: int = typer.Option(20, help="Recent entries to show."),
    verify: bool = typer.Option(False, "--verify", help="Check every entry's hash and the server's signature."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Your balance, reputation and recent ledger entries (optionally verified)."""
    from zoo_gym.client.connection import TransportMismatch
    from zoo_gym.client.rewards import RewardsError, fetch_rewards

    _check_roots(root_certificates, insecure)
    _check_server(server)
    try:
        doc = fetch_rewards(server, key_path=key or DEFAULT_HOME / "contributor.pem", contributor=contributor,
                            limit=limit, verify=verify,
                            root_certificates=str(root_certificates) if root_certificates else None,
                            insecure=insecure)
    except (RewardsError, TransportMismatch) as exc:
        _fail(str(exc), 1)
    except grpc.RpcError as exc:
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):  # nothing answered
            _fail(f"the server at {server} is unreachable ({exc.code().name}): {exc.details()}", 1)
        _fail(f"the server refused ({exc.code().name}): {exc.details()}", 1)
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        typer.echo(f"contributor {doc['contributor_id']}: balance {doc['balance']}, "
                   f"reputation {doc['reputation']:.3f}, {doc['entries']} ledger entries")
        for e in doc["recent"]:
            typer.echo(f"  #{e['seq']:<5} round {e['round_id']:<3} {e['kind']:<9} {e['amount']:>8}  "
                       f"score {e['score']:.4f}  {e['reason']}")
        if verify:
            v = doc["verification"]
            typer.echo("verified: every entry's hash and server signature" if v["ok"]
                       else f"VERIFICATION FAILED at entry {v['first_bad_seq']}: {v['reason']}")
    if verify and not doc["verification"]["ok"]:
        raise typer.Exit(1)


@app.command()
def webui(
    port: int = typer.Option(7860, "--port", min=0, max=65535, help="Port of the console (0: a free one)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on; anything but loopback lets "
                             "others on that network start joins as you."),
    workdir: Optional[Path] = typer.Option(None, help="Where the console keeps uploads, logs and pulled models "
                                           "\\[default: ~/.zoo-gym/webui]."),
    max_upload_mb: int = typer.Option(64, "--max-upload-mb", min=1, help="Largest data file the page may upload."),
    open_browser: bool = typer.Option(False, "--open", help="Open the console in the default browser."),
) -> None:
    """A web console for contributors: join from a form, watch rounds and pay, verify the ledger, chat.

    Its Join form is join's own options; a start runs `gym-client join --json` (the key stays in its file; closing the page stops nothing). Binds 127.0.0.1 unless --host says otherwise."""
    import uvicorn

    from zoo_gym.client.webui.app import create_app

    command = typer.main.get_command(app).commands["join"]  # type: ignore[attr-defined]
    hosts = ("127.0.0.1", "localhost", "::1", host.strip("[]"))
    application = create_app(command, directory=workdir or DEFAULT_HOME / "webui", default_home=DEFAULT_HOME,
                             max_upload_bytes=max_upload_mb << 20, allowed_hosts=hosts)
    import socket

    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        _fail(f"cannot listen on {host}:{port}: {exc.strerror}; choose another --port", 1)
    sock.listen(128)
    bound = sock.getsockname()[1]
    shown = f"[{host.strip('[]')}]" if ":" in host.strip("[]") else host
    url = f"http://{shown}:{bound}/"
    _say(f"gym-client webui: console at {url} (Ctrl-C stops the console; a join it started goes on)")
    if open_browser:
        import webbrowser

        webbrowser.open(url)
    # lifespan on: the gym-serve children the console started stop with it (a join it started goes on)
    server = uvicorn.Server(uvicorn.Config(application, log_level="warning", lifespan="on"))
    server.run(sockets=[sock])
