"""Shared fixtures: one small tokenizer trained once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge.data import load_or_train_tokenizer


@pytest.fixture(scope="session")
def tokenizer_settings() -> dict[str, int]:
    """Small enough to train in well under a second."""
    return {"vocab_size": 512, "max_files": 30}


@pytest.fixture(scope="session")
def tokenizer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tokenizer-cache")


@pytest.fixture(scope="session")
def small_tokenizer(tokenizer_cache: Path, tokenizer_settings: dict[str, int]):
    return load_or_train_tokenizer(tokenizer_cache, **tokenizer_settings)
