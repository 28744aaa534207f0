"""Training of the default model (not part of the installed package)."""
