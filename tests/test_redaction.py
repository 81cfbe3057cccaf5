"""The auth token never reaches a log line, however vLLM or we print the config."""

from __future__ import annotations

import io
import json
import logging

import pytest

from afd_common import redaction

SECRET = "s3cret-value-with-'quote"


@pytest.mark.parametrize("render", [repr, json.dumps, str], ids=["repr", "json", "str"])
def test_auth_token_masked_in_any_rendering_of_the_config(render):
    args = {"additional_config": {"afd": {"role": "ffn", "connector_extra_config": {
        "auth_token": SECRET, "timeout_s": 15}}}}
    text = redaction.redact(f"non-default args: {render(args)}")
    assert "s3cret" not in text and redaction.MASK in text
    assert "timeout_s" in text and "ffn" in text


def test_env_token_masked_anywhere(monkeypatch):
    monkeypatch.setenv("AFD_AUTH_TOKEN", "tok-123456")
    assert redaction.redact("argv: --x tok-123456 --y") == f"argv: --x {redaction.MASK} --y"


def test_every_record_is_redacted_even_on_handlers_added_later():
    before = logging.getLogRecordFactory()
    try:
        redaction.install()
        installed = logging.getLogRecordFactory()
        redaction.install()  # idempotent: one wrapper
        assert logging.getLogRecordFactory() is installed is not before
        redaction.uninstall()
        assert logging.getLogRecordFactory() is before
        redaction.install()
        stream = io.StringIO()
        handler = logging.StreamHandler(stream)
        logger = logging.getLogger("vllm.test")
        logger.addHandler(handler)
        try:
            logger.warning("config %s", {"auth_token": SECRET})
        finally:
            logger.removeHandler(handler)
    finally:
        logging.setLogRecordFactory(before)
    out = stream.getvalue()
    assert "s3cret" not in out and "auth_token" in out
