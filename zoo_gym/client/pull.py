"""`gym-client pull`: the federation's latest published checkpoint as a plain Hugging Face directory.

The download is the join loop's own (from the server's signed mirrors first when it names any, resumable,
sha256-verified before it is unpacked, cached under the work directory), and checked the same way: the
RoundInfo that names the checkpoint must carry the signature of the server key pinned for that address
(`known_servers` in the work directory; trusted on first use), and the unpacked lineage manifest the same
key's signature (one published before lineages were signed: that RoundInfo naming its sha256, said in one
line). The result is copied to OUT with a model card (README.md) built from the checkpoint's lineage
manifest, so `AutoModelForCausalLM.from_pretrained(OUT)` loads it; with ``fmt="gguf"`` OUT holds one .gguf
file for llama.cpp (zoo_gym.proto.gguf_export) and the card instead. OUT is readable by others.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

from zoo_gym.client.connection import open_stub, with_retries
from zoo_gym.client import known_servers
from zoo_gym.client.download import DownloadError, fetch
from zoo_gym.client.server_signatures import verify_round_info
from zoo_gym.proto import archive, gym_pb2
from zoo_gym.proto.model_card import card_inputs_from_dir, make_readable, weights_sha256, write_model_card_from_dir


class PullError(RuntimeError):
    """Nothing to pull, or OUT cannot be written; the message says what to do."""


def pull(server: str, out: Path, *, workdir: Path, progress: bool = False, root_certificates: str | None = None,
         insecure: bool = False, say: Callable[[str], None] = print, fmt: str = "hf",
         quantization: str = "f16") -> dict:
    """Download the latest published checkpoint into `out` (must be absent or empty) as a Hugging Face
    directory (`fmt` "hf") or a GGUF file (`fmt` "gguf"). Returns a summary."""
    out = Path(out)
    if fmt not in ("hf", "gguf"):
        raise PullError(f"--format must be hf or gguf, got {fmt!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PullError(f"{out} exists and is not an empty directory; choose a new OUT")
    channel, stub = open_stub(server, root_certificates=root_certificates, insecure=insecure)
    try:
        info = with_retries(lambda: stub.GetRound(gym_pb2.GetRoundRequest(), timeout=30), what="GetRound",
                            say=say)
        known = known_servers.KnownServers(known_servers.default_path(Path(workdir)))
        try:
            server_key = known.trust(server, bytes(info.server_public_key), say=say)
            verify_round_info(info, server_key=server_key, address=server)
        except known_servers.UntrustedServer as exc:
            raise DownloadError(str(exc)) from None
        if info.base_checkpoint_id < 1:
            raise PullError(f"round {info.round_id} still trains on the genesis checkpoint: nothing has been "
                            "published yet")
        fetched = fetch(stub, info.base_sha256, info.base_size, Path(workdir), progress=progress,
                        retry=lambda call: with_retries(call, what="download", say=say),
                        server_key=server_key, round_info=info, say=say)
    finally:
        channel.close()
    card = _write_out(fetched.model_dir, out, sha256=info.base_sha256, fmt=fmt, quantization=quantization)
    return {"round": info.base_checkpoint_id, "sha256": info.base_sha256, "out": str(out), "card": str(card),
            "files": sorted(p.name for p in out.iterdir()), "lineage": archive.LINEAGE, "source": fetched.source}


def _write_out(model_dir: Path, out: Path, *, sha256: str, fmt: str, quantization: str) -> Path:
    """Copy (hf) or convert (gguf) the cached checkpoint into `out` with its card; return the card."""
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "gguf":
        from zoo_gym.proto.gguf_export import GGUFExportError, write_gguf_dir

        rows, base = card_inputs_from_dir(model_dir, sha256=sha256)
        try:
            write_gguf_dir(model_dir, out, rows, base_model=base, quantization=quantization,
                           weights=weights_sha256(model_dir))
        except GGUFExportError as exc:
            raise PullError(str(exc)) from None
        card = out / "README.md"
    else:
        for p in sorted(model_dir.iterdir()):
            if p.is_file():
                shutil.copyfile(p, out / p.name)
        card = write_model_card_from_dir(out, sha256=sha256)
    make_readable(out)
    return card
