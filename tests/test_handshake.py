"""Handshake and authentication between spawned ranks: refusals name the field, both sides stop."""

import pytest

from afd_common.selftest import Spec, run_world

pytestmark = pytest.mark.multiproc


def errors(results):
    return {(r.role, r.rank): (r.status, str(r.detail)) for r in results}


@pytest.mark.parametrize("changes,field", [
    ({"hidden_size": 32}, "hidden_size"),
    ({"num_layers": 3}, "num_layers"),
    ({"stages": 1}, "num_micro_batches"),
    ({"dtype": "bfloat16"}, "dtype"),
], ids=["hidden_size", "num_layers", "micro_batches", "dtype"])
def test_mismatch_refused_by_both_sides(changes, field):
    spec = Spec(1, 1, steps=1, timeout_s=20, ffn_changes=changes)
    results = run_world(spec, deadline_s=60)
    for key, (status, detail) in errors(results).items():
        assert status == "error", (key, detail)
        assert "AFDHandshakeError" in detail and f"'{field}' differs" in detail, detail
        assert all(r.seconds < 30 for r in results)


def test_wrong_auth_token_refused_and_never_logged():
    spec = Spec(1, 1, steps=1, timeout_s=20, extra={"auth_token": "right-token-123"},
                ffn_changes={"extra": {"auth_token": "wrong-token-456"}})
    for key, (status, detail) in errors(run_world(spec, deadline_s=60)).items():
        assert status == "error" and "authentication failed" in detail, (key, detail)
        assert "token-123" not in detail and "token-456" not in detail


def test_missing_auth_token_refused():
    spec = Spec(1, 1, steps=1, timeout_s=20, extra={"auth_token": "right-token-123"},
                ffn_changes={"extra": {}})
    got = errors(run_world(spec, deadline_s=60))
    assert "authentication failed" in got[("attention", 0)][1]
    assert "this role has none" in got[("ffn", 0)][1]


def test_right_auth_token_works():
    spec = Spec(2, 1, steps=2, timeout_s=20, extra={"auth_token": "shared-secret"})
    results = run_world(spec, deadline_s=60)
    assert all(r.status == "ok" for r in results), errors(results)
