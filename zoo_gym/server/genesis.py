"""`gym-server init`: a new state directory with the genesis checkpoint (round 0) and round 1 open.

It refuses, in one line and before creating anything, a base the federation could not use: the genesis
tokenizer must render prompt/completion pairs (a base without a chat template gets
`zoo_gym.evaluation.chat.PLAIN_TEMPLATE`, or the operator's `--chat-template FILE`), one LoRA step of the
client's `train()` must run on its first decoder layers (zoo_gym/server/short_base.py) and give a delta in
the base's shapes, and the server's evaluator, reading one layer at a time, must load the
genesis checkpoint and give a finite held-out loss. This module is the server's one door to gym_train: the base
(`resolve_base`), init's training step, and the validation set every round reads (`validation_examples`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from functools import lru_cache
from pathlib import Path

from sqlalchemy import inspect
from sqlalchemy.engine import Engine
from sqlmodel import SQLModel

from zoo_gym.proto import archive, signing
from zoo_gym.proto.model_card import public_base_name
from zoo_gym.server.store import migrations
from zoo_gym.server.store.blobs import BlobStore
from zoo_gym.server.store.models import Checkpoint, Round, RoundState
from zoo_gym.server.store.state import (PRIVATE_DIR, PRIVATE_FILE, STATE_FILE, ServerState, StateError,
                                        create_private_sqlite, default_db_url, engine_for, make_private,
                                        register_tables, shown_url, sqlite_file, write_private)


def _resolve_base_model(base_model: str) -> Path:
    from zoo_gym.gym_train.bases import BaseModelError, resolve_base

    try:
        return resolve_base(base_model)
    except BaseModelError as exc:
        raise StateError(f"--base-model: {exc}") from None


def _normalised_copy(src: Path, dest: Path) -> None:
    """Copy a model directory as a single-file safetensors Hugging Face directory."""
    if (src / archive.WEIGHTS).is_file():
        for p in sorted(src.iterdir()):
            if p.is_file() and not p.name.startswith("."):
                shutil.copyfile(p, dest / p.name)
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(dest, max_shard_size="1000GB")
    AutoTokenizer.from_pretrained(src).save_pretrained(dest)


def _set_chat_template(genesis: Path, template: str | None) -> str:
    """Give the genesis tokenizer its chat template (and a pad token); returns where the template came from.

    `template` (the text of --chat-template) wins; otherwise the base's own template stays, and a base
    without one gets PLAIN_TEMPLATE. The tokenizer files are rewritten only when something changed, so a
    base that needs nothing keeps its files byte for byte."""
    from transformers import AutoTokenizer

    from zoo_gym.evaluation.chat import PLAIN_TEMPLATE

    try:
        tok = AutoTokenizer.from_pretrained(str(genesis))
    except Exception as exc:  # noqa: BLE001 - any failure: the base is unusable, say why in one line
        raise StateError(f"the base's tokenizer does not load: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                         ) from None
    source, changed = "base", False
    if template is not None:
        tok.chat_template, source, changed = template, "--chat-template", True
    elif not getattr(tok, "chat_template", None):
        tok.chat_template, source, changed = PLAIN_TEMPLATE, "plain", True
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token, changed = tok.eos_token, True
    if changed:
        tok.save_pretrained(str(genesis))
    return source


_checked: set[str] = set()  # digests of genesis directories that passed check_base in this process


def _dir_digest(model_dir: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and p.name != archive.LINEAGE:
            h.update(p.name.encode() + b"\0")
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


SHORT_LAYERS = 2  # decoder layers of the base that init's training step runs on (zoo_gym/server/short_base.py)


def check_base(model_dir: Path, examples: list[dict]) -> None:
    """StateError (one line) unless a client can train `model_dir` (one LoRA step, delta in the base's
    shapes) and the server's evaluator can load it and give a finite held-out loss on `examples`.

    Neither check holds the whole model: the evaluation reads the checkpoint one layer at a time, the
    training step runs as a `--bf16` client's on the base's first SHORT_LAYERS decoder layers (the same
    tensors: the same names, shapes and dtypes)."""
    from zoo_gym.gym_train.preflight import PreflightError, check_template, check_trainable, check_vocabulary
    from zoo_gym.server.short_base import short_base

    digest = _dir_digest(model_dir)
    if digest in _checked:
        return
    try:
        check_template(model_dir)
        check_vocabulary(model_dir, list(examples)[:2])
    except PreflightError as exc:
        raise StateError(f"a contributor could not train this base: {exc}") from None
    _check_evaluator(model_dir, examples)
    with tempfile.TemporaryDirectory(dir=model_dir.parent) as tmp:
        try:
            short = short_base(model_dir, Path(tmp) / "short", layers=SHORT_LAYERS) or model_dir
            check_trainable(short, examples, bf16=True)
        except PreflightError as exc:
            raise StateError(f"a contributor could not train this base: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a config or weights file that does not read
            raise StateError(f"a contributor could not train this base: {type(exc).__name__}: "
                             f"{(str(exc).strip().splitlines() or [''])[0]}") from None
    _checked.add(digest)


def _check_evaluator(model_dir: Path, examples: list[dict]) -> None:
    """StateError unless the server's (streamed) evaluator gives a finite held-out loss of `model_dir`."""
    import math

    try:
        from zoo_gym.evaluation.server_evaluator import ServerEvaluator
        from zoo_gym.evaluation.memory import release_memory

        loss = ServerEvaluator(model_dir, list(examples[:2]), scoring_examples=2).loss()  # no gradient needed
    except Exception as exc:  # noqa: BLE001 - whatever breaks the evaluator breaks every round
        text = str(exc).strip().splitlines()
        raise StateError(f"the server could not evaluate this base: {type(exc).__name__}: "
                         f"{text[0] if text else ''}") from None
    release_memory()  # the evaluator's model goes before the training check's loads
    if not math.isfinite(loss):
        raise StateError(f"the server's held-out loss of this base is {loss}, not a finite number")


def _validation_examples(validation_file: Path | None) -> list[dict]:
    from zoo_gym import gym_train

    if validation_file is None:
        return gym_train.default_validation_examples(n=2)
    return check_validation_file(validation_file)


def check_validation_file(path: Path) -> list[dict]:
    """The examples of a validation file as a contributor's training would read them (`init` and `serve` check
    it at start): DataError (a ValueError) names file, line and field."""
    from zoo_gym.gym_train.formats import load_examples

    return load_examples(path)


@lru_cache(maxsize=4)
def validation_examples(validation_file: str | None, n: int) -> tuple:
    """The first `n` examples every round's held-out loss and scoring run on: the validation file's records
    (preference pairs kept as pairs: `gym_train.formats.load_validation`), else the built-in task's."""
    from zoo_gym.gym_train import default_validation_examples
    from zoo_gym.gym_train.formats import load_validation

    if validation_file:
        return tuple(load_validation(Path(validation_file))[:n])
    return tuple(default_validation_examples(n=n))


def init_state(state_dir: Path, *, base_model: str = "tiny", db_url: str | None = None,
               chat_template: Path | None = None, validation_file: Path | None = None,
               check: bool = True) -> ServerState:
    """Create a new state directory with the genesis checkpoint (round 0) and round 1 open.

    `chat_template`: a Jinja chat-template file written into the genesis tokenizer (default: the base's
    own, else chat.PLAIN_TEMPLATE). `validation_file`: the server's held-out examples (alpaca or sharegpt,
    .json/.jsonl), copied into the directory and used by `serve` unless it is given another. `check`: try
    one client LoRA step and the server's evaluator on the base first (see `check_base`); nothing is
    created when the base is refused."""
    root = Path(state_dir)
    if (root / STATE_FILE).exists():
        raise StateError(f"{root} is already initialised; `gym-server serve --state-dir {root}` resumes it")
    src = _resolve_base_model(base_model)
    template = None
    if chat_template is not None:
        try:
            template = Path(chat_template).read_text()
        except OSError as exc:
            raise StateError(f"--chat-template {chat_template}: {exc.strerror or exc}") from None
        if not template.strip():
            raise StateError(f"--chat-template {chat_template} is empty")
    examples = _validation_examples(Path(validation_file) if validation_file is not None else None)
    url = db_url or default_db_url(root)
    sqlite_file(url)
    engine = engine_for(url)  # a URL that cannot work fails here, before anything is created (no connection yet)
    existed = root.exists()
    root.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    try:
        make_private(root)  # a directory the operator made beforehand too
        create_private_sqlite(url)
        with engine.connect() as conn:
            if inspect(conn).has_table("round"):
                raise StateError(f"the database {shown_url(url)} already holds a federation; give `init --db` an empty "
                                 "database, or serve the state directory made with this one")
        return _create(root, engine, src, base_model=base_model, db_url=db_url, template=template,
                       examples=examples, validation_file=validation_file, check=check)
    except BaseException:
        engine.dispose()
        if not existed:  # a refused base leaves nothing behind
            shutil.rmtree(root, ignore_errors=True)
        raise


def _create(root: Path, engine: Engine, src: Path, *, base_model: str, db_url: str | None, template: str | None,
            examples: list[dict], validation_file: Path | None, check: bool) -> ServerState:
    work = root / "work"
    work.mkdir(mode=PRIVATE_DIR, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        genesis = Path(tmp) / "genesis"
        genesis.mkdir()
        _normalised_copy(src, genesis)
        template_source = _set_chat_template(genesis, template)
        try:
            from zoo_gym.evaluation.chat import ChatTemplateError, check_template
            from zoo_gym.evaluation.evaluate import load_tokenizer

            check_template(load_tokenizer(genesis))
        except ChatTemplateError as exc:
            raise StateError(f"the chat template of this base cannot be used: {exc}") from None
        if check:
            check_base(genesis, examples)
        key, _ = signing.load_or_create_key(root / "server_key.pem")
        register_tables()
        with engine.begin() as conn:  # the current models' tables, stamped with the newest migration
            SQLModel.metadata.create_all(conn)
            migrations.stamp_head(conn)
        state = ServerState(root, engine, BlobStore(root / "blobs"), key, base_model, threading.RLock())
        public = public_base_name(base_model, src)  # published artifacts never carry the operator's path
        archive.write_lineage(genesis, {"round": 0, "parent_sha256": None, "base_model": public})
        with state.blobs.writer() as w:
            archive.pack(genesis, w)
            sha = w.commit()
        size = state.blobs.size(sha)
    validation_name = None
    if validation_file is not None:
        validation_name = "validation" + Path(validation_file).suffix.lower()
        shutil.copyfile(validation_file, root / validation_name)
        os.chmod(root / validation_name, PRIVATE_FILE)
        state.validation_file = root / validation_name
    with state.session() as s:
        s.add(Checkpoint(sha256=sha, round_id=0, parent_sha256=None, size=size,
                         manifest_json=json.dumps({"round": 0, "base_model": public})))
        s.add(Round(id=1, state=RoundState.OPEN, base_sha256=sha))
        s.commit()
    # the default database is stored as null: derived from the directory on open, so the directory can move
    meta = {"db_url": db_url, "base_model": base_model, "chat_template": template_source,
            "validation_file": validation_name}
    write_private(root / STATE_FILE, json.dumps(meta, indent=2) + "\n")
    return state
