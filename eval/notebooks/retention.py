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
# # Retention policies: accuracy and KV cost against the budget
#
# Generated agent conversations (and MQ-NIAH documents) are replayed turn by turn
# through `jaxkv.Session` for every cell (method x budget x layout) of a grid, with
# the evaluation harness (`eval/quality/harness.py`, the code behind `jaxkv eval`): the
# recorded history is teacher-forced, each assistant turn is generated greedily and
# scored by exact match. Per cell: accuracy, completion, peak live KV, raw and
# effective KV reads, and the prefix-hit rate of each layout (dead-slot eviction keeps
# the radix cache's reuse, compaction loses it).
#
# **Running it.** Stored as a jupytext percent script without outputs; papermill runs
# it with parameters:
#
# ```bash
# jupytext --to ipynb eval/notebooks/retention.py
# papermill eval/notebooks/retention.ipynb out.ipynb -p n 20 -p budgets 256,512
# ```
#
# The defaults are a small CPU run on the embedded model (about half a minute); the
# next cell lists the parameters, the one after it the settings for a real Qwen
# checkpoint on one A100.

# %% tags=["parameters"]
# The model and where it runs.
model = "embedded"  # checkpoint folder, Hugging Face repo id, or "embedded" (the shipped 1.1M-parameter model)
dtype = "float32"  # "bfloat16": weights, KV pool and decode kernels in bf16 (softmax in float32)
tp = 1  # tensor-parallel devices: a jax.sharding Mesh over the first tp devices (1: one device)
# The grid.
task = "agent"  # "agent", "mqniah", or "agent,mqniah"
methods = "full,snapkv,streaming_llm"  # "full" and names of jaxkv.policies.REGISTRY
budgets = "192,384"  # retention budgets B (tokens of compressible history)
layouts = "dead_slot,compact"
n = 2  # examples per cell
length = 512  # target tokens per conversation
max_new_tokens = 48
repair_ks = ""  # e.g. "32,96": adds RepairKV and matched no-repair cells (repair.py runs the full protocol)
reuse = "-"  # cross-query segment reuse, with task "shared_docs": modes of none, segment, cacheblend ("-": off)
out_dir = "eval/results/notebook_retention"  # results.csv, results.md, PNG plots

# %% [markdown]
# ## Parameters for a real Qwen checkpoint on one A100
#
# | parameter | CPU default | one A100 (80 GB) | why |
# |---|---|---|---|
# | `model` | `embedded` | `Qwen/Qwen3-8B` | the IntentKV paper's backbone (a local folder works too) |
# | `dtype` | `float32` | `bfloat16` | 16 GB of weights; KV pool in bf16 |
# | `tp` | 1 | 1 | one GPU; on a multi-GPU host, `tp` up to the KV-head count (8) |
# | `task` | `agent` | `agent,mqniah` | |
# | `methods` | 3 | `full,streaming_llm,snapkv,h2o,tova,random,oldest,agentkv,intentkv_memory,intentkv_query` | every rule-based method; `intentkv` (the learned head) needs a head trained for the checkpoint (`python -m train.intentkv_head`), the shipped one is the embedded model's |
# | `budgets` | `192,384` | `4096,8192,16384` | the papers' budgets: 8k is IntentKV's stress regime |
# | `layouts` | both | `dead_slot,compact` | |
# | `n` | 2 | 100 | |
# | `length` | 512 | 32768 | 32K-token conversations |
# | `max_new_tokens` | 48 | 256 | |
# | `repair_ks` | none | `32,96` | optional RepairKV cells |
# | `reuse` | `-` | `none,segment,cacheblend` with `task` `shared_docs` | segment reuse against CacheBlend (docs/reuse.md); one table per mode |
# | `out_dir` | `eval/results/notebook_retention` | e.g. `eval/results/a100_retention` | |
#
# Decode attention uses the Triton kernels on an NVIDIA GPU without a parameter
# (`pip install -e ".[cuda]"`; the first cell below prints which kernels run);
# prefill and the MLP are XLA. Memory at those settings: 16 GB of weights plus a pool
# of 81,921 slots (2 x 40,960 positions + 1) x 144 KiB per token (36 layers, 8 KV heads,
# bf16) = 11 GiB.
#
# **Later (another issue):** TriAxialKV quantization will add its parameters here
# when it lands.

# %%
import jax

import jaxkv
from eval.quality import harness
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
    "--task",
    task,
    "--methods",
    methods,
    "--budgets",
    str(budgets),
    "--layouts",
    layouts,
    "--n",
    str(n),
    "--length",
    str(length),
    "--max-new-tokens",
    str(max_new_tokens),
    "--reuse",
    str(reuse),
    "--out",
    out_dir,
]
if str(repair_ks).strip():
    argv += ["--repair-ks", str(repair_ks)]
rows = harness.run(harness.build_parser().parse_args(argv), model=loaded)

# %% [markdown]
# ## Results

# %%
from pathlib import Path

from IPython.display import Image, Markdown, display

metrics = ("accuracy", "raw_kv_reads") + (("prefill_tokens_computed", "accept_rate") if str(reuse) != "-" else ())
for t in task.split(","):
    for mode in dict.fromkeys(r["reuse"] for r in rows):  # "-": the reuse stage is off
        for metric in metrics:
            title = f"### {t}: {metric}" + ("" if mode == "-" else f", reuse {mode}")
            display(Markdown(f"{title}\n\n" + harness.pivot_table([r for r in rows if r["reuse"] == mode], metric, t)))
display(Markdown(harness.prefix_summary(rows).replace("\n", "\n\n")))
for png in sorted(Path(out_dir).glob("*.png")):
    display(Image(filename=str(png)))
