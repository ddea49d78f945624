"""What the eval scripts share: one bootstrap (``stats``) and one runner for servers
started in a subprocess (``servers``). Their markdown tables come from ``jaxkv.markdown``."""
