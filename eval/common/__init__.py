"""What the eval and train scripts share: one bootstrap (``stats``), one markdown table
writer (``tables``) and one runner for servers started in a subprocess (``servers``)."""
