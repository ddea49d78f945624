"""Start-up cost of ``jaxkv serve``: from the command to an open port, with the
programs its warm-up compiled.

    JAX_PLATFORMS=cpu python -m eval.bench.warmup [--model embedded] [--rows 4]
        [--max-positions 4096] [--policies none|all|A,B] [--out FILE.md]

Starts ``jaxkv serve`` (``python -m jaxkv.cli serve``: its defaults, plus
``--allow-policies`` with the policies asked: ``none``, the default, is
``jaxkv serve`` as it comes; ``all`` allows every registered retention policy)
twice, one after the other: first with an empty persistent compilation cache (a
fresh folder: every program compiled, the cold start), then on the cache the first
left (a restart: programs loaded). For each it records the seconds from the
command to the first answer of ``GET /v1/models`` (the port open and serving),
the XLA programs the warm-up compiled or loaded and its seconds (the server's
``jaxkv_warmup_programs`` / ``jaxkv_warmup_seconds`` on ``/metrics``, read with
``prometheus_client``'s parser), and the engine's bounded shape set
(``jaxkv.buckets.shape_set``). CPU only; absolute numbers are for the machine
named in the header. The 1-minute load average before and after is printed: a run
that starts above 0.5 (another job on the machine) is not a start-up figure.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from pathlib import Path

from eval.common.servers import ServerProcess, free_port, metric
from jaxkv.markdown import md_table


def start(args, cache: str, log: Path) -> dict:
    """One ``jaxkv serve`` start: seconds to an open port and the warm-up's metrics
    (the server's output in ``log``)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "jaxkv.cli",
        "serve",
        "--model",
        args.model,
        "--rows",
        str(args.rows),
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    if args.max_positions:
        argv += ["--max-positions", str(args.max_positions)]
    if args.policies != "none":
        from jaxkv.policies import REGISTRY

        argv += ["--allow-policies", ",".join(sorted(REGISTRY) if args.policies == "all" else args.policies.split(","))]
    env = {**os.environ, "JAXKV_XLA_CACHE": cache, "JAX_PLATFORMS": "cpu"}
    with ServerProcess(argv, port, name="jaxkv serve", env=env, log=log, timeout=3600.0, poll_s=0.2) as server:
        text = server.metrics()
        return {
            "port_open_s": server.start_s,
            "warmup_programs": int(metric(text, "jaxkv_warmup_programs")),
            "warmup_s": metric(text, "jaxkv_warmup_seconds"),
            "cache_hits": int(metric(text, "jaxkv_xla_cache_hits_total")),
        }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--max-positions", type=int, default=4096)
    ap.add_argument("--policies", default="none", help="retention policies allowed: none, all, or names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import jaxkv
    from jaxkv.engine import PREFILL_CHUNK
    from jaxkv.serving.scheduler import DECODE_CHUNK
    from jaxkv import buckets

    P = args.max_positions or min(jaxkv.load_model(args.model).config.max_position_embeddings, 8192)
    shapes = buckets.shape_set(args.rows, P, buckets.token_budget(PREFILL_CHUNK, args.rows), DECODE_CHUNK)
    load_before = os.getloadavg()[0]
    runs = []
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as logs:
        for i, label in enumerate(("cold (empty cache)", "restart (cache filled)")):
            runs.append((label, start(args, cache, Path(logs) / f"serve-{i}.log")))
            print(label, runs[-1], flush=True)
    load_after = os.getloadavg()[0]
    lines = [
        f"# `jaxkv serve` start-up: {args.model}, rows={args.rows}, max_positions={P}, retention policies allowed: {args.policies}",
        "",
        f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores; `python -m eval.bench.warmup"
        f" --model {args.model} --rows {args.rows} --max-positions {args.max_positions} --policies {args.policies}`; "
        f"1-minute load average {load_before:.2f} before, {load_after:.2f} after. The engine's shape set: "
        f"{len(shapes.steps)} step token buckets ({', '.join(map(str, shapes.steps))}) and {len(shapes.decode)} decode "
        f"programs (rows x window width), {shapes.size} in all; the warm-up also compiles the feature-capturing "
        "variants the allowed policies need, their event programs and the turn pipeline's small programs.",
        "",
        md_table(
            ["start", "seconds to an open port", "warm-up: XLA programs compiled or loaded", "warm-up seconds", "loaded from the cache"],
            [[label, f"{r['port_open_s']:.1f}", r["warmup_programs"], f"{r['warmup_s']:.1f}", r["cache_hits"]] for label, r in runs],
            align="lrrrr",
        ),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
