"""Cluster presets load with their sourced numbers; bad cluster specs fail with one line naming the field."""

from __future__ import annotations

import pytest

from moestack.config.base import ConfigError
from moestack.config.cluster import ClusterSpec, list_cluster_presets, load_cluster_spec

EXPECTED = {"cloudmatrix384", "gb200-nvl72", "h100-cluster", "h200-cluster", "h800-cluster", "a100-cluster",
            "h200-1gpu", "cpu"}


def test_all_presets_load():
    assert EXPECTED <= set(list_cluster_presets())
    for name in EXPECTED:
        cl = load_cluster_spec(name)
        assert cl.name == name
        assert cl.device.peak_flops("bf16") > 0


def test_cloudmatrix384_numbers():
    cl = load_cluster_spec("cloudmatrix384")
    assert cl.num_devices == 384
    assert cl.device.peak_tflops["bf16"] == 752.0
    assert cl.device.hbm_gib == 128.0 and cl.device.hbm_bandwidth_gb_s == 3200.0
    assert [t.name for t in cl.tiers] == ["ub", "roce"]
    assert cl.tiers[0].domain_size == 384 and cl.tiers[0].bandwidth_gb_s == 392.0
    assert cl.tiers[1].bandwidth_gb_s == 50.0  # 400 Gb/s
    assert "fp8" not in cl.device.peak_tflops  # 910C has no FP8 units
    with pytest.raises(ConfigError, match="no fp8 peak"):
        cl.device.peak_flops("fp8")
    # 384 x 128 GB is the "49 TB super node" of MODEL.md
    assert 384 * 128e9 == pytest.approx(49.2e12, rel=0.01)


def test_gpu_presets():
    nvl = load_cluster_spec("gb200-nvl72")
    assert nvl.tier_domain(0) == 72 and nvl.tiers[0].bandwidth_gb_s == 900.0
    assert nvl.device.peak_tflops["bf16"] == 2500.0
    for name in ("h100-cluster", "h200-cluster", "h800-cluster", "a100-cluster"):
        cl = load_cluster_spec(name)
        assert cl.tiers[0].domain_size == 8
    h800, h100 = load_cluster_spec("h800-cluster"), load_cluster_spec("h100-cluster")
    assert h800.tiers[0].bandwidth_gb_s < h100.tiers[0].bandwidth_gb_s
    assert load_cluster_spec("h200-1gpu").num_devices == 1


def test_with_devices():
    cm = load_cluster_spec("cloudmatrix384")
    assert cm.with_devices(768).num_devices == 768  # two super nodes over RoCE
    assert cm.with_devices(768).tier_domain(0) == 384
    assert cm.with_devices(64).tier_domain(0) == 64
    with pytest.raises(ConfigError, match="multiple of the ub domain"):
        cm.with_devices(400)
    h = load_cluster_spec("h200-cluster")
    assert h.with_devices(2048).num_devices == 2048
    with pytest.raises(ConfigError, match="multiple of the nvlink domain"):
        h.with_devices(12)
    with pytest.raises(ConfigError, match="single device"):
        load_cluster_spec("h200-1gpu").with_devices(2)


def test_user_yaml_and_errors(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text(
        "name: mine\nnum_devices: 16\ndevice: {name: x, peak_tflops: {bf16: 100.0}, hbm_gib: 10,"
        " hbm_bandwidth_gb_s: 1000}\ntiers:\n  - {name: a, domain_size: 4, bandwidth_gb_s: 100}\n"
        "  - {name: b, bandwidth_gb_s: 10}\n"
    )
    cl = load_cluster_spec(good)
    assert cl.tier_domain(1) == 16
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.read_text().replace("hbm_gib: 10", "hbm_gb: 10"))
    with pytest.raises(ConfigError) as err:
        load_cluster_spec(bad)
    assert "\n" not in str(err.value) and "device.hbm_gib" in str(err.value)
    shrinking = good.read_text().replace("domain_size: 4", "domain_size: 32").replace(
        "{name: b, bandwidth_gb_s: 10}", "{name: b, domain_size: 8, bandwidth_gb_s: 10}")
    (tmp_path / "s.yaml").write_text(shrinking)
    with pytest.raises(ConfigError, match="must grow"):
        load_cluster_spec(tmp_path / "s.yaml")
    with pytest.raises(ConfigError, match="neither a preset"):
        load_cluster_spec("no-such-cluster")


def test_multi_device_needs_tiers():
    with pytest.raises(ValueError, match="no network tiers"):
        ClusterSpec(name="x", num_devices=4, device={"name": "d", "peak_tflops": {"bf16": 1.0}, "hbm_gib": 1,
                                                      "hbm_bandwidth_gb_s": 1})
