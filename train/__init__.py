"""Training scripts, and the measurements the trainers share with the evaluation.

The scripts: the embedded default model (``train.embedded_model``), the IntentKV head
(``train.intentkv_data``, ``train.intentkv_head``) and the TriAxialKV calibration
(``train.calibrate_triaxial``). What they share with ``eval/``: the replay of scored
conversations through sessions (``train.replay``, with its process pool
``train.workers``), the measures of a real-model example (``train.haystack_measure``)
and the JSON-lines journals of long runs (``train.journal``). ``eval/`` imports these;
``train/`` never imports ``eval/`` (``pyproject.toml``, ``[tool.importlinter]``).
"""
