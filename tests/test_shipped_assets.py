"""Shipped assets follow the weights: SmolLM2's IntentKV head and TriAxialKV
calibration in ``jaxkv/assets/smollm2-135m-instruct/`` are found for the model
loaded by name, from a copy of its converted folder or from its GGUF file (each
a folder jaxkv does not know by path), and not for other weights in the same
folder; the user's own head or calibration comes first
(``jaxkv.models.registry.find_artifact``, keyed by ``loading.weights_id``).
"""

from __future__ import annotations

import copy
import json
import shutil

import jax
import pytest
from flax import nnx

import jaxkv
from jaxkv.errors import ConfigError
from jaxkv.models import registry
from jaxkv.models.loading import weights_id
from jaxkv.policies.intentkv_head import HEAD_FOLDER
from jaxkv.policies.quant_allocation import load_allocation
from jaxkv.serving.stages.quantization import CALIBRATION_FILE, resolve_allocation
from jaxkv.serving.stages.retention import head_folder_of

from test_real_model import NAME

SHIPPED = registry.SHIPPED_ASSETS / NAME


@pytest.fixture(scope="module")
def by_name(smollm2_gguf):
    return jaxkv.load_model(NAME)


@pytest.fixture(scope="module")
def from_folder(smollm2_gguf, tmp_path_factory):
    """The converted folder's files linked into a folder of the user's: the same
    weights at a path jaxkv does not know."""
    folder = tmp_path_factory.mktemp("smollm2-copy")
    for f in registry.converted_dir(NAME).iterdir():
        if f.name != "converted.json":
            (folder / f.name).symlink_to(f)
    return jaxkv.load_model(folder)


@pytest.fixture(scope="module")
def from_gguf(smollm2_gguf, tmp_path_factory):
    link = tmp_path_factory.mktemp("smollm2-gguf") / smollm2_gguf.name
    link.symlink_to(smollm2_gguf)
    return jaxkv.load_model(link)


def test_the_manifest_records_the_weights_of_every_way_to_load_them(by_name, from_folder, from_gguf):
    manifest = json.loads((SHIPPED / registry.WEIGHTS_MANIFEST).read_text())
    assert by_name.weights_id() == from_folder.weights_id() == from_gguf.weights_id() == manifest["weights_id"]
    assert registry.reference_name_of(from_folder.path) is None and registry.reference_name_of(from_gguf.path) is None
    bf16 = jaxkv.load_model(from_folder.path, dtype="bfloat16")
    assert bf16.weights_id() == manifest["weights_id"]  # values rounded to bfloat16 before hashing


@pytest.mark.parametrize("load", ["by_name", "from_folder", "from_gguf"])
def test_sessions_find_the_shipped_head_and_calibration(load, request):
    model = request.getfixturevalue(load)
    session = jaxkv.Session(model, policy="intentkv", budget=64, kv_quant="triaxial", max_positions=512, max_new_tokens=2)
    try:
        assert session.retention.config.head == str(SHIPPED / HEAD_FOLDER)
        shipped = load_allocation(SHIPPED / CALIBRATION_FILE, "triaxial")
        assert session.quantization.budget == shipped.budget
        assert (session.quantization.table == shipped.table()).all()
        if load == "from_gguf":  # one turn on the real weights with both
            reply = session.chat([{"role": "user", "content": "Name a colour."}])
            assert reply["role"] == "assistant"
    finally:
        session.close()


def retuned(model):
    """``model`` with its final norm's scale doubled: the same folder, config and
    shapes, other values (as a fine-tune of it would be). A copy: ``model`` keeps its weights."""
    graphdef, state = nnx.split(nnx.clone(model.module))
    pure = nnx.to_pure_dict(state)
    pure["norm"] = jax.tree.map(lambda a: a * 2, pure["norm"])
    nnx.replace_by_pure_dict(state, pure)
    other = copy.copy(model)
    vars(other).pop("_split", None)  # the copy's own module, split afresh
    other.module = nnx.merge(graphdef, state)
    return other


def test_other_weights_in_the_same_folder_get_none(by_name):
    """Other weights of the same shapes (``retuned``) keep the model's folder but not
    its identity: neither the head nor the calibration is shipped for them."""
    other = retuned(by_name)
    assert other.path == by_name.path and other.weights_id() != by_name.weights_id()
    assert weights_id(by_name.config, by_name.module) == by_name.weights_id()  # by_name's own weights untouched
    assert head_folder_of(other) != SHIPPED / HEAD_FOLDER
    elsewhere = copy.copy(other)
    elsewhere.path = None  # nor by path: only the weights could find a shipped asset
    assert head_folder_of(elsewhere) is None
    with pytest.raises(ConfigError, match="calibration"):
        resolve_allocation(elsewhere, "triaxial", None)
    with pytest.raises(ConfigError, match="head"):
        jaxkv.Session(elsewhere, policy="intentkv", budget=64, max_positions=512)


def test_the_users_own_calibration_wins(from_folder, tmp_path, monkeypatch):
    """Order: the model's folder, then ``<cache>/models/<name>/``, then the shipped file."""
    user = from_folder.path / CALIBRATION_FILE
    cache = tmp_path / "cache"
    monkeypatch.setenv("JAXKV_CACHE", str(cache))
    data = json.loads((SHIPPED / CALIBRATION_FILE).read_text())

    def calibration(budget):  # the shipped tables at another calibrated B: a file that is not the shipped one
        return json.dumps({**data, "variants": {k: {**v, "budget": budget} for k, v in data["variants"].items()}})

    try:
        assert resolve_allocation(from_folder, "triaxial", None) == load_allocation(SHIPPED / CALIBRATION_FILE)
        registry.model_dir(NAME).mkdir(parents=True)
        (registry.model_dir(NAME) / CALIBRATION_FILE).write_text(calibration(3.0))
        assert resolve_allocation(from_folder, "triaxial", None).budget == 3.0  # the cache, found through the weights
        user.write_text(calibration(2.5))
        assert resolve_allocation(from_folder, "triaxial", None).budget == 2.5  # the model's own folder first
        session = jaxkv.Session(from_folder, kv_quant="triaxial", max_positions=512)
        assert session.quantization.budget == 2.5
        session.close()
    finally:
        user.unlink(missing_ok=True)
        shutil.rmtree(cache, ignore_errors=True)
