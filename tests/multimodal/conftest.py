"""The tiny LLaVA checkpoint of the multimodal tests (built once per session: mm_helpers.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from mm_helpers import build_tiny_idefics3, build_tiny_llava


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava"), tiny_tokenizer_dir)


@pytest.fixture(scope="session")
def llava_siglip_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny-llava-siglip"), tiny_tokenizer_dir, tower="siglip")


@pytest.fixture(scope="session")
def idefics3_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return build_tiny_idefics3(tmp_path_factory.mktemp("tiny-idefics3"), tiny_tokenizer_dir)
