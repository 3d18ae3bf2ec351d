"""Names and small formulas defined once (issue 12) and read by several modules: each reader prints or
computes what it did before it used the shared definition. Expected values are written out by hand."""

import math

import pytest
import torch

from calibrators.methods import AMAX_METHODS
from quantcli.analysis.inspect import _format
from quantcli.analysis.quality import QualityMeter, cosine, snr_db
from quantcli.analysis.report_html import render
from quantcli.errors import first_line
from quantcli.nn.tensor_quantizer import TensorQuantizer
from quantcli.quant.descriptor import QuantDescriptor, to_plain
from quantcli.quant.formats import format_name
from quantcli.verify.stats import PairStats

FORMATS = [
    ({}, "int8"),
    ({"num_bits": 4}, "int4"),
    ({"num_bits": 4, "unsigned": True}, "uint4"),
    ({"num_bits": 16}, "int16"),
    ({"num_bits": (4, 3)}, "fp8-e4m3"),
    ({"asymmetric": True}, "uint8 asymmetric"),
    ({"num_bits": 6, "asymmetric": True}, "uint6 asymmetric"),
]


@pytest.mark.parametrize("kwargs, name", FORMATS)
def test_one_format_name_for_the_descriptor_inspect_and_the_module_repr(kwargs, name):
    d = QuantDescriptor(**kwargs)
    assert d.format_name == name
    assert _format(to_plain(d.dict())) == name  # inspect reads the checkpoint's plain dict
    q = TensorQuantizer(d, name="q")
    assert repr(q) == f"TensorQuantizer({name} per-tensor amax=None mode=quantize)"


def test_export_format_names_in_errors():
    assert format_name(8, False) == "int8"
    assert format_name(4, True, True) == "uint4 blocked"
    assert format_name((4, 3), False, True) == "fp8-e4m3"  # FP8 blocks are not named
    assert format_name([4, 3], False) == "fp8-e4m3"  # as a checkpoint stores it


def test_to_plain_turns_every_tuple_into_a_list():
    data = {
        "num_bits": (4, 3),
        "rules": [{"axis": (0, 1)}],
        "block_sizes": {-1: 128, "scale_bits": (4, 3)},
        "name": "w",
        "amax": [[1.0, 2.0]],
    }
    assert to_plain(data) == {
        "num_bits": [4, 3],
        "rules": [{"axis": [0, 1]}],
        "block_sizes": {-1: 128, "scale_bits": [4, 3]},
        "name": "w",
        "amax": [[1.0, 2.0]],
    }
    assert QuantDescriptor(num_bits=(4, 3), axis=(0, 1)).to_yaml() == "num_bits: [4, 3]\naxis: [0, 1]\n"


def test_cosine_and_snr_from_sums():
    # g = (1, 0), r = (1, 1): <g, r> = 1, |g|^2 = 1, |r|^2 = 2, |g - r|^2 = 1
    assert cosine(1.0, 1.0, 2.0) == pytest.approx(1 / math.sqrt(2))
    assert snr_db(2.0, 1.0) == pytest.approx(3.0103, abs=1e-4)
    assert cosine(0.0, 0.0, 2.0) is None and snr_db(0.0, 1.0) is None and snr_db(2.0, 0.0) == math.inf


def test_sensitivity_and_verify_agree_on_one_pair():
    g, r = torch.tensor([3.0, -1.0, 2.0, 0.5]), torch.tensor([2.5, -1.5, 2.0, 1.0])
    meter = QualityMeter()
    meter.add([g], [r])
    stats = PairStats()
    stats.add(g.numpy(), r.numpy())
    # by hand: <g, r> = 7.5 + 1.5 + 4 + 0.5 = 13.5; |g|^2 = 14.25; |r|^2 = 13.5; |g - r|^2 = 0.75
    assert meter.result().cosine == pytest.approx(13.5 / math.sqrt(14.25 * 13.5))
    assert stats.cosine == pytest.approx(13.5 / math.sqrt(14.25 * 13.5))
    assert meter.result().snr_db == pytest.approx(10 * math.log10(13.5 / 0.75))
    assert stats.snr_db == pytest.approx(10 * math.log10(13.5 / 0.75))


@pytest.mark.parametrize(
    "error, limit, want",
    [
        (ValueError("bad value\nat line 3"), None, "bad value"),
        (ValueError("\n  indented first\nsecond"), None, "indented first"),
        (KeyError(), None, "KeyError"),
        (RuntimeError("x" * 300), 200, "x" * 200),
    ],
)
def test_first_line(error, limit, want):
    assert first_line(error, limit) == want


def test_the_html_report_lists_the_methods_in_registry_order():
    page = render(
        {
            "checkpoint": "m.calib.pt",
            "num_samples": 8,
            "sensitivity_samples": 8,
            "overall": {"cosine": 1.0, "snr_db": 60.0},
            "seconds": {},
            "quantizers": [],
        }
    )
    header = page[page.index("<th>amax</th>") :]
    assert header.startswith("<th>amax</th><th>max</th><th>percentile</th><th>mse</th><th>entropy</th></tr>")
    assert AMAX_METHODS == ("max", "percentile", "mse", "entropy")


def test_entropy_is_undefined_for_fp8_only():
    from calibrators.methods import AMAX_METHODS, defined_for

    assert [m for m in AMAX_METHODS if not defined_for(m, is_fp8=True)] == ["entropy"]
    assert all(defined_for(m, is_fp8=False) for m in AMAX_METHODS)


def test_fp8_quantizer_refuses_entropy_but_takes_mse():
    import pytest
    import torch

    from quantcli.errors import CalibrationError
    from quantcli.nn.tensor_quantizer import TensorQuantizer
    from quantcli.quant.descriptor import QuantDescriptor

    q = TensorQuantizer(QuantDescriptor(num_bits=(4, 3)), name="q")
    q.start_calibration("entropy")
    q(torch.linspace(-3.0, 3.0, 1000))
    with pytest.raises(CalibrationError, match="entropy calibration is for integer formats"):
        q.load_calib_amax("entropy")
    assert 0.0 < float(q.load_calib_amax("mse")) <= 3.0 + 1e-6
