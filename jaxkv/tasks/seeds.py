"""The seed bases of the held-out evaluation sets of the synthetic tasks.

Every synthetic example is a pure function of its seed, so an evaluation set is named
by the seed base its generator call starts from. The bases live here, beside the
generators, because the evaluation draws its sets from them and the trainers must keep
away from them (``train.intentkv_data.check_seed_ranges`` asserts that its training and
held-out seeds meet none of the ranges below).

* ``EVAL_SEED_BASE`` (``2**30 + 9,000,000``): the evaluation harness's sets
  (``eval.quality.harness.make_examples``: ``agent_traces(n, EVAL_SEED_BASE)``,
  ``mqniah(n, EVAL_SEED_BASE + 500,000)``, ``shared_docs(n, EVAL_SEED_BASE + 700,000)``;
  a batch call draws example ``i`` from ``example.example_seed(base, i)``), and the base
  of the held-out traces the benchmarks and tests offset from it.
* ``ACCURACY_SEED_BASE`` (``2**30 + 7,000,000``): ``eval.quality.embedded_accuracy``'s
  per-example seeds, ``ACCURACY_SEED_BASE + i`` (``one_mqniah``) and
  ``ACCURACY_SEED_BASE + 100,000 + i`` (``one_trace``).

The real-model tasks keep their base with their generator (``haystack.EVAL_SEED``), and
the demo its own (``jaxkv.demo.DEMO_SEED_BASE``).
"""

EVAL_SEED_BASE = (1 << 30) + 9_000_000
ACCURACY_SEED_BASE = (1 << 30) + 7_000_000
