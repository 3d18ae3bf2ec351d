"""QuantDescriptor (NVIDIA pytorch-quantization's ``ScaledQuantDescriptor``): fields, validation, dict()/YAML
round trips."""

import pytest

from quantcli import QuantDescriptor


def test_defaults_and_empty_dict():
    d = QuantDescriptor()
    assert d.num_bits == 8 and d.axis is None and d.calib_method == "max" and not d.unsigned
    assert d.fake_quant and not d.narrow_range and not d.dynamic and d.amax is None
    assert d.dict() == {}


def test_dict_only_non_defaults_and_round_trip():
    d = QuantDescriptor(
        num_bits=4, name="w", axis=(0, 1), amax=[1.0, 2.5], unsigned=True, calib_method="histogram"
    )
    assert d.dict() == {
        "num_bits": 4,
        "name": "w",
        "axis": (0, 1),
        "amax": [1.0, 2.5],
        "unsigned": True,
        "calib_method": "histogram",
    }
    assert QuantDescriptor(**d.dict()) == d


def test_yaml_round_trip_human_readable():
    d = QuantDescriptor(num_bits=(4, 3), axis=0, amax=[0.5, 1.5], scale_amax=2.0, narrow_range=True)
    y = d.to_yaml()
    assert "num_bits: [4, 3]" in y and "amax: [0.5, 1.5]" in y and "axis: 0" in y
    assert QuantDescriptor.from_yaml(y) == d
    b = QuantDescriptor(num_bits=4, block_sizes={-1: 128, "type": "static", "scale_bits": 8})
    assert QuantDescriptor.from_yaml(b.to_yaml()) == b


def test_fp8_tuple():
    d = QuantDescriptor(num_bits=(4, 3))
    assert d.is_fp8
    with pytest.raises(ValueError, match="E4M3"):
        QuantDescriptor(num_bits=(5, 2))
    with pytest.raises(ValueError, match="signed"):
        QuantDescriptor(num_bits=(4, 3), unsigned=True)


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"axis": 0, "block_sizes": {-1: 32}}, ValueError, "axis must be None"),
        ({"bogus": 1}, TypeError, "bogus"),
        ({"num_bits": 1}, ValueError, "between 2 and 16"),
        ({"num_bits": "8"}, TypeError, "num_bits"),
        ({"axis": 1.5}, TypeError, "axis"),
        ({"block_sizes": {-1: 0}}, ValueError, "positive"),
        ({"block_sizes": {-1: 32, "type": "lazy"}}, ValueError, "dynamic"),
        ({"block_sizes": [32]}, TypeError, "dict"),
        ({"calib_method": "entropy"}, ValueError, "histogram"),
        ({"amax": -1.0}, ValueError, ">= 0"),
        ({"unsigned": "yes"}, TypeError, "unsigned"),
        ({"scale_amax": 0}, ValueError, "positive"),
    ],
)
def test_validation(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        QuantDescriptor(**kwargs)


def test_block_sizes_dynamic_and_axes():
    d = QuantDescriptor(block_sizes={-1: 32, "type": "dynamic"})
    assert d.dynamic
    assert QuantDescriptor.get_block_quant_axes_and_sizes(d.block_sizes) == {-1: 32}


def test_block_sizes_from_json_string_keys():
    d = QuantDescriptor(block_sizes={"-1": 64})
    assert d.block_sizes == {-1: 64}


def test_replace_validates():
    d = QuantDescriptor(axis=0)
    assert d.replace(num_bits=4).num_bits == 4
    with pytest.raises(ValueError):
        d.replace(block_sizes={-1: 8})
