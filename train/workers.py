"""Jobs across spawned processes, each loading the model once: the runner of long grids.

    for job, result in pool_map(job_fn, jobs, "smollm2-135m-instruct", workers=2, bar=bar):
        ...

``pool_map`` yields ``(job, job_fn(model, job, progress))`` as jobs finish: in this
process and in order when ``workers == 1``, else across ``workers`` spawned processes
in completion order. A replay is one sequence of small jitted steps, so on a CPU
with C cores up to C workers scale nearly linearly.

Invariants: every job runs in a process of its own (a one-process executor shut down
after its job), which loads the model by name and turns on JAX's persistent
compilation cache; a closed generator or an error drops the jobs still pending. The
reasons are in ``pool_map``'s docstring.

Its users: ``train.replay.run_cells`` (the evaluation harness's cells and the
TriAxialKV calibration's sweep) and ``eval.quality.repair_protocol``.
"""

from __future__ import annotations

import queue


def pool_map(job_fn, jobs, model_name, *, workers=1, model=None, bar=None, label=None):
    """Yield ``(job, job_fn(model, job, progress))`` as jobs finish.

    ``workers == 1``: in this process, in order, with ``model``. Otherwise across
    ``workers`` spawned processes (each loads ``model_name`` once), in completion
    order. ``job_fn`` must be a module-level function (it is pickled); it calls
    ``progress(n)`` after each example, which advances ``bar``; ``label(job)`` is
    shown on the bar while (in-process) or after (workers) a job runs.

    Each job runs in a process of its own (a one-process executor shut down
    after its job; an executor with ``max_tasks_per_child=1`` also starts a
    replacement after each job, which loads the model for nothing once the jobs
    run out): a worker's memory grows with every example it replays (each new trace length
    and budget compiles more programs; ~65 MB an example on SmolLM2), and a
    worker kept across cells reached 14 GB and was killed for memory three cells
    into a 15-cell grid. A fresh worker costs one model load and one cell's
    compiles (~1 minute on SmolLM2, against ~25 minutes a cell), less the programs
    JAX's persistent cache already holds (each worker turns it on).
    """
    if workers == 1 or len(jobs) <= 1:
        for job in jobs:
            if bar is not None and label is not None:
                bar.set_postfix_str(label(job))
            yield job, job_fn(model, job, None if bar is None else bar.update)
        return
    import concurrent.futures as cf
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        ticks = manager.Queue()  # examples replayed by the workers, for the progress bar
        waiting, pending = list(jobs), {}
        try:
            while waiting or pending:
                while waiting and len(pending) < workers:
                    job = waiting.pop(0)
                    worker = cf.ProcessPoolExecutor(max_workers=1, mp_context=ctx, initializer=_worker_init, initargs=(model_name, ticks))
                    pending[worker.submit(_worker_job, job_fn, job)] = job, worker
                    worker.shutdown(wait=False)  # its process exits after this one job
                finished, _ = cf.wait(pending, timeout=0.5, return_when=cf.FIRST_COMPLETED)
                _drain(ticks, bar)
                for fut in finished:
                    job, worker = pending.pop(fut)
                    result = fut.result()
                    if bar is not None and label is not None:
                        bar.set_postfix_str("done " + label(job))
                    yield job, result
        finally:  # an error or a closed generator: the other workers' jobs are dropped
            for fut, (_, worker) in pending.items():
                fut.cancel()
                worker.shutdown(wait=True, cancel_futures=True)
        _drain(ticks, bar)


def _drain(ticks, bar):
    """Move the example counts the workers reported so far onto ``bar``."""
    n = 0
    while True:
        try:
            n += ticks.get_nowait()
        except queue.Empty:
            break
    if bar is not None and n:
        bar.update(n)


_WORKER_MODEL = None
_WORKER_TICKS = None


def _worker_init(model_name, ticks):
    global _WORKER_MODEL, _WORKER_TICKS
    import jaxkv
    from jaxkv import compiles

    # Every worker is fresh (one job each, ``pool_map``) and its cell's programs are
    # mostly those an earlier worker (or the parent) already compiled: JAX's persistent
    # cache ($JAXKV_XLA_CACHE, off with ``off``) loads them instead.
    compiles.enable_persistent_cache()
    _WORKER_MODEL = jaxkv.load_model(model_name)
    _WORKER_TICKS = ticks


def _worker_job(job_fn, job):
    return job_fn(_WORKER_MODEL, job, lambda n: _WORKER_TICKS.put(n))
