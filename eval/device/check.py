"""The device check: one command that measures jaxkv on an NVIDIA GPU in under 8 minutes.

Usage, from the repository root of a fresh GPU machine (``PYTHON``: any Python >= 3.11)::

    make device-check PYTHON=python3   # makes .venv, pip install -e ".[cuda]", runs this script

The one install command (what ``make device-check`` runs; jax[cuda12], jax-triton, triton,
and torch for the transformers baseline)::

    pip install -e ".[cuda]"

then, in any environment that has those packages::

    python -m eval.device.check                            # eval/results/device_<gpu>.md (+ .json), printed
    python -m eval.device.check --parts kernels,attention  # only some parts (env always runs)
    python -m eval.device.check --limits e2e=240,quant=130  # longer limits for some parts
    python -m eval.device.check --dry-run --out /tmp/device_check.md   # the CPU dry run (make test runs it)
    python -m eval.device.check --model /data/SmolLM2-135M-Instruct   # a local HF folder as the real model
    python -m eval.device.check --render eval/results/device_NVIDIA_H100_80GB_HBM3.json  # re-render

On a machine whose image already has CUDA JAX, triton, torch and transformers, and
no network, jax-triton is usually the one missing package: it is a pure-Python wheel
(``pip download jax-triton --no-deps`` elsewhere, ``pip install --no-deps`` there).
Without it the Triton parts record ``BackendUnavailableError`` and everything else
still runs (on the jnp reference path).

**Parts and the planned split** (each part runs in its own process under a hard
time limit, so one slow or hung part cannot eat the budget; a part also stops
itself between measurements once 85% of its limit is spent; the limits add up to
450 s, under the 480 s budget, process starts and compiles included):

========== ======= ===========================================================
part       limit s what
========== ======= ===========================================================
env        30      device, driver, versions; copy bandwidth (2 GiB ``-x``:
                   bytes read + written) and a bf16 8192^3 matmul rate
kernels    75      every Triton kernel natively (jax-triton, not the
                   interpreter) against its jnp reference (float32 dots at
                   ``highest`` precision, not TF32) and a float64 numpy oracle,
                   at production shapes (``DEVICE`` below): float decode (bf16
                   Llama-3-8B and SmolLM2 layers to 32k tokens, fp32), INT4,
                   mixed INT2/INT4, masked INT2 pages + float part, RoPE delta
                   (Llama-3 scaling), INT4 quantizing write (bit-identical),
                   ragged attention (prefill chunks, decode rows, an absent
                   row and padding in one step)
attention  90      decode attention per kernel (bf16, INT4, mixed 2.7 bits) at
                   4k and 32k live tokens, batch 1 and 8 (Hq 32, Hkv 8, D 128):
                   per-call time vs bytes / copy bandwidth, and vs the same
                   attention in plain jnp under XLA on the same GPU; then, in
                   the time left, the ragged paged attention (the engine's one
                   attention per step: ``jaxkv.kernels.triton.ragged``): whole
                   prompts of 8,192 and 2,048 tokens in 2,048- and 512-token
                   chunks (Llama-3-8B and SmolLM2 heads, bf16) and a mixed step
                   (a chunk and 32 decode rows), achieved TFLOP/s as a share
                   of the bf16 matmul rate ``env`` measured and of the
                   roofline (``jaxkv.kernels.cost.ragged``)
e2e        180     end-to-end greedy decode, batch 1/8/32 x context 512/4096
                   (new decode rows start only in the first 60% of the limit),
                   then prefill of 512, 2048 and 8192 tokens, of
                   SmolLM2-135M-Instruct in bf16 (``jaxkv.load_model
                   ("smollm2-135m-instruct")``; when that does not load, the
                   random ~125M Qwen3 of ``eval/bench/decode.py``, and the report
                   says so) vs transformers on the same GPU with the same
                   weights (one model load and one CUDA start for both tables);
                   a prefill row's first call is timed apart (it compiles one
                   program per chunk read length, ~11-12 s each on an H200 at
                   128-row query blocks, ~6 s as one block: jaxkv.attention
                   .query_block),
                   and a row whose compiles would not fit the time left is
                   skipped with the reason recorded
quant      75      INT4 and TriAxial (65% INT2 pages, ~2.7 bits) pools vs the
                   float pool, per decode token at 32k, then 4k, live tokens
========== ======= ===========================================================

Timing: decode attention is timed as one jit that chains ``chain`` dependent calls
(each output is the next query), so per-call time excludes Python dispatch; inputs
rotate over copies when the working set would fit in L2. Engine and transformers
timings are wall time of whole calls after a warm-up, CUDA synchronized.

Results: after every part the report (``eval.device.report.render``, a pure function
of the results) and the results JSON are rewritten, so a part that fails or times
out leaves the rows it finished, and its table is marked. The parent process never
imports jax; each part's log is kept (``--logs``, a temp folder by default) and the
tail of a failed or killed part's log goes into the report.

The dry run (``--dry-run``) runs the same parts with ``DRY_RUN``'s tiny shapes on the
CPU: the Triton kernels in the Triton interpreter (``TRITON_INTERPRET=1``), the
references under XLA:CPU, transformers on the CPU. It needs the ``test`` extra and
marks every table "dry run"; ``tests/test_device_check.py`` runs it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a script: make `eval` importable
    sys.path.insert(0, str(REPO))

from eval.device import report as device_report  # noqa: E402  (no jax: the parent stays light)

BUDGET_S = 480.0
STOP_FRACTION = 0.85  # a part starts no new measurement past this share of its limit
DECODE_FRACTION = 0.6  # ... and e2e no new decode measurement past this share (prefill follows)
SMOLLM2 = "smollm2-135m-instruct"


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the check: run by ``PART_FUNCTIONS[name]`` in its own process, killed
    past ``limit_s`` seconds; ``what`` it measures, in words, for the report."""

    name: str
    limit_s: float
    what: str


PARTS = (
    Part("env", 30, "device, driver, versions; copy bandwidth and bf16 matmul rate"),
    Part("kernels", 75, "Triton kernels natively vs jnp references and float64 oracles"),
    Part("attention", 90, "decode attention per kernel vs the copy floor and XLA jnp"),
    Part("e2e", 180, "end-to-end decode, then prefill, vs transformers"),
    Part("quant", 75, "INT4 / TriAxial pools vs the float pool per decode token"),
)
PARTS_BY_NAME = {p.name: p for p in PARTS}


# ============================================================================ settings
@dataclasses.dataclass(frozen=True)
class Settings:
    """Every shape the check uses: ``DEVICE`` on a GPU, ``DRY_RUN`` on the CPU.

    Attributes:
      reps: timed repetitions per measurement (medians).
      copy_bytes, matmul_n: the copy-bandwidth array and the square bf16 matmul size.
      float_checks: ``(Hkv, G, D, dtype, lengths)`` of float decode checks.
      quant_checks: ``(Hkv, G, D, query dtype, INT2 pages or None (INT4 only), INT4 tokens)``.
      rope_shape, rope_moved: RoPE delta pool ``[L, S, Hkv, D]`` (bf16) and rows rotated.
      write_shape: INT4 write ``(T rows, Hkv, D, S slots)`` from bf16 rows.
      heads: ``(Hkv, G, D)`` of the attention timing; contexts, batches; chain: calls per jit.
      model: the real model's name (None: the random Qwen3 only); random_config: the
        random Qwen3's HF config.
      decode_batches, decode_contexts, decode_steps; prefill_lengths, prefill_repeats;
      quant_contexts, quant_steps: the engine parts' grid.
      ragged_checks: ``(Hkv, G, D, dtype, rows)`` of ragged attention checks, ``rows``
        ``(q_len, kv_len)`` per row of one step.
      ragged_prefills: ``(model, Hkv, G, D, tokens, chunk)`` whole prompts timed through
        the ragged kernel, in the order they run (the part may stop before the last).
      ragged_mixed: ``(model, Hkv, G, D, chunk, cached, decode rows, decode context)``
        of mixed steps timed: one chunk after ``cached`` entries plus the decode rows.
    """

    reps: int
    copy_bytes: int
    matmul_n: int
    float_checks: tuple
    quant_checks: tuple
    rope_shape: tuple
    rope_moved: int
    write_shape: tuple
    heads: tuple
    contexts: tuple
    batches: tuple
    chain: int
    model: str | None
    random_config: dict
    decode_batches: tuple
    decode_contexts: tuple
    decode_steps: int
    prefill_lengths: tuple
    prefill_repeats: int
    quant_contexts: tuple
    quant_steps: int
    ragged_checks: tuple = ()
    ragged_prefills: tuple = ()
    ragged_mixed: tuple = ()


def _qwen3_125m() -> dict:
    from eval.bench.decode import QWEN3_125M  # sets JAX_PLATFORMS only if unset: children set it first

    return QWEN3_125M


DEVICE = Settings(
    reps=10, copy_bytes=2 << 30, matmul_n=8192,
    float_checks=((8, 4, 128, "bfloat16", (1, 33, 1000, 4097, 32768)), (3, 3, 64, "bfloat16", (1, 511, 4096)),
                  (8, 4, 128, "float32", (1, 4097))),
    quant_checks=((8, 4, 128, "bfloat16", None, (1, 4097, 32768)), (8, 4, 128, "bfloat16", (40, 400, 1), (1000, 4097, 33)),
                  (3, 3, 64, "bfloat16", (128, 0), (1000, 3000))),
    rope_shape=(4, 16384, 8, 128), rope_moved=4096, write_shape=(512, 8, 128, 16384),
    heads=(8, 4, 128), contexts=(4096, 32768), batches=(1, 8), chain=16,
    model=SMOLLM2, random_config={},  # filled with QWEN3_125M when a part needs it
    decode_batches=(1, 8, 32), decode_contexts=(512, 4096), decode_steps=32,
    prefill_lengths=(512, 2048, 8192), prefill_repeats=3,
    quant_contexts=(32768, 4096), quant_steps=32,
    ragged_checks=((8, 4, 128, "bfloat16", ((200, 1000), (1, 4097), (1, 1), (0, 5), (64, 64), (2, 33))),
                   (3, 3, 64, "bfloat16", ((512, 2048), (1, 511), (1, 3000)))),
    ragged_prefills=(("Llama-3-8B", 8, 4, 128, 8192, 2048), ("SmolLM2-135M", 3, 3, 64, 8192, 2048),
                     ("Llama-3-8B", 8, 4, 128, 2048, 512), ("SmolLM2-135M", 3, 3, 64, 2048, 512)),
    ragged_mixed=(("Llama-3-8B", 8, 4, 128, 512, 1536, 32, 4096),),
)  # fmt: skip

TINY_QWEN3 = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    max_position_embeddings=512,
)  # fmt: skip

DRY_RUN = Settings(
    reps=1, copy_bytes=8 << 20, matmul_n=256,
    float_checks=((2, 3, 64, "bfloat16", (1, 33, 70)),),
    quant_checks=((2, 2, 64, "bfloat16", None, (33, 5)), (2, 2, 64, "float32", (1, 2), (31, 5))),
    rope_shape=(2, 100, 2, 64), rope_moved=40, write_shape=(40, 2, 64, 100),
    heads=(2, 2, 64), contexts=(64,), batches=(1,), chain=1,
    model=None, random_config=TINY_QWEN3,
    decode_batches=(2,), decode_contexts=(32,), decode_steps=2,
    prefill_lengths=(16,), prefill_repeats=1,
    quant_contexts=(64,), quant_steps=2,
    ragged_checks=((2, 3, 64, "bfloat16", ((20, 40), (1, 33), (0, 3), (2, 2))),),
    ragged_prefills=(("tiny", 2, 2, 64, 64, 32),),
    ragged_mixed=(("tiny", 2, 2, 64, 16, 16, 2, 40),),
)  # fmt: skip


def settings(dry_run: bool, model: str | None = None) -> Settings:
    """``DRY_RUN`` or ``DEVICE``; ``model`` (a name or folder) replaces the real model."""
    s = DRY_RUN if dry_run else dataclasses.replace(DEVICE, random_config=_qwen3_125m())
    return dataclasses.replace(s, model=model) if model else s


# ============================================================================ child side
def _jsonable(x):
    return x.item() if hasattr(x, "item") else str(x)


class Recorder:
    """A part's results as they come: ``info`` and ``rows``, rewritten to ``path`` after
    every change (the parent reads what is there even if the part is killed), and the
    part's soft deadline."""

    def __init__(self, path, limit_s: float):
        self.path = Path(path)
        self.started, self.limit_s = time.monotonic(), limit_s
        self.data = {"info": {}, "rows": [], "stopped": None}
        self.flush()

    @property
    def info(self) -> dict:
        return self.data["info"]

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=_jsonable))
        os.replace(tmp, self.path)

    def set(self, **info) -> None:
        self.info.update(info)
        self.flush()

    def add(self, row: dict) -> dict:
        """Append ``row`` (the caller may fill it further and ``flush``)."""
        self.data["rows"].append(row)
        self.flush()
        return row

    def seconds_left(self) -> float:
        """Seconds until the part's hard time limit."""
        return self.limit_s - (time.monotonic() - self.started)

    def stop(self, before: str) -> None:
        """Record that the part stops here, before ``before``."""
        self.data["stopped"] = f"stopped before {before}"
        self.flush()

    def out_of_time(self, before: str, share: float = STOP_FRACTION) -> bool:
        """True (and recorded) once ``share`` of the part's time limit is spent."""
        if time.monotonic() - self.started < share * self.limit_s:
            return False
        self.stop(before)
        return True

    def error(self, what: str, exc: BaseException) -> None:
        """Record a measurement that raised (the part goes on); traceback to the log."""
        traceback.print_exc()
        self.info.setdefault("errors", []).append(f"{what}: {type(exc).__name__}: {exc}")
        self.flush()

    def measure(self, row: dict, key: str, fn) -> str | None:
        """``row[key] = fn()``; when it raises, None, an error note, and the error's text returned."""
        err = None
        try:
            row[key] = fn()
        except Exception as e:  # one measurement's failure must not lose the others
            row[key], err = None, f"{type(e).__name__}: {e}"
            where = ", ".join(f"{k} {v}" for k, v in row.items() if k != key and not isinstance(v, float))
            self.error(f"{key} ({where})", e)
        self.flush()
        print(f"  {key} = {row[key]}", flush=True)
        return err


def _launcher(dry_run: bool):
    """The Triton launcher: the interpreter in the dry run, jax-triton on the GPU."""
    if dry_run:
        from jaxkv.kernels.triton.interpret import interpret_call

        return interpret_call
    from jaxkv.kernels.triton.launch import check_triton_call, triton_call

    check_triton_call()
    return triton_call


def part_env(rec: Recorder, s: Settings, dry_run: bool) -> None:
    import importlib.metadata
    import platform

    import jax
    import jax.numpy as jnp

    from eval.bench.kernels import copy_bandwidth, median_call_seconds
    from jaxkv.errors import BackendUnavailableError
    from jaxkv.kernels import resolve_backend

    dev = jax.devices()[0]
    packages = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "jax-triton", "triton", "torch", "transformers")
    versions = {}
    for name in packages:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions = {k: v for k, v in versions.items() if v or "plugin" not in k}
    rec.set(device=dev.device_kind, platform=jax.default_backend(), python=platform.python_version(), versions=versions,
            compute_capability=getattr(dev, "compute_capability", None), jaxkv_commit=_git_commit())  # fmt: skip
    rec.set(**_nvidia_smi())
    if dry_run:
        rec.set(kernel_backend="Triton interpreter (dry run)")
    else:
        try:
            rec.set(kernel_backend=resolve_backend("gpu") + " (Triton through jax-triton)")
        except BackendUnavailableError as e:
            rec.set(kernel_backend="reference", kernel_backend_note=str(e))
    rec.set(copy_bandwidth=copy_bandwidth(s.reps, s.copy_bytes))
    n = s.matmul_n
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    seconds = median_call_seconds(jax.jit(jnp.dot), [(a, b)], s.reps)
    rec.set(matmul_flops=2 * n**3 / seconds, matmul_shape=f"{n}x{n}x{n}")


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _nvidia_smi() -> dict:
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError) as e:
        return {"driver": f"n/a (nvidia-smi: {type(e).__name__})"}
    if out.returncode != 0 or not out.stdout.strip():
        return {"driver": f"n/a (nvidia-smi exit {out.returncode})"}
    name, driver, memory = [x.strip() for x in out.stdout.strip().splitlines()[0].rsplit(",", 2)]
    return {"gpu_name": name, "driver": driver, "memory": memory}


# ---------------------------------------------------------------------------- kernels
def _error_fields(out, ref, wants, tol) -> dict:
    import numpy as np

    from jaxkv.kernels.testing import rel_err, request_errors

    finite = bool(np.isfinite(np.asarray(out, np.float32)).all())
    vs_ref, vs_f64 = rel_err(out, ref), request_errors(out, wants)
    return dict(vs_reference=vs_ref, vs_f64=vs_f64, bound=f"<= {tol:.0e}", passed=finite and vs_ref <= tol and vs_f64 <= tol,
                note=None if finite else "non-finite output")  # fmt: skip


def _exact_reference(fn, *args, **kw):
    """A jnp reference (jit'd: one compile beats one per op) with float32 dots computed
    in float32 (XLA uses TF32 on a GPU by default)."""
    import jax

    with jax.default_matmul_precision("highest"):
        return jax.jit(functools.partial(fn, **kw))(*args)


def check_float_decode(launcher, K, G, D, dtype, lengths, seed):
    import jax

    from jaxkv.attention import decode_attention_reference
    from jaxkv.kernels.triton import decode as gpu_decode
    from jaxkv.kernels.testing import decode_f64, decode_problem, tolerance

    args = decode_problem(seed, K, G, D, dtype, lengths)
    out = jax.jit(functools.partial(gpu_decode.decode_attention, launcher=launcher))(*args)
    ref = _exact_reference(decode_attention_reference, *args)
    return _error_fields(out, ref, decode_f64(*args), tolerance(dtype))


def check_quantized_decode(launcher, K, G, D, dtype, pages, tokens, seed):
    import jax

    from jaxkv.kernels.triton import decode as gpu_decode
    from jaxkv.kernels.attention.quantized import quantized_decode_attention_reference
    from jaxkv.kernels.testing import mixed_quantized_problem, quantized_attention_f64, tolerance

    args = mixed_quantized_problem(seed, K, G, D, pages or (0,) * len(tokens), tokens, dtype)
    wants = quantized_attention_f64(*args)
    if pages is None:  # INT4 only: no INT2 launch at all
        args = (args[0], None, None, None, *args[4:])
    out = jax.jit(functools.partial(gpu_decode.quantized_decode_attention, launcher=launcher))(*args)
    ref = _exact_reference(quantized_decode_attention_reference, *args)
    return _error_fields(out, ref, wants, tolerance(dtype))


def check_masked_pages(launcher, seed):
    import jax

    from jaxkv.kernels.triton import decode as gpu_decode
    from jaxkv.kernels.attention.quantized import quantized_decode_attention_reference
    from jaxkv.kernels.testing import masked_float_problem, tolerance

    args, kw, wants = masked_float_problem(seed)
    out = jax.jit(functools.partial(gpu_decode.quantized_decode_attention, launcher=launcher, **kw))(*args)
    ref = _exact_reference(quantized_decode_attention_reference, *args, **kw)
    return _error_fields(out, ref, wants, tolerance(args[0].dtype))


def check_rope_delta(launcher, shape, moved, seed):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.kernels.triton import rope as gpu_rope
    from jaxkv.kernels.rope_delta import rope_delta_reference
    from jaxkv.kernels.testing import LLAMA3_ROPE, rel_err, rope_delta_problem, tolerance

    pool, slots, delta = rope_delta_problem(seed, shape, jnp.bfloat16, moved)
    out = jax.jit(functools.partial(gpu_rope.rope_delta, rope=LLAMA3_ROPE, launcher=launcher))(pool, slots, delta)
    ref = _exact_reference(rope_delta_reference, pool, slots, delta, rope=LLAMA3_ROPE)
    untouched = np.setdiff1d(np.arange(shape[1]), np.asarray(slots))
    kept = bool(np.array_equal(np.asarray(out)[:, untouched], np.asarray(pool)[:, untouched]))
    tol = tolerance(jnp.bfloat16)
    err = rel_err(out, ref)
    return dict(vs_reference=err, vs_f64=None, bound=f"<= {tol:.0e}, others untouched", passed=err <= tol and kept,
                note="rows not moved bit-identical" if kept else "**rows not moved changed**")  # fmt: skip


def check_int4_write(launcher, T, K, D, S, seed):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxkv.kernels.triton import quant_write
    from jaxkv.kernels.kv_write import write_int4_rows_reference
    from jaxkv.kernels.testing import decode_codes_np, int4_fit_np, int4_write_problem

    rows, slots, x = int4_write_problem(seed, T, K, D, S, jnp.bfloat16)
    got = jax.jit(functools.partial(quant_write.write_int4_rows, launcher=launcher))(rows, slots, x)
    want = write_int4_rows_reference(rows, slots, x)
    pairs = [(np.asarray(a), np.asarray(b)) for a, b in zip((got.data, got.scale, got.zero), (want.data, want.scale, want.zero))]
    differing = sum(int(np.sum(a != b)) for a, b in pairs)
    total = sum(a.size for a, _ in pairs)
    # the written rows against the numpy float32 oracle: tells a kernel fault from an XLA one
    at = np.asarray(slots)
    codes, scale, zero = int4_fit_np(x)
    off_oracle = sum(
        int(np.sum(a != b))
        for a, b in (
            (decode_codes_np(np.asarray(got.data)[at], 4), codes),
            (np.asarray(got.scale)[at], scale),
            (np.asarray(got.zero)[at], zero),
        )
    )
    return dict(vs_reference=differing / total, vs_f64=None, bound="bit-identical", passed=differing == 0 and off_oracle == 0,
                note=f"{differing} of {total} codes/scales/zeros differ from the XLA reference, "
                     f"{off_oracle} of the written ones from the numpy float32 oracle")  # fmt: skip


def check_ragged(launcher, K, G, D, dtype, rows, seed):
    import jax
    import numpy as np

    from jaxkv.attention import ragged_attention_reference
    from jaxkv.kernels.triton import ragged as gpu_ragged
    from jaxkv.kernels.testing import ragged_f64, ragged_problem, tolerance

    args = ragged_problem(seed, K, G, D, dtype, rows, pad=8)
    out = jax.jit(functools.partial(gpu_ragged.ragged_attention, launcher=launcher))(*args)
    ref = _exact_reference(ragged_attention_reference, *args)
    want = ragged_f64(*args)
    owned = np.abs(want).max(axis=(1, 2)) > 0  # padding tokens: zero, no oracle to divide by
    fields = _error_fields(out, ref, [w if o else None for w, o in zip(want, owned)], tolerance(dtype))
    padding_zero = bool((np.asarray(out, np.float32)[~owned] == 0).all())
    fields["passed"] = fields["passed"] and padding_zero
    if not padding_zero:
        fields["note"] = "**padding tokens not zero**"
    return fields


def kernel_checks(s: Settings) -> list:
    """``(kernel, shape, check(launcher) -> fields)`` for every check of ``s``."""
    checks = []
    for i, (K, G, D, dtype, lengths) in enumerate(s.float_checks):
        shape = f"Hq {K * G}, Hkv {K}, D {D}, {dtype}, lengths {lengths}"
        checks.append(("decode float", shape, functools.partial(check_float_decode, K=K, G=G, D=D, dtype=dtype, lengths=lengths, seed=i)))
    for i, (K, G, D, dtype, pages, tokens) in enumerate(s.quant_checks):
        name = "decode INT4" if pages is None else "decode INT2 pages + INT4"
        shape = f"Hq {K * G}, Hkv {K}, D {D}, {dtype} queries, " + (f"pages {pages}, " if pages else "") + f"INT4 tokens {tokens}"
        checks.append(
            (name, shape, functools.partial(check_quantized_decode, K=K, G=G, D=D, dtype=dtype, pages=pages, tokens=tokens, seed=10 + i))
        )
    checks.append(
        (
            "decode masked INT2 pages + float part",
            "Hq 4, Hkv 2, D 64, float32 (the engine's dual pool)",
            functools.partial(check_masked_pages, seed=7),
        )
    )
    L, S, K, D = s.rope_shape
    checks.append(
        (
            "RoPE delta (Llama-3 scaling)",
            f"L {L}, S {S}, Hkv {K}, D {D}, bf16, {s.rope_moved} rows, |delta| < 5000",
            functools.partial(check_rope_delta, shape=s.rope_shape, moved=s.rope_moved, seed=3),
        )
    )
    T, K, D, S = s.write_shape
    checks.append(
        (
            "INT4 quantizing write",
            f"{T} bf16 rows into {S} slots, Hkv {K}, D {D}",
            functools.partial(check_int4_write, T=T, K=K, D=D, S=S, seed=4),
        )
    )
    for i, (K, G, D, dtype, rows) in enumerate(s.ragged_checks):
        shape = f"Hq {K * G}, Hkv {K}, D {D}, {dtype}, (q_len, kv_len) per row {rows}, 8 padding tokens"
        check = functools.partial(check_ragged, K=K, G=G, D=D, dtype=dtype, rows=rows, seed=20 + i)
        checks.append(("ragged attention", shape, check))
    return checks  # fmt: skip


def part_kernels(rec: Recorder, s: Settings, dry_run: bool) -> None:
    launcher = _launcher(dry_run)
    how = "the Triton interpreter (dry run)" if dry_run else "Triton through jax-triton, compiled for this GPU"
    rec.set(caption=f"Kernels run by {how}; the jnp reference under XLA with float32 dots at `highest` precision; "
                    "the float64 oracle in numpy (`jaxkv.kernels.testing`); bounds are the CPU tests' own.")  # fmt: skip
    for kernel, shape, check in kernel_checks(s):
        if rec.out_of_time(f"{kernel} ({shape})"):
            return
        row = rec.add({"kernel": kernel, "shape": shape})
        try:
            row.update(check(launcher))
        except Exception as e:  # one kernel's failure must not hide the others' results
            traceback.print_exc()
            row.update(passed=False, error=f"{type(e).__name__}: {e}")
        rec.flush()
        print(f"{kernel} [{shape}]: {'pass' if row.get('passed') else 'FAIL'} {row}", flush=True)


# ---------------------------------------------------------------------------- attention
def chained_seconds(fn, q, operand_sets, chain: int, reps: int) -> float:
    """Seconds per call of ``fn(q, *operands)``: median over ``reps`` runs of one jit
    chaining ``chain`` dependent calls (each output is the next query; the operand sets
    rotate), divided by ``chain``."""
    import statistics

    import jax

    @jax.jit
    def run(q, sets):
        for i in range(chain):
            q = fn(q, *sets[i % len(sets)])
        return q

    jax.block_until_ready(run(q, operand_sets))  # compile + warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(q, operand_sets))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / chain


def part_attention(rec: Recorder, s: Settings, dry_run: bool) -> None:
    import jax
    import jax.numpy as jnp

    from eval.bench.kernels import CACHE_BYTES, decode_cases, input_copies
    from jaxkv.errors import BackendUnavailableError

    K, G, D = s.heads
    try:
        launcher, kernel_error = _launcher(dry_run), None
    except BackendUnavailableError as e:
        launcher, kernel_error = None, str(e)
    rec.set(attention_caption=f"Hq {K * G}, Hkv {K}, D {D}, bf16 queries and pool, every request holding the live tokens in random "
                    f"slots; mixed = 65% of tokens in INT2 pages, the rest INT4. Per call: median of {s.reps} runs of one jit "
                    f"chaining {s.chain} dependent calls, / {s.chain}; operand copies rotate up to {CACHE_BYTES >> 20} MiB. "
                    "Floor = bytes that must move (`jaxkv.kernels.cost`) / copy bandwidth. XLA jnp = `backend=\"reference\"` "
                    "(gather, dequantize, einsum) on the same device.")  # fmt: skip
    for ctx in s.contexts:
        for B in s.batches:
            if rec.out_of_time(f"{ctx} tokens x {B}"):
                return
            q, cases = decode_cases(ctx, B, K, G, D, jax.random.key(ctx + B))
            for case in cases:
                copies = input_copies(case.cost.bytes)
                sets = [case.operands] + [jax.tree.map(jnp.copy, case.operands) for _ in range(copies - 1)]
                row = rec.add(dict(kernel=case.name, ctx=ctx, batch=B, bytes=case.cost.bytes, kernel_error=kernel_error))
                if launcher is not None:
                    row["kernel_error"] = rec.measure(
                        row, "kernel_s", lambda: chained_seconds(case.triton(launcher), q, sets, s.chain, s.reps)
                    )
                xla = functools.partial(case.public, backend="reference")
                rec.measure(row, "xla_s", lambda: chained_seconds(xla, q, sets, s.chain, s.reps))
                del sets
            del q, cases
    ragged_timings(rec, s, launcher, kernel_error)


def ragged_steps(s: Settings) -> list[tuple[dict, list]]:
    """``(row, calls)`` of every ragged timing of ``s``, in order: ``row`` the report's
    fields (``table: "ragged"``, model, heads, step, flops, executed_flops, bytes: the
    sums over the calls, ``jaxkv.kernels.cost.ragged``), ``calls`` the ``(q_len,
    kv_len)`` rows of each call. A prompt is one call per chunk (the chunk after the
    ones before it), a mixed step one call."""
    from jaxkv.kernels import cost

    out = []

    def add(model, K, G, D, step, calls):
        costs = [cost.ragged(c, K * G, K, D) for c in calls]
        row = dict(table="ragged", model=model, heads=f"{K * G}/{K} x {D}", step=step, calls=len(calls),
                   flops=sum(c.flops for c in costs), executed_flops=sum(c.executed_flops for c in costs),
                   bytes=sum(c.bytes for c in costs), Hkv=K, G=G, D=D)  # fmt: skip
        out.append((row, calls))

    for model, K, G, D, tokens, chunk in s.ragged_prefills:
        calls = [[(chunk, end)] for end in range(chunk, tokens + 1, chunk)]
        add(model, K, G, D, f"prefill {tokens} tokens in {chunk}-token chunks", calls)
    for model, K, G, D, chunk, cached, decode_rows, ctx in s.ragged_mixed:
        add(
            model,
            K,
            G,
            D,
            f"mixed: {chunk}-token chunk after {cached} + {decode_rows} decode rows at {ctx}",
            [[(chunk, cached + chunk)] + [(1, ctx)] * decode_rows],
        )
    return out


def ragged_operands(calls, K, G, D, key):
    """``(q [T, Hq, D], operand sets)``: a bf16 pool, every row's list random distinct
    slots (a pool's scattered pages), one ``(k, v, live, kv_len, q_start, q_len)`` per
    call; all calls of a prompt share ``T`` and the lists, only the lengths differ."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    R = len(calls[0])
    T = max(sum(n for n, _ in c) for c in calls)
    N = max(kv for c in calls for _, kv in c)
    S = R * N + 1
    ks = jax.random.split(key, 3)
    k = jax.random.normal(ks[0], (S, K, D), jnp.bfloat16)
    v = jax.random.normal(ks[1], (S, K, D), jnp.bfloat16)
    q = jax.random.normal(ks[2], (T, K * G, D), jnp.bfloat16)
    rng = np.random.default_rng(0)
    live = jnp.asarray(rng.permutation(S - 1)[: R * N].reshape(R, N) + 1, jnp.int32)
    sets = []
    for c in calls:
        q_len = np.asarray([n for n, _ in c], np.int32)
        starts = np.concatenate([[0], np.cumsum(q_len)[:-1]]).astype(np.int32)
        sets.append((k, v, live, jnp.asarray([kv for _, kv in c], jnp.int32), jnp.asarray(starts), jnp.asarray(q_len)))
    return q, sets


def ragged_timings(rec: Recorder, s: Settings, launcher, kernel_error) -> None:
    """The ragged attention rows (``table: "ragged"``): seconds for all the calls of a
    prompt or step, each call timed as ``chained_seconds`` does (calls chained, the
    chunks' lengths rotating)."""
    import jax

    from jaxkv.kernels.triton import ragged as gpu_ragged

    rec.set(ragged_caption="bf16 queries and pool, each row's list random slots of the pool. A prompt is one call per "
                           "chunk (the chunk after those before it: lengths are data, so its calls share one program); "
                           f"per call: median of {s.reps} runs of one jit chaining {s.chain} dependent calls (the "
                           f"chunks rotating), / {s.chain}; ms = the prompt's calls. TFLOP/s counts the attention's "
                           "causal work (`jaxkv.kernels.cost.ragged`: 4 D + 5 per query head and entry it sees); "
                           "executed adds the tiles' padded rows and masked diagonal. Roofline = max(bytes / copy "
                           "bandwidth, flops / bf16 matmul rate) / time.")  # fmt: skip
    for i, (row, calls) in enumerate(ragged_steps(s)):
        if rec.out_of_time(f"ragged {row['model']} {row['step']}"):
            return
        row = rec.add(dict(row, kernel_error=kernel_error))
        if launcher is None:
            continue
        q, sets = ragged_operands(calls, row["Hkv"], row["G"], row["D"], jax.random.key(100 + i))
        fn = functools.partial(gpu_ragged.ragged_attention, launcher=launcher)
        per_call = lambda: chained_seconds(fn, q, sets, s.chain, s.reps)  # noqa: E731
        row["kernel_error"] = rec.measure(row, "kernel_s", lambda: len(calls) * per_call())
        del q, sets


# ---------------------------------------------------------------------------- engine parts
def _models(s: Settings, folder: str, dry_run: bool, with_torch: bool, max_context: int | None = None):
    """``(transformers model or None, jaxkv model (bf16), parameter count, description)``:
    ``s.model`` when it loads, else the random Qwen3 of ``s.random_config``. The
    transformers model holds the same bf16 weights, on the GPU (the CPU in the dry run)."""
    import jax

    import jaxkv
    from eval.bench.decode import build_models
    from eval.bench.quant_decode import build_model

    model, why = None, None
    if s.model:
        try:
            model = jaxkv.load_model(s.model, dtype="bfloat16")
            desc = f"{s.model} (`jaxkv.load_model({s.model!r})`)"
        except Exception as e:  # a missing name, no network, a bad file: fall back, and say why
            why = f"{type(e).__name__}: {e}"
    tm = None
    if model is None:
        name = "tiny random Qwen3" if dry_run else "random ~125M Qwen3 (`eval.bench.decode.QWEN3_125M`)"
        desc = name + (f", because {s.model!r} did not load ({why})" if why else "")
        if with_torch:
            tm, model, _, _ = build_models(folder, config=s.random_config, dtype="bfloat16")
        else:
            model = build_model(max_context or s.random_config["max_position_embeddings"], "bfloat16", s.random_config)
    elif with_torch:
        tm = _transformers_copy(model, folder)
    if max_context and model.config.max_position_embeddings < max_context:  # timing only: positions past training are fine
        model = dataclasses.replace(model, config=dataclasses.replace(model.config, max_position_embeddings=max_context))
    n_params = sum(x.size for x in jax.tree.leaves(model.split()[1]))
    return tm, model, n_params, desc


def _transformers_copy(model, folder):
    """transformers' model of a loaded jaxkv model, through jaxkv's HF export (same weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxkv.models.loading import save_pretrained

    save_pretrained(model, folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()


def _place_torch(rec: Recorder, tm, dry_run: bool):
    """The transformers model in bf16 on the GPU (the CPU in the dry run), or None and
    an error note when torch has no CUDA device (the jaxkv rows are still measured)."""
    import torch

    if dry_run:
        return tm.to(torch.bfloat16)
    if not torch.cuda.is_available():
        rec.error("transformers baseline", RuntimeError(f"torch {torch.__version__} sees no CUDA device"))
        return None
    return tm.to(device="cuda", dtype=torch.bfloat16)


def _backend_words(dry_run: bool) -> str:
    import warnings

    from jaxkv.kernels import resolve_backend

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = resolve_backend(None)
    return f"`{backend}`" + (f" ({caught[0].message})" if caught else "")


def _transformers_words(tm) -> str:
    import transformers

    from eval.bench.decode import torch_place

    if tm is None:
        return "no transformers baseline (see Failures)"
    device, dtype = torch_place(tm)
    return f"transformers {transformers.__version__} ({tm.config._attn_implementation}) on {device}, {dtype}"


def part_e2e(rec: Recorder, s: Settings, dry_run: bool) -> None:
    """Decode rows (``table: "decode"``) until ``DECODE_FRACTION`` of the limit, then prefill
    rows (``table: "prefill"``): one model load and one transformers copy for both."""
    from eval.bench import decode as bench_decode, prefill as bench_prefill
    from jaxkv.engine import PREFILL_CHUNK

    with tempfile.TemporaryDirectory() as folder:
        tm, model, n_params, desc = _models(s, folder, dry_run, with_torch=True)
        tm = _place_torch(rec, tm, dry_run)
        cfg = model.config
        rec.set(model=desc, caption=f"{desc}, {n_params / 1e6:.0f}M parameters, bf16 weights and KV; jaxkv decode kernels "
                                    f"{_backend_words(dry_run)}; {_transformers_words(tm)}.",
                decode_caption=f"{s.decode_steps} greedy steps timed after a warm-up, random KV contents in both; "
                               "transformers: the faster of a manual cache loop and `generate`. Floor = batch x copy "
                               "bandwidth / (weights + the batch's KV), the bytes one step must read.",
                prefill_caption=f"Batch 1 from an empty cache. jaxkv `Engine.prefill` (chunk {PREFILL_CHUNK}, logits of the "
                                "last token); transformers one forward with all logits or the last. Medians of "
                                f"{s.prefill_repeats} after a warm-up; the first call, timed apart, compiles one program per "
                                "chunk width and read length (`programs`) on a fresh engine. TFLOP/s counts the matmul work "
                                "(`eval.bench.prefill.prefill_flops`); % of the bf16 matmul rate measured by `env`.")  # fmt: skip
        for batch in s.decode_batches:
            for ctx in s.decode_contexts:
                if rec.out_of_time(f"decode batch {batch}, context {ctx}", DECODE_FRACTION):
                    break
                bytes_per_step = bench_decode.decode_bytes_per_step(cfg, n_params, batch, ctx, 2)
                row = rec.add(dict(table="decode", batch=batch, ctx=ctx, bytes_per_step=bytes_per_step))
                rec.measure(row, "jaxkv_tok_s", lambda: bench_decode.bench_jaxkv(model, batch, ctx, s.decode_steps))
                if tm is not None:
                    rec.measure(row, "hf_loop_tok_s", lambda: bench_decode.bench_torch(tm, batch, ctx, s.decode_steps))
                    rec.measure(row, "hf_generate_tok_s", lambda: bench_decode.bench_torch_generate(tm, batch, ctx, s.decode_steps))
        compile_s = None  # seconds per prefill program on this device, from the rows measured so far
        for T in s.prefill_lengths:
            if rec.out_of_time(f"prefill of {T} tokens"):
                return
            programs = bench_prefill.prefill_programs(T, PREFILL_CHUNK)
            row = rec.add(dict(table="prefill", tokens=T, flops=bench_prefill.prefill_flops(cfg, T, 1), programs=programs))
            left = rec.seconds_left()
            if compile_s is not None and programs * compile_s > left:
                row["skipped"] = (f"{programs} programs to compile at ~{compile_s:.0f} s each (the rows above): "
                                  f"~{programs * compile_s:.0f} s, {left:.0f} s left")  # fmt: skip
                rec.stop(f"prefill of {T} tokens ({row['skipped']})")
                return
            rec.measure(row, "jaxkv_timing", lambda: bench_prefill.time_jaxkv(model, T, PREFILL_CHUNK, s.prefill_repeats))
            if row["jaxkv_timing"] is not None:
                row["jaxkv_first_s"], row["jaxkv_s"] = row.pop("jaxkv_timing")
                compile_s = max(compile_s or 0.0, (row["jaxkv_first_s"] - row["jaxkv_s"]) / programs)
                rec.flush()
            if tm is not None:
                rec.measure(row, "hf_all_s", lambda: bench_prefill.bench_torch(tm, T, s.prefill_repeats, keep_last=False))
                rec.measure(row, "hf_last_s", lambda: bench_prefill.bench_torch(tm, T, s.prefill_repeats, keep_last=True))


QUANT_POOLS = (("float", "float"), ("int4", "int4"), ("mixed", "triaxial (65% INT2 pages, ~2.7 bits)"))


def part_quant(rec: Recorder, s: Settings, dry_run: bool) -> None:
    from eval.bench import quant_decode as bench_quant_decode

    longest = max(s.quant_contexts) + s.quant_steps + 64
    with tempfile.TemporaryDirectory() as folder:
        _, model, n_params, desc = _models(s, folder, dry_run, with_torch=False, max_context=longest)
        rec.set(model=desc, caption=f"{desc}, bf16 weights, batch 1; `Engine(kv_quant=None | \"int4\" | \"triaxial\")`, "
                                    f"decode kernels {_backend_words(dry_run)}; {s.quant_steps} greedy steps timed after a "
                                    "warm-up over random pool contents (`eval.bench.quant_decode.bench`).")  # fmt: skip
        for ctx in s.quant_contexts:
            for mode, label in QUANT_POOLS:
                if rec.out_of_time(f"{mode} pool, {ctx} tokens"):
                    return
                row = rec.add(dict(ctx=ctx, batch=1, pool=label if mode != "float" else "float"))
                rec.measure(row, "measured", lambda: bench_quant_decode.bench(model, mode, ctx, s.quant_steps))
                if row["measured"] is not None:
                    tok_s, kv_bytes = row.pop("measured")
                    row.update(s_per_token=1.0 / tok_s, kv_bytes=kv_bytes)
                    rec.flush()


PART_FUNCTIONS = {
    "env": part_env, "kernels": part_kernels, "attention": part_attention, "e2e": part_e2e, "quant": part_quant,
}  # fmt: skip


def check_platform(dry_run: bool) -> None:
    """Fail a part at once, saying why, when JAX has no CUDA device (outside the dry run)."""
    import jax

    if dry_run:
        return
    try:
        jax.devices()
    except Exception as e:  # jaxlib without CUDA, no driver, no GPU: JAX's errors vary
        raise RuntimeError(
            f"JAX found no CUDA device (JAX_PLATFORMS=cuda; {type(e).__name__}: {e}); install the cuda extra "
            "(pip install -e '.[cuda]') on a GPU machine, or run the CPU dry run (--dry-run)"
        ) from e


def child_main(name: str, result_path: str, limit_s: float, dry_run: bool, model: str | None) -> None:
    rec = Recorder(result_path, limit_s)
    check_platform(dry_run)
    PART_FUNCTIONS[name](rec, settings(dry_run, model), dry_run)
    rec.flush()


# ============================================================================ parent side
def child_env(dry_run: bool, part: str) -> dict:
    """The environment of a part's process: the repository importable; the CPU and the
    Triton interpreter in the dry run, CUDA otherwise (never the interpreter)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    if dry_run:
        env.update(JAX_PLATFORMS="cpu", TRITON_INTERPRET="1")
    else:
        env["JAX_PLATFORMS"] = "cuda"
        env.pop("TRITON_INTERPRET", None)
        if part == "e2e":  # torch shares the GPU with JAX in this part
            env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    return env


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_part(part: Part, *, dry_run: bool, limit_s: float, logs: Path, model: str | None = None) -> dict:
    """Run one part in its own process group under ``limit_s`` (killed past it) and
    return its entry of the results: what it recorded, its status, time and error."""
    result_path, log_path = logs / f"{part.name}.json", logs / f"{part.name}.log"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "eval.device.check", "--child", part.name, "--result", str(result_path),
           "--limit", f"{limit_s:.1f}"] + (["--dry-run"] if dry_run else []) + (["--model", model] if model else [])  # fmt: skip
    t0 = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(dry_run, part.name), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)  # the part's own process group: it and what it started
            rc = proc.wait()
    seconds = time.monotonic() - t0
    try:
        recorded = json.loads(result_path.read_text())
    except (OSError, json.JSONDecodeError):
        recorded = {"info": {}, "rows": [], "stopped": None}
    if timed_out:
        status = "timed out"
    elif rc != 0:
        status = "failed"
    else:
        status = "stopped at deadline" if recorded.get("stopped") else "ok"
    error = None
    if status in ("timed out", "failed"):
        error = f"exit code {rc}; last lines of {log_path}:\n{_tail(log_path)}"
    return dict(what=part.what, limit_s=limit_s, seconds=seconds, status=status, error=error,
                stopped=recorded.get("stopped"), info=recorded.get("info", {}), rows=recorded.get("rows", []))  # fmt: skip


def report_path(results: dict, out: str | None) -> Path:
    if out:
        return Path(out)
    if results["dry_run"]:
        return Path(tempfile.gettempdir()) / "jaxkv_device_check_dry_run.md"
    info = results["parts"].get("env", {}).get("info", {})
    name = info.get("gpu_name") or info.get("device") or "unknown"
    return REPO / "eval" / "results" / f"device_{re.sub(r'[^A-Za-z0-9]+', '_', name).strip('_')}.md"


def write_outputs(results: dict, path: Path) -> str:
    """The report at ``path`` and the results beside it (``.json``); returns the report."""
    text = device_report.render(results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.with_suffix(".json").write_text(json.dumps(results, indent=1, default=_jsonable) + "\n")
    return text


def run_check(parts: list[Part], *, dry_run: bool, out: str | None, logs: Path, command: str,
              model: str | None = None, budget_s: float = BUDGET_S) -> tuple[dict, Path]:  # fmt: skip
    """Every part in order under the overall budget; outputs rewritten after each."""
    started = time.monotonic()
    results = dict(dry_run=dry_run, command=command, budget_s=budget_s, seconds=0.0,
                   started=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
                   parts={p.name: dict(what=p.what, limit_s=p.limit_s, seconds=None, status="not run", error=None,
                                       info={}, rows=[]) for p in parts})  # fmt: skip
    path = None
    for part in parts:
        left = budget_s - (time.monotonic() - started)
        limit = min(part.limit_s, left - 5)
        if limit < 10:
            results["parts"][part.name]["error"] = f"not started: {left:.0f} s of the {budget_s:.0f} s budget left"
            continue
        print(f"[device check] {part.name}: {part.what} (limit {limit:.0f} s) ...", flush=True)
        entry = results["parts"][part.name] = run_part(part, dry_run=dry_run, limit_s=limit, logs=logs, model=model)
        print(f"[device check] {part.name}: {entry['status']} in {entry['seconds']:.1f} s, {len(entry['rows'])} rows", flush=True)
        if entry["error"]:
            print(entry["error"], flush=True)
        results["seconds"] = time.monotonic() - started
        path = path or report_path(results, out)
        write_outputs(results, path)
    return results, path or report_path(results, out)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Install on a fresh GPU machine: pip install -e '.[cuda]' (make device-check PYTHON=python3 does it "
               "and runs the check). Parts and time limits: see the module docstring.",
    )  # fmt: skip
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, Triton interpreter (make test runs it)")
    ap.add_argument("--out", help="report path (default eval/results/device_<gpu name>.md; the results JSON goes beside it)")
    ap.add_argument("--parts", help=f"comma-separated subset of {','.join(PARTS_BY_NAME)} (env always runs)")
    ap.add_argument("--logs", help="folder for each part's log and raw results (default: a new temp folder)")
    ap.add_argument(
        "--model",
        help=f"the real model: a jaxkv.load_model name or HF folder (default {SMOLLM2!r}; the random Qwen3 when it does not load)",
    )
    ap.add_argument(
        "--limits",
        metavar="PART=S,...",
        help="other time limits for some parts, e.g. e2e=240,quant=110 (the overall budget grows to "
        "their sum plus 30 s when that is more than the default)",
    )
    ap.add_argument("--render", metavar="RESULTS_JSON", help="only re-render the report of a recorded results file")
    ap.add_argument("--child", choices=sorted(PART_FUNCTIONS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child_main(args.child, args.result, args.limit, args.dry_run, args.model)
        return ""
    if args.render:
        text = device_report.render(json.loads(Path(args.render).read_text()))
        if args.out:
            Path(args.out).write_text(text)
        print(text)
        return text
    names = [n for n in (args.parts or "").split(",") if n]
    unknown = [n for n in names if n not in PARTS_BY_NAME]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; expected some of {list(PARTS_BY_NAME)}")
    limits = {}
    for item in (args.limits or "").split(","):
        name, _, seconds = item.partition("=")
        if not item:
            continue
        if name not in PARTS_BY_NAME or not seconds.replace(".", "", 1).isdigit():
            ap.error(f"--limits: expected PART=SECONDS with PART one of {list(PARTS_BY_NAME)}, got {item!r}")
        limits[name] = float(seconds)
    parts = [
        dataclasses.replace(p, limit_s=limits.get(p.name, p.limit_s)) for p in PARTS if not names or p.name in names or p.name == "env"
    ]
    budget_s = max(BUDGET_S, sum(p.limit_s for p in parts) + 30)
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="jaxkv_device_check_"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[device check] logs in {logs}", flush=True)
    command = shlex.join(["python", "-m", "eval.device.check"] + list(argv if argv is not None else sys.argv[1:]))
    results, path = run_check(parts, dry_run=args.dry_run, out=args.out, logs=logs, command=command, model=args.model, budget_s=budget_s)
    text = write_outputs(results, path)
    print(text)
    print(f"[device check] report: {path}; results: {path.with_suffix('.json')}", flush=True)
    return text


if __name__ == "__main__":
    main()
