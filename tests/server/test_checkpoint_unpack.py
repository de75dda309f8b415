"""The evaluator reads a checkpoint's config and tokenizer from its weight-less unpack while a submission
asks for the same checkpoint with its weights: adding the weights must never take the other files away."""

from __future__ import annotations

import hashlib
import threading

from zoo_gym.proto import archive


def test_adding_the_weights_never_hides_the_files_a_reader_is_using(federation):
    state = federation.state
    sha = federation.round().base_sha256
    light, _ = state.checkpoint_files(sha)  # the evaluator's unpack: everything but the weights
    assert not (light / archive.WEIGHTS).exists()
    names = sorted(p.name for p in light.iterdir())
    stop, missing, reads = threading.Event(), [], [0]

    def read_forever():
        while not stop.is_set():
            for name in names:
                try:
                    (light / name).read_bytes()
                except FileNotFoundError as exc:
                    missing.append(str(exc))
            reads[0] += 1

    reader = threading.Thread(target=read_forever, daemon=True)
    reader.start()
    try:
        full = state.checkpoint_dir(sha)  # a submission against this base needs the weights too
    finally:
        stop.set()
        reader.join(timeout=30)
    assert full == light and reads[0] > 0
    assert missing == [], missing[:3]
    offset, size = archive.members(state.blobs.path(sha))[archive.WEIGHTS]
    with open(state.blobs.path(sha), "rb") as f:
        f.seek(offset)
        want = hashlib.sha256(f.read(size)).hexdigest()
    assert hashlib.sha256((full / archive.WEIGHTS).read_bytes()).hexdigest() == want
    assert not [p for p in full.iterdir() if p.name.startswith(".")]  # no temporary file left behind
