"""What rounding prefill read lengths to powers of two would cost and save, on this CPU.

    OMP_NUM_THREADS=1 JAX_PLATFORMS=cpu JAXKV_XLA_CACHE=off \
      XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" \
      taskset -c 0 python eval/bench_read_length.py --rule multiple --tokens 4096
    ... --rule pow2 --tokens 4096        # one process per rule and length, one at a time

``jaxkv.buckets.read_length`` rounds the live length a step reads to a power of two up
to 512, then to a multiple of 512, so a fresh engine compiles one prefill program per
512 tokens of prompt (``eval.bench_prefill.prefill_programs``). Rounding to powers of
two all the way would compile log2 as many, at the price of each step gathering and
attending over up to twice the rows it needs. This script times ``Engine.prefill`` of
one random prompt on a fresh engine (``eval.bench_prefill.time_jaxkv``: the first
call with its compiles, then the median of two) under ``--rule multiple`` (the
engine's rule) or ``--rule pow2`` (``read_length`` replaced for this process only),
and prints one JSON line with the load average. The persistent compilation cache
must be off (``JAXKV_XLA_CACHE=off``) or the first call loads instead of compiling.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxkv  # noqa: E402
from eval.bench_prefill import prefill_programs, time_jaxkv  # noqa: E402
from jaxkv import buckets  # noqa: E402


def pow2_read_length(live: int, max_positions: int) -> int:
    """The alternative rule: the next power of two (at least 16), at most the positions."""
    return min(1 << (max(int(live), 16) - 1).bit_length(), max_positions)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rule", choices=("multiple", "pow2"), required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    if args.rule == "pow2":
        buckets.read_length = pow2_read_length
    programs = prefill_programs(args.tokens, 512)  # under the rule in force
    model = jaxkv.load_model(args.model)
    first, warm = time_jaxkv(model, args.tokens, 512, 2)
    record = {"rule": args.rule, "tokens": args.tokens, "programs": programs, "first_s": round(first, 1),
              "warm_s": round(warm, 1), "load_before": load_before, "load_after": os.getloadavg()}
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
