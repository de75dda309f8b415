"""A CI-sized client population (issue 51): benchmarks/population.py's contributors, each with its own key, TLS
channel, invitation and signed upload, against a real `gym-server serve --admission invite`, one sync round.

Every honest contributor is accepted into the published round; each hostile one is refused where and why it
should be (a norm outlier at aggregation, a wrong shape, a forged signature and a second upload at the upload, an
uninvited Sybil at registration); the ledger holds an entry per stored upload and verifies, from the operator's
side and from a contributor's (`gym-client rewards --verify`)."""

from __future__ import annotations

import pytest

from benchmarks.population import run

pytestmark = pytest.mark.slow

N = 500  # above the 256 rows from which copies come from a sketch, and the 48 from which the trimmed mean selects
PER_ROLE = N // 4 // 5  # a quarter hostile, five roles in turn


def test_a_population_of_five_hundred_is_accepted_refused_and_paid_as_it_should_be(tmp_path):
    r = run(N, mode="sync", hostile=0.25, kinds="mixed", concurrency=16, work=tmp_path, timeout=600)
    assert r["outcome"].startswith("published"), r["outcome"]
    assert r["honest"] == N - N // 4 and r["honest_accepted"] == r["honest"], r["by_role"]
    assert r["by_role"]["outlier"] == {"refused-at-aggregation": PER_ROLE}
    assert r["by_role"]["wrong-shape"] == {"upload": PER_ROLE} and r["by_role"]["forged"] == {"upload": PER_ROLE}
    assert r["by_role"]["twice"] == {"second-upload": PER_ROLE} and r["by_role"]["sybil"] == {"register": PER_ROLE}
    reasons = " | ".join(r["refusals"])
    for why in ("aggregation: delta L<n> norm <n> exceeds max_norm_ratio",
                "upload: INVALID_ARGUMENT: tensor 'model.layers.<n>.", "has shape",
                "upload: UNAUTHENTICATED: submission header signature",
                "second-upload: ALREADY_EXISTS", "register: PERMISSION_DENIED: this server admits new contributors "
                "by invitation only"):
        assert why in reasons, (why, r["refusals"])
    assert r["surfaces"]["ledger_verify"] == {**r["surfaces"]["ledger_verify"], "ok": True,
                                              "entries": r["stored_uploads_expected"]}
    assert r["surfaces"]["rewards_verify"]["ok"] is True, r["surfaces"]["rewards_verify"]
    assert all("error" not in page for page in r["surfaces"]["dashboard"].values()), r["surfaces"]["dashboard"]
    assert r["server"]["peak_gib"] > 0 and r["disk_bytes"]["blobs"] > 0
