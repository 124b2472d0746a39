"""The one error type users see: its message is a single line naming the file or tensor and the fix."""


class Fp8kitError(Exception):
    pass
