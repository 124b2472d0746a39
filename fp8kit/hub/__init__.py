"""Publishing FP8 variants to the Hugging Face Hub: validate, card, upload, register."""

from fp8kit.hub.publish import PublishResult, publish

__all__ = ["publish", "PublishResult"]
