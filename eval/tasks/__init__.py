"""Re-export of ``jaxkv.tasks`` (the task generators moved into the package).

``eval.tasks.agent_traces``, ``eval.tasks.mqniah``, ``eval.tasks.shared_docs`` and the submodules
``eval.tasks.agent`` / ``example`` / ``haystack`` / ``mqniah`` / ``words`` keep working: each
submodule name is the ``jaxkv.tasks`` module itself, not a copy.
"""

import sys

from jaxkv.tasks import *  # noqa: F401,F403
from jaxkv.tasks import __all__  # noqa: F401
from jaxkv.tasks import agent, example, haystack, mqniah as _mqniah_module, tokenizer, words

for _name, _module in (("agent", agent), ("example", example), ("haystack", haystack), ("mqniah", _mqniah_module), ("tokenizer", tokenizer), ("words", words)):
    sys.modules[f"{__name__}.{_name}"] = _module
del _name, _module
from jaxkv.tasks import mqniah  # noqa: E402,F811  (the function, as before)
