"""The OpenAI-compatible HTTP layer over the scheduler (``jaxkv serve``).

A thin layer: it turns ``POST /v1/chat/completions`` requests into session turns
on one shared ``jaxkv.Server`` (continuous batching, radix prefix cache,
retention, RepairKV, KV precision, segment reuse) and the turns back into
OpenAI responses or SSE streams. It never runs the model itself.

* ``app``: ``create_app(server, ServeConfig(...))``, the FastAPI routes
  (``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``);
* ``protocol``: request checking, response and chunk shapes;
* ``streaming``: token ids to message deltas that concatenate to the final reply;
* ``sessions``: tenants (API keys), session keys, the options a request may set
  (``OptionRules``: defaults and the ``--allow`` list), turn reports (the
  response's ``jaxkv`` object), the session store;
* ``errors``: OpenAI's error shape and the status of every typed error;
* ``metrics``: ``/metrics`` through ``prometheus_client``: ``Server.snapshot()``,
  the HTTP layer's counts and the latency histograms (time to first token,
  inter-token, queue wait);
* ``run``: ``make_app`` (checks the rules against the pool at start-up),
  ``BackgroundServer`` (uvicorn in a thread) and ``serve`` (flags to rules).

FastAPI, uvicorn and prometheus_client are the optional extra ``serve``
(``pip install jaxkv[serve]``);
``import jaxkv`` never imports this package, and this package imports them only
when a name that needs them is first used (``jaxkv serve --help`` works without).
"""

import importlib

_EXPORTS = {
    "BackgroundServer": "jaxkv.server.run",
    "OptionRules": "jaxkv.server.sessions",
    "ServeConfig": "jaxkv.server.app",
    "create_app": "jaxkv.server.app",
    "make_app": "jaxkv.server.run",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxkv.server' has no attribute {name!r}")
