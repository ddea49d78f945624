"""The one-command device check (``python -m eval.device.check``) and its report."""
