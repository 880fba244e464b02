from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # the folder holding train.py; config paths are relative to it


def resolve_path(path):
    """Config paths are relative to the repository root, not to the working directory."""
    path = Path(path).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path
