"""The built-in models' names: plain strings, torch-free, so the HTTP process and the launchers' flag checks can
name and recognise them without importing the model code (engine/model/weights.py resolves them to checkpoints)."""

TINY_MODEL_NAME = "evalpipe-tiny-dsv4"  # random weights from seed 0: every lane runs, nothing is answered
DEFAULT_MODEL_NAME = "evalpipe-skills-dsv4"  # trained on evalpipe.skills (training/), shipped in the package
# The first trained default (window 64, recipe v1), shipped beside it so figures measured on it can be re-run; it
# answers arith but does not copy and seldom retrieves (docs/default-model.md)
WINDOW64_MODEL_NAME = "evalpipe-skills-dsv4-w64"
PACKAGED_MODEL_NAMES = (DEFAULT_MODEL_NAME, WINDOW64_MODEL_NAME)
BUILTIN_MODEL_NAMES = (*PACKAGED_MODEL_NAMES, TINY_MODEL_NAME)
