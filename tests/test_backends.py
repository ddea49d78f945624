"""One attention entry, one backend per pool kind and platform (``jaxkv.backends``).

* ``select_backend`` picks the table's backend once per engine.
* A quantized pool's decode loop reaches the fused quantized kernels through the
  engine (``QuantKernelBackend``, the Pallas kernel in interpret mode): every layer
  of every decode step calls the kernel, and the tokens and logits are those of the
  CPU's blocked backend over the same pool (``CpuQuantBackend``), for INT2 pages
  with partly held bitmasks, INT4 tokens, and KIVI's float residual.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv.backends import (
    CpuFloatBackend,
    CpuQuantBackend,
    FloatKernelBackend,
    QuantKernelBackend,
    ReferenceBackend,
    kernel_quant,
    select_backend,
)
from jaxkv.cache.pools import FloatLayers
from jaxkv.cache.quantized import Geometry, QuantLayers
from jaxkv.engine import Engine
from jaxkv.policies import layouts


def test_select_backend_is_the_pool_by_platform_table():
    flt, quant = FloatLayers(), QuantLayers(Geometry(2, 8))
    assert type(select_backend(flt)) is CpuFloatBackend and type(select_backend(quant)) is CpuQuantBackend
    assert type(select_backend(flt, "interpret")) is FloatKernelBackend
    assert type(select_backend(quant, "interpret")) is QuantKernelBackend
    assert select_backend(quant, "interpret").platform == "interpret"
    ref = select_backend(quant, "reference")
    assert type(ref) is ReferenceBackend and type(ref.blocked) is CpuQuantBackend
    assert select_backend(flt).uses_window and not select_backend(flt, "interpret").uses_window
    assert not select_backend(quant, "interpret").uses_window


@pytest.mark.parametrize("mode", ["triaxial", "int4", "kivi2"])
def test_quantized_decode_reaches_the_fused_kernel_and_equals_the_blocked_backend(qmodel, mode, monkeypatch):
    from jaxkv.forward import run_decode

    run_decode.clear_cache()  # the decode program is traced here, so the kernel's trace is seen (a cached program would not call it)
    calls = []
    kernel = kernel_quant.quantized_decode_attention
    monkeypatch.setattr(kernel_quant, "quantized_decode_attention", lambda *a, **k: calls.append(k["backend"]) or kernel(*a, **k))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(5, 500, n).tolist() for n in (80, 30)]
    bits = [np.where(rng.random(len(p)) < 0.6, 2, 4) for p in prompts] if mode == "triaxial" else None
    runs = {}
    for backend in (None, "interpret"):
        e = Engine(qmodel, rows=2, max_positions=128, kv_quant=mode, backend=backend)
        rows = [e.open_row(), e.open_row()]
        e.prefill(rows, prompts, kv_bits=bits)
        keep = np.setdiff1d(np.arange(80), [3, 40, 41, 70])  # pages partly held: their bitmasks read
        e.kv.apply_layout(rows[0], layouts.dead_slot(e.row_state[rows[0]].slots, keep))
        runs[backend] = e.decode(rows, [7, 9], 3, return_logits=True, forced_tokens=[[11, 12], [14, 15]])
        assert type(e.backend) is (QuantKernelBackend if backend else CpuQuantBackend)
    assert calls and set(calls) == {"interpret"}  # the decode loop's layer body calls the kernel (traced once per program)
    if mode == "triaxial":
        assert e.kv.composition(rows[0])[2] > 0  # INT2 pages were read by the kernel
    (tok_cpu, log_cpu), (tok_k, log_k) = runs[None], runs["interpret"]
    assert tok_cpu == tok_k
    for a, b in zip(log_k, log_cpu):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


@pytest.mark.parametrize("kv_quant", [None, "int4"])
def test_a_spliced_step_attends_through_the_backends_entry_by_position(qmodel, kv_quant, monkeypatch):
    """Segment reuse's spliced step writes and attends through the engine's one
    attention entry (``attend_positional``) on either pool kind; over the float pool
    its logits are those of a plain prefill of the same tokens. (A quantized pool's
    spliced tokens read their own keys back at the pool's precision, where a prefill
    piece reads them in full precision, so the two differ there by design.)"""
    from jaxkv.backends.base import AttentionBackend
    from jaxkv.splice import SplicePlan, splice_step

    splice_step.clear_cache()  # the spliced program is traced here, so its layer calls are seen
    layers_read = []
    positional = AttentionBackend.attend_positional
    monkeypatch.setattr(AttentionBackend, "attend_positional", lambda self, kv, i, *a: layers_read.append(i) or positional(self, kv, i, *a))
    rng = np.random.default_rng(2)
    prompt, new = rng.integers(5, 500, 40).tolist(), rng.integers(5, 500, 6).tolist()
    e = Engine(qmodel, rows=2, max_positions=128, kv_quant=kv_quant)
    a, b = e.open_row(), e.open_row()
    e.prefill([a, b], [prompt, prompt])
    spliced, _ = e.splice_prefill(a, SplicePlan.full(new, qmodel.config.num_layers, logit_idx=np.arange(len(new))))
    plain = e.prefill([b], [new], all_logits=True)[0]
    assert layers_read  # the layer body (scanned: traced once) attends through the entry
    if kv_quant is None:
        assert np.abs(np.asarray(spliced) - np.asarray(plain)).max() <= 1e-5 * np.abs(np.asarray(plain)).max()
