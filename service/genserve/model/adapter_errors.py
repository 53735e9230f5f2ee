"""The two ways an adapter request fails, without torch: the server and the engine catch
and raise these while the model (and torch) may not be imported yet (the launcher opens the
port first, and ``genserve --help`` never imports torch)."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter that does not fit the base model (or cannot be read); names the mismatch."""


class AdapterNotFoundError(LookupError):
    """No adapter directory (or cached hub snapshot) for this id."""
