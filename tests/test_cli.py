"""`make run`'s command: the demo streams answers from the in-process engine."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_streams_an_answer_to_a_chat_prompt():
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "demo", "--prompt", "What is the capital of France?", "--max-tokens", "12"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "[chat] What is the capital of France?" in result.stdout
    assert "Paris" in result.stdout
    assert "tokens, first token" in result.stdout
