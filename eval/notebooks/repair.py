# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # RepairKV: the matched-budget protocol on split-query MQ-NIAH
#
# Each example is a long document with key-value needles; turn 1 asks for some keys,
# the cache is compressed by the first-stage policy (SnapKV by default) to `B_base`
# with the evicted rows shelved in the host tier, and turn 2 asks for other keys.
# Cells (`eval/quality/repair_protocol.py`, the same driver as `python -m eval.quality.repair_protocol`):
# the full cache, no repair at `B_base`, matched no-repair at `B_base + K`, and each
# repair policy at `B_base` with `K` rows promoted back before turn 2. Reported:
# exact match after turn 1, the gain of REPAIRKV over matched no-repair with a paired
# bootstrap 95% interval, and the paper's Figure 2 layout.
#
# **Running it.** Stored as a jupytext percent script without outputs:
#
# ```bash
# jupytext --to ipynb eval/notebooks/repair.py
# papermill eval/notebooks/repair.ipynb out.ipynb -p needles 2,4 -p n 20
# ```
#
# The defaults are a small CPU run on the embedded model (about half a minute).

# %% tags=["parameters"]
# The model and where it runs.
model = "embedded"  # checkpoint folder, Hugging Face repo id, or "embedded"
dtype = "float32"  # "bfloat16": weights, KV pool and decode kernels in bf16 (softmax in float32)
tp = 1  # tensor-parallel devices: a jax.sharding Mesh over the first tp devices (1: one device)
# The protocol.
needles = "4"  # MQ-NIAH needle counts, comma list of 2, 4, 6, 8
turns = 2  # 5: the repeated-shift schedule (needles 4 or 8)
first_stage = "snapkv"  # snapkv, h2o, streaming_llm, or any policy name (intentkv_memory, intentkv: the learned head)
ks = "16,48"  # restore budgets K
policies = "repairkv,random,oldest"  # of repairkv, random, oldest, staleq, wrongq, refresh
n = 3  # examples per cell
length = 600  # document tokens
max_new_tokens = 24
base_budget = 60  # B_base; None: calibrated (matched no-repair at K = 96 nearest half the full cache)
out_dir = "eval/results/notebook_repair"  # results.csv, results.md, repair_vs_k.png, figure2.png, examples.jsonl

# %% [markdown]
# ## Parameters for a real Qwen checkpoint on one A100
#
# | parameter | CPU default | one A100 (80 GB) | why |
# |---|---|---|---|
# | `model` | `embedded` | `Qwen/Qwen2.5-7B-Instruct` | the RepairKV paper's model |
# | `dtype` | `float32` | `bfloat16` | 15 GB of weights; KV pool in bf16 |
# | `tp` | 1 | 1 | one GPU (Qwen2.5-7B has 4 KV heads: `tp` up to 4 on a multi-GPU host) |
# | `needles` | `4` | `2,4,6,8` | the paper's 2Q/4Q/6Q/8Q |
# | `turns` | 2 | 2 (then 5 with `needles=8`, K = 80: §5.3) | |
# | `first_stage` | `snapkv` | `snapkv` (then `h2o`, `streaming_llm`: §5.4) | |
# | `ks` | `16,48` | `8,16,24,32,48,64,80,96,128` | the paper's restore budgets |
# | `policies` | 3 | `repairkv,random,oldest,staleq,wrongq,refresh` | every control |
# | `n` | 3 | 100 | |
# | `length` | 600 | 30000 | about 32K rendered tokens with the questions: the model's whole context (32,768) |
# | `max_new_tokens` | 24 | 64 | |
# | `base_budget` | 60 | 8192 (2Q), 16384 (4Q), 18432 (6Q, 8Q); one needle count per run, or `None` to calibrate | the paper's B_base |
# | `out_dir` | `eval/results/notebook_repair` | e.g. `eval/results/a100_repair` | runs into one folder build one report |
#
# Decode attention uses the Triton kernels on an NVIDIA GPU without a parameter
# (`pip install -e ".[cuda]"`; the first cell below prints which kernels run).
# Memory at those settings: 15 GB of weights plus a pool of 65,537 slots (2 x 32,768 + 1)
# x 56 KiB per token (28 layers, 4 KV heads, bf16) = 3.5 GiB; the host tier keeps the
# evicted rows in host RAM.
# The journal in `out_dir` makes long runs resumable (`python -m eval.quality.repair_protocol --resume`).
#
# IntentKV as the first stage: `first_stage="intentkv_memory"` (the rule), or `"intentkv"`
# (the learned head: the shipped one is the embedded model's; a Qwen checkpoint needs its
# own, `python -m train.intentkv_head`). Segment reuse spans sessions that share
# documents; its notebook is `retention.py` with `task="shared_docs"` and `reuse`.
# **Later (another issue):** TriAxialKV quantized pools under repair.

# %%
import jax

import jaxkv
from eval.quality import repair_protocol
from jaxkv.models.sharding import make_mesh
from jaxkv.kernels import resolve_backend

mesh = make_mesh(tp=tp) if tp > 1 else None
loaded = jaxkv.load_model(model, dtype=dtype, mesh=mesh)
cfg = loaded.config
print(
    f"{model}: {cfg.model_type}, {cfg.num_layers} layers, {cfg.num_heads}/{cfg.num_kv_heads} heads, {dtype}; "
    f"devices {jax.devices()}; decode kernels: {resolve_backend(None)}"
)

# %%
argv = [
    "--model",
    str(model),
    "--needles",
    str(needles),
    "--turns",
    str(turns),
    "--first-stage",
    first_stage,
    "--ks",
    str(ks),
    "--policies",
    policies,
    "--n",
    str(n),
    "--length",
    str(length),
    "--max-new-tokens",
    str(max_new_tokens),
    "--out",
    out_dir,
]
if base_budget is not None:
    argv += ["--base-budget", str(base_budget)]
rows = repair_protocol.run(repair_protocol.build_parser().parse_args(argv), model=loaded)

# %% [markdown]
# ## Results

# %%
from pathlib import Path

from IPython.display import Image, Markdown, display

display(Markdown(repair_protocol.markdown(rows)))
for name in ("figure2.png", "repair_vs_k.png"):
    display(Image(filename=str(Path(out_dir) / name)))
