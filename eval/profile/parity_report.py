"""Print jaxkv-vs-transformers parity figures on tiny random models of each family.

    JAX_PLATFORMS=cpu python -m eval.profile.parity_report

For a Qwen2 (q/k/v biases, untied), a Qwen3 (q/k norm, head_dim != hidden/heads,
tied) and a Llama (llama3 rope scaling, untied), built with transformers + torch
and saved to a temporary folder: max|diff| / max|ref| of full-sequence logits
(96 tokens) in float32 and bfloat16, of chunked prefill + teacher-forced decode
through the paged cache against ``score_logits``, and whether greedy
``jaxkv.generate`` reproduces HF ``generate`` (32 new tokens, batch of two prompts
of different lengths). The tests assert the thresholds; this prints the values.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hf_models  # noqa: E402
import jaxkv  # noqa: E402
from jaxkv.markdown import md_header, md_row  # noqa: E402


def _rel(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def main() -> None:
    rng = np.random.default_rng(0)
    print("\n".join(md_header(["family", "f32 logits", "bf16 logits", "paged prefill+decode", "greedy 32 tokens = HF"], "lrrrl")))
    for family in ("qwen2", "qwen3", "llama"):
        with tempfile.TemporaryDirectory() as folder:
            tm = hf_models.build(family, folder)
            ids = rng.integers(0, hf_models.VOCAB, (1, 96))
            with torch.no_grad():
                ref = tm(torch.tensor(ids)).logits.double().numpy()[0]
            f32 = jaxkv.load_model(folder)
            bf16 = jaxkv.load_model(folder, dtype="bfloat16")
            e32 = _rel(jaxkv.score_logits(f32, ids)[0], ref)
            e16 = _rel(jaxkv.score_logits(bf16, ids)[0], ref)
            engine = jaxkv.Engine(f32, rows=1, max_positions=128, prefill_chunk=32)
            row = engine.open_row()
            seq = ids[0].tolist()
            pre = engine.prefill([row], [seq[:70]], all_logits=True)[0]
            _, dec = engine.decode([row], [seq[70]], 25, return_logits=True, forced_tokens=[seq[71:96]])
            epd = _rel(np.concatenate([pre, dec[0]]), ref[:95])
            prompts = [rng.integers(0, hf_models.VOCAB, 17).tolist(), rng.integers(0, hf_models.VOCAB, 40).tolist()]
            ours = jaxkv.generate(f32, prompts, 32)
            width = max(map(len, prompts))
            batch = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.no_grad():
                hf = tm.generate(batch, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)[
                    :, width:
                ].tolist()
            print(md_row([family, f"{e32:.2e}", f"{e16:.2e}", f"{epd:.2e}", ours == hf]), flush=True)


if __name__ == "__main__":
    main()
