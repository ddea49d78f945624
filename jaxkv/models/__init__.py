"""Flax NNX ports of the supported decoder families and their checkpoint loading."""
