import os

import pytest
import torch

from fp8kit.models import build_checkpoint

os.environ.setdefault("TQDM_DISABLE", "1")


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A seeded random Llama whose Linear sizes are all multiples of 128."""
    return build_checkpoint(tmp_path_factory.mktemp("src") / "llama", "llama", torch.bfloat16, seed=1)


@pytest.fixture(scope="session")
def odd_llama_dir(tmp_path_factory):
    """MLP width 320: not a multiple of 128, so block FP8 must leave the MLP alone."""
    return build_checkpoint(tmp_path_factory.mktemp("src") / "odd", "llama", torch.bfloat16, seed=2,
                            intermediate_size=320)


OVERLAY = '''# my uploads
[[variant]]
repo_id = "me/Qwen3-8B-FP8-Dynamic"
family = "qwen3"
scheme = "dynamic"
format = "compressed-tensors"
serves = ["dynamic"]
base = ["Qwen/Qwen3-8B"]
'''


@pytest.fixture
def overlay_text():
    """A registry overlay of one upload of the user's own, with a comment that writes must keep."""
    return OVERLAY
