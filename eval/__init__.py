"""Evaluation: synthetic tasks (``eval.tasks``), harnesses, reports and plots."""
