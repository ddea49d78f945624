"""Evaluation, by purpose: ``bench`` (speed), ``profile`` (one-off diagnoses),
``quality`` (accuracy studies and reports), ``device`` (the GPU check), ``common``
(the pieces they share); ``tasks`` re-exports ``jaxkv.tasks``. ``eval/README.md``
lists every script, what it makes and its command."""
