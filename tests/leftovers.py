"""What a conversion killed outright (SIGKILL, the OOM killer) leaves, made by hand for the tests."""

from pathlib import Path


def killed_partial(folder: Path) -> Path:
    """A converter's temporary folder as a killed run leaves it: its WRITING file there, locked by no process (a
    live writer holds it locked; a folder without one is being made this instant, or made where no lock can be had,
    and is never taken for abandoned)."""
    from fp8kit.converter.output import WRITING

    folder.mkdir()
    (folder / WRITING).touch()
    return folder
