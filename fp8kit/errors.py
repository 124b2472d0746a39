"""The one error type users see: its message is a single line naming the file or tensor and the fix."""


class Fp8kitError(Exception):
    pass


def first_line(e: BaseException) -> str:
    """The first non-blank line of a library's exception (transformers' run over several lines), for an
    Fp8kitError's one line."""
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__).rstrip(": ")
