"""One-off profiles and diagnoses: where time goes, why a number moved, parity checks.
Each answers one question once; see ``eval/README.md``."""
