"""Accuracy studies and their reports: the ``jaxkv eval`` harness, the real-model grid,
the kvpress side, token sets, the repair protocol and the report writers that turn their
journals into ``eval/results/`` tables. See ``eval/README.md``."""
