"""Load generation and measurement for ``kvasir bench``."""
