from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # the folder holding train.py; config paths are relative to it
