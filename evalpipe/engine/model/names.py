"""The built-in models' names: plain strings, torch-free, so the HTTP process and the launchers' flag checks can
name and recognise them without importing the model code (engine/model/weights.py resolves them to checkpoints)."""

TINY_MODEL_NAME = "evalpipe-tiny-dsv4"  # random weights from seed 0: every lane runs, nothing is answered
DEFAULT_MODEL_NAME = "evalpipe-skills-dsv4"  # trained on evalpipe.skills (training/), shipped in the package
BUILTIN_MODEL_NAMES = (DEFAULT_MODEL_NAME, TINY_MODEL_NAME)
