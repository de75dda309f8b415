"""Profile the server's aggregate-and-publish step in-process (issue 13 item 7: its time at a real size).

Runs what `publish_round` runs between `phase=load` and `phase=commit`, without the database, the RPC
server or scoring: StoredDeltas over memory-mapped LoRA payloads -> DeltaSoup (mean, the configured
DP settings) -> CheckpointWriter (the base read in place from its archive blob; the new archive blob and
the master blob, each hashed as it is written) -> commits. Prints JSON: seconds per part, the read + write baseline of
benchmarks/scale.py, and optionally a cProfile of the whole step.

    python benchmarks/publish_profile.py --model /tmp/q06 [--rounds 2] [--profile 30]

`--rounds 2` publishes a second round on top of the first (it then reads the master).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import lora_deltas, read_write_seconds  # noqa: E402

from zoo_gym import codec  # noqa: E402
from zoo_gym.aggregation import DeltaSoup, SoupConfig  # noqa: E402
from zoo_gym.proto import archive  # noqa: E402
from zoo_gym.server.store.blobs import BlobStore  # noqa: E402
from zoo_gym.server.store import master_weights  # noqa: E402
from zoo_gym.io.safetensors_reader import SafetensorsReader  # noqa: E402
from zoo_gym.server.store.checkpoint_writer import CheckpointWriter, threads_beside_writers  # noqa: E402
from zoo_gym.server.rounds.publish import StoredDeltas  # noqa: E402


def publish_once(store: BlobStore, base_sha: str, master_sha: str | None, payload_shas: list[str],
                 soup: dict, seed: int) -> tuple[dict, str, str | None]:
    t: dict[str, float] = {}
    t0 = time.perf_counter()
    base_archive = store.path(base_sha)
    with SafetensorsReader.in_archive(base_archive) as r:
        shapes = r.shapes()
        keep_master = master_weights.needs_master(r.infos)
    with ExitStack() as stack:
        payloads = [stack.enter_context(store.mapped(s)) for s in payload_shas]
        stored = StoredDeltas(payloads, ["a", "b"], shapes)
        ckpt_blob = stack.enter_context(store.writer(streamed=True))
        master_blob = stack.enter_context(store.writer(streamed=True)) if keep_master else None
        master = stack.enter_context(SafetensorsReader(store.path(master_sha), streamed=True)) if master_sha else None
        writer = CheckpointWriter(base_archive, master=master, changed=stored.names(), ckpt_blob=ckpt_blob,
                                  master_blob=master_blob)
        stack.callback(writer.close)
        t1 = time.perf_counter()
        t["load"] = t1 - t0
        with threads_beside_writers():  # as publish_round
            DeltaSoup(SoupConfig.from_mapping(soup)).run(stored, writer.sink, lend_aggregates=True,
                                                         generator=torch.Generator().manual_seed(seed))
        t2 = time.perf_counter()
        t["aggregation"] = t2 - t1
        writer.finish_weights()
        new_master = master_blob.commit() if master_blob is not None else None
        writer.finish({"round": seed, "master_sha256": new_master})
        t3 = time.perf_counter()
        t["write"] = t3 - t2
        sha = ckpt_blob.commit()
        t["pack"] = time.perf_counter() - t3
    t["total"] = time.perf_counter() - t0
    return t, sha, new_master


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=Path("/tmp/q06"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--dp-noise-multiplier", type=float, default=0.0)
    ap.add_argument("--profile", type=int, default=0, help="print the top N cProfile rows (cumulative)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--work", type=Path)
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="zoo-publish-"))
    work.mkdir(parents=True, exist_ok=True)
    store = BlobStore(work / "blobs")
    base = work / "base"
    shutil.copytree(args.model, base, dirs_exist_ok=True)
    deltas = lora_deltas(base, n=2, rank=8, rms=2e-5)
    shas = []
    for d in deltas:
        with store.writer() as w:
            w.write(codec.encode(d, codec="auto"))
            shas.append(w.commit())
    del deltas
    with store.writer() as w:  # the base as the server stores it: a checkpoint archive blob
        archive.pack(base, w)
        base_sha = w.commit()
    soup = {"aggregator": "mean"}
    if args.dp_noise_multiplier:
        soup.update(dp_noise_multiplier=args.dp_noise_multiplier, dp_clip=1.0, dp_expected_contributors=len(shas))
    res: dict = {"torch_threads": torch.get_num_threads(), "soup": soup, "rounds": []}
    master = None
    prof = cProfile.Profile() if args.profile else None
    for i in range(args.rounds):
        if prof:
            prof.enable()
        t, base_sha, master = publish_once(store, base_sha, master, shas, soup, seed=i + 1)
        if prof:
            prof.disable()
        res["rounds"].append({**t, "sha256": base_sha, "master_sha256": master,
                              "bytes_written": store.size(base_sha) + (store.size(master) if master else 0)})
    if not args.no_baseline:
        res["read_write_model_s"] = read_write_seconds(args.model / archive.WEIGHTS, work)
        res["total_over_read_write"] = [r["total"] / res["read_write_model_s"] for r in res["rounds"]]
    print(json.dumps(res, indent=2))
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.profile)
        print(s.getvalue()[-12000:])
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.profile)
        print(s.getvalue()[-12000:])
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
