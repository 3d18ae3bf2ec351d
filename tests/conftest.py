import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# CLIs started in a subprocess inherit this and quantize every layer as configured (what their tests assert
# was written for every layer); in-process runs (tests.helpers.cli) unset it and keep the default, auto.
os.environ["QUANTCLI_PLACEMENT"] = "all"

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)
