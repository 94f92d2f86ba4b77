import numpy as np
import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run the tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (CI does)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture(scope="session")
def digits_images():
    """Real images: scikit-learn's handwritten digits, 8x8 grey upscaled to RGB tensors in [0, 1]."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    return images.unsqueeze(1).repeat(1, 3, 1, 1), torch.tensor(digits.target)
