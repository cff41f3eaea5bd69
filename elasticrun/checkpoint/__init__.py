"""checkpoint layer."""
