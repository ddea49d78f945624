"""Speed benchmarks: jaxkv against a reference (transformers, the previous engine, peer
servers), each writing a table under ``eval/results/``. See ``eval/README.md``."""
